"""What is at a chunk file's name, and opening it only when it is a regular file.

The disk tier's directory is not trusted: a FIFO named like a chunk file would hang a plain ``open`` until a
writer came (every reader, forever), a symbolic link could point anywhere (``/dev/zero``), and a directory would
make every read fail. A chunk is opened only through ``open_chunk``, which never blocks, never follows a link and
refuses (``NotAFileError``, a miss) anything but a regular file, before a byte of it is read.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO

from pic.store import serde

REGULAR = "a regular file"
# What open() says when the name is not a file it may read: a symbolic link (O_NOFOLLOW), a socket, a device
# without a driver; ``open_chunk`` then looks (lstat) at what is there.
_NOT_A_FILE_ERRNOS = frozenset({errno.ELOOP, errno.ENXIO, errno.ENODEV, errno.EISDIR, errno.EOPNOTSUPP})
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC


class NotAFileError(serde.CorruptEntryError):
    """The name of a chunk file holds something else (a directory, a FIFO, a symbolic link, a socket, a device):
    a miss, never a read of it (``kind``: what is there, ``"a FIFO"``)."""

    def __init__(self, path: Path, kind: str) -> None:
        super().__init__(f"{path} is {kind}, not a chunk file")


def describe(mode: int) -> str:
    """What a file of ``mode`` (``st_mode``) is, for messages: ``REGULAR``, ``"a directory"``, ``"a FIFO"`` ..."""
    kinds = [(stat.S_ISREG, REGULAR), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
             (stat.S_ISLNK, "a symbolic link"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device")]  # fmt: skip
    return next((kind for test, kind in kinds if test(mode)), f"a file of mode {mode:o}")


def kind_at(path: Path) -> str | None:
    """What ``path`` itself is (``describe``; a symbolic link is not followed), or ``None`` when nothing is there.

    Raises:
        OSError: it cannot be looked at (the directory is gone or is not one: a failing disk).
    """
    try:
        return describe(os.lstat(path).st_mode)
    except FileNotFoundError:
        return None


def is_regular(path: Path) -> bool:
    """Whether ``path`` is a regular file (not a link to one): what may be a chunk file."""
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        return kind_at(path) == REGULAR
    return False


def open_chunk(path: Path) -> BinaryIO:
    """``path`` opened for reading (unbuffered) if it is a regular file. Never blocks and never follows a symbolic
    link: anything else is refused before a byte of it is read.

    Raises:
        FileNotFoundError: nothing is there.
        NotAFileError: something other than a regular file is there.
        OSError: the disk failed.
    """
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        if exc.errno in _NOT_A_FILE_ERRNOS:
            kind = kind_at(path)
            if kind not in (None, REGULAR):
                raise NotAFileError(path, kind) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotAFileError(path, describe(mode))
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def remove_stray(path: Path) -> bool:
    """Unlink what ``open_chunk`` refused at ``path`` (a FIFO, a symbolic link, a socket, a device node: the name
    goes, nothing it points to), unless it is a directory (which may hold anything: it is left to its owner) or has
    been replaced by a regular file meanwhile. Returns whether it was removed.

    Raises:
        OSError: it could not be unlinked (a read-only disk).
    """
    if kind_at(path) in (None, REGULAR, "a directory"):
        return False
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    return True
