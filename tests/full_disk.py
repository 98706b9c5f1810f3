"""A real full file system for the tests: a small tmpfs mounted for one test (root only; where mounting is
impossible the test skips and says why), and a file that fills it."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(mount: Path, size: str = "2m") -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``mount`` (made if missing), unmounted after; skips the test when it cannot be."""
    mount.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True, text=True,
            timeout=60,
        )  # fmt: skip
        error = done.stderr.strip() or f"exit status {done.returncode}"
    except (OSError, subprocess.SubprocessError) as exc:
        done, error = None, str(exc)
    if done is None or done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {error}")
    try:
        yield mount
    finally:
        if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mount)], check=True)


@pytest.fixture
def small_disk(tmp_path) -> Iterator[Path]:
    """A 2 MiB tmpfs of its own (root only), unmounted after the test."""
    with tmpfs(tmp_path / "small") as mount:
        yield mount


def fill(directory: Path) -> Path:
    """Write a file into ``directory`` until its file system is full (ENOSPC); returns it."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
    block = os.urandom(4096)
    try:
        while True:
            os.write(fd, block)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(fd)
    return filler


def remount(directory: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(directory)], check=True, capture_output=True)
