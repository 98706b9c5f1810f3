"""The disk tier's byte budget: what to evict so that a new chunk file fits, decided under the directory's lock.

Every process sharing a directory keeps its files within one ``capacity`` in bytes. A usage record (``.usage``,
the bytes of every chunk file, read and written under ``disk_file.locked``) spares a listing of the directory
while there is room. It is trusted only to say "there is room": when it says "full", is missing or unreadable,
the directory is listed and the record rewritten from the files. Bytes are reserved before a file is renamed
into place and released after one is unlinked, so a process that dies between its steps leaves the record high
(corrected at the next listing), never low (which could let the files exceed the capacity). A record that cannot
be rewritten (a full disk) is removed (``disk_file.write_usage``): a missing record is never low either. So an
unlink, which works on a full disk, is never failed by the record's rewrite after it.

A file in a chunk's name larger than the capacity, or than any chunk of the model can be (a sparse file claims
gigabytes it does not hold), is never one the budget can keep: a listing removes it first (logged), so that it
never makes the LRU evict every valid file to "make room" beside it. It would be refused unread anyway.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from pic.store import disk_file

log = logging.getLogger("pic.store")


@dataclass(frozen=True)
class Room:
    """What ``make_room`` did.

    Attributes:
        fits: the bytes were reserved (``False``: they cannot fit, and nothing was evicted).
        num_evicted: files removed to make room.
    """

    fits: bool
    num_evicted: int = 0


def make_room(
    directory: Path, *, capacity: int, cache_id: str | None, num_bytes: int, exempt: Collection[str],
    rescan: bool = False, largest: int | None = None,
) -> Room:  # fmt: skip
    """Reserve ``num_bytes`` for ``cache_id`` in ``directory``'s usage record, evicting least recently used files
    not in ``exempt`` first when they do not fit (under ``disk_file.locked(directory)``). ``rescan``: list the
    directory whatever the record says (a start). A listed file larger than ``capacity`` or ``largest`` (the largest
    chunk file of the model) is removed first, alone (``drop_oversized``)."""
    used = None if rescan else disk_file.read_usage(directory)
    num_evicted = 0
    if used is None or used + num_bytes > capacity:
        files = disk_file.listing(directory)
        files.pop(cache_id, None)  # another process's copy of it, which the rename replaces
        drop_oversized(directory, files, limit=capacity if largest is None else min(capacity, largest))
        used, num_evicted = evict(directory, files, capacity=capacity, num_bytes=num_bytes, exempt=exempt)
        if used + num_bytes > capacity:
            disk_file.write_usage(directory, used)
            return Room(fits=False)
    disk_file.write_usage(directory, used + num_bytes)
    return Room(fits=True, num_evicted=num_evicted)


def drop_oversized(directory: Path, files: dict[str, tuple[int, int]], *, limit: int) -> int:
    """Remove the files of ``files`` (``disk_file.listing``, updated) larger than ``limit`` bytes, each logged: no
    chunk the tier may keep is that large, and counted with the others they would have every valid file evicted.
    Returns how many. One that cannot be removed (a read-only disk) is left, and not counted in ``files``."""
    removed = 0
    for cache_id in [cid for cid, (size, _) in files.items() if size > limit]:
        path = directory / f"{cache_id}{disk_file.SUFFIX}"
        size = files.pop(cache_id)[0]
        try:
            path.unlink(missing_ok=True)
            removed += 1
            log.warning("pic: removed %s: %d bytes, more than any chunk file the disk tier keeps (%d)", path, size,
                        limit)  # fmt: skip
        except OSError as exc:
            log.warning("pic: %s has %d bytes, more than any chunk file the disk tier keeps (%d); ignored (cannot "
                        "remove it: %s)", path, size, limit, exc)  # fmt: skip
    return removed


def evict(
    directory: Path, files: dict[str, tuple[int, int]], *, capacity: int, num_bytes: int, exempt: Collection[str]
) -> tuple[int, int]:
    """Remove the least recently used files of ``files`` (``disk_file.listing``) not in ``exempt`` until
    ``num_bytes`` more fit in ``capacity``, and on towards 1/32 of the capacity below that (never past it), so
    that a full directory is listed once per several writes rather than at each; nothing when ``num_bytes``
    cannot fit. Returns the bytes left and the number of files removed."""
    total = sum(size for size, _ in files.values())
    if total + num_bytes <= capacity:
        return total, 0
    victims = [cid for cid in files if cid not in exempt]
    if total - sum(files[cid][0] for cid in victims) + num_bytes > capacity:
        return total, 0
    goal, num_evicted = capacity - num_bytes - capacity // 32, 0
    for cache_id in victims:
        size = files[cache_id][0]
        if total + num_bytes <= capacity and total - size < goal:
            break  # it fits, and one more would evict past the goal
        (directory / f"{cache_id}{disk_file.SUFFIX}").unlink(missing_ok=True)
        total, num_evicted = total - size, num_evicted + 1
    return total, num_evicted


def remove(directory: Path, path: Path) -> bool:
    """Unlink a chunk file of ``directory`` and release its bytes in the usage record; ``False`` if it was not there.

    Something else in a chunk file's name (``disk_entry.open_chunk`` refuses it) is no chunk: a directory is left
    alone (``False``), a FIFO or symbolic link is unlinked without touching the record, which never counted it. A
    record that cannot be rewritten after the unlink stays high or is removed, both safe: the unlink is not undone
    and not failed by it.

    Raises:
        OSError: the file could not be unlinked (a read-only disk).
    """
    with disk_file.locked(directory):
        try:
            st = os.lstat(path)
            if stat.S_ISDIR(st.st_mode):
                return False
            path.unlink()
        except FileNotFoundError:
            return False
        if not stat.S_ISREG(st.st_mode):
            return False
        used = disk_file.read_usage(directory)
        if used is not None:
            with contextlib.suppress(OSError):  # a full disk: the record is removed, or left high
                disk_file.write_usage(directory, max(0, used - st.st_size))
        return True
