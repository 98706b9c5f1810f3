"""The disk tier: compiled chunks in files on a local disk, so they survive a restart.

One file per chunk (``pic.store.disk_file``: the store's serialized form with its checksum, written
atomically) under ``{path}/{model fingerprint}/``, so two models never read each other's chunks. The
directory is the index: a chunk's size is its file's, its last use is the file's mtime (a read touches
it), so two processes on one machine that share the directory share one LRU. Every write commits under
an exclusive ``flock`` on ``{dir}/.lock``: it evicts the least recently used files (never a pinned one
or one the call keeps) until its own fits in ``capacity_bytes``, then renames its file into place. So
the byte limit holds across processes, and reads take no lock (a file evicted while it is being read
stays readable through its open descriptor). The byte budget's bookkeeping is ``pic.store.disk_budget``.

A damaged, truncated or foreign file is logged, removed and a miss (a recompile, never a wrong answer), so
is one that fails the fleet's store key (``pic.store.auth``: forged, altered, written without the key), and so
is anything in a chunk's name that is not a regular file (a FIFO, a symbolic link; a directory is left in
place): a chunk is read only through ``disk_entry.open_chunk``, which never blocks, never follows a link and
bounds every length before it allocates.

A failing disk (read-only, I/O errors) is a ``StoreUnavailableError`` naming the path, or with
``on_error="miss"`` a logged miss, as for Redis. A full or read-only disk still serves what it holds: only
writes need room, so they alone go through a ``Breaker`` (``self.breaker``), which the first write that fails
for want of room (ENOSPC, EDQUOT, EROFS, EIO) opens. While it is open writes fail at once, without writing
half a file first, and ``stats().writable`` says so; after ``retry_s`` one write probes. A tier that starts on
such a disk starts with its breaker open rather than not at all, so a restarted server serves the chunks on it.

The folders the tier creates are 0700 and its files 0600 (``disk_file``); files of older versions are tightened at
start. A file larger than the capacity or than any chunk can be is removed at start, logged, without evicting the
others (``disk_budget.drop_oversized``). A whole file of none of the reader's namespaces (``readable``) is a plain
miss, left in place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import threading
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Literal

from pic.errors import StoreUnavailableError
from pic.kv import ChunkKV
from pic.store import disk_budget, disk_entry, disk_file, serde
from pic.store.auth import store_key as as_store_key
from pic.store.breaker import Breaker
from pic.store.guard import FailureGuard
from pic.store.lease import FleetLeases
from pic.store.tier import Extent, TierStats

log = logging.getLogger("pic.store")

# Failures that say the disk has no room for writes (or takes none): they open the write breaker. Reads go on.
NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO})
# Those a tier still starts on (serving what it holds). EIO is not one: a disk that fails reads is no store.
_START_DESPITE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})


def no_room(exc: BaseException) -> bool:
    """Whether a write's failure says the disk takes no writes now (it opens the write breaker)."""
    return isinstance(exc, OSError) and exc.errno in NO_ROOM


class DiskTier:
    """A directory of chunk files, bounded by bytes, least recently used evicted first.

    Args:
        path: the directory (created if missing); chunks go under ``path/{fingerprint}``.
        expected: what this engine's chunks look like (fingerprint, shape, dtype).
        capacity_bytes: bytes of chunk files it may hold (files' sizes: K, V and metadata).
        on_error: ``"raise"``: a failing disk raises ``StoreUnavailableError`` naming the path; ``"miss"``:
            it is logged, counted and treated as a miss (``put`` then stores nothing).
        part_bytes: read and hash the payload in steps of this many bytes.
        pin: read chunks into page-locked memory.
        retry_s: after a write fails for want of room (a full or read-only disk), writes fail at once for this
            long (``self.breaker``), then one is tried.
        store_key: the fleet's store key (``StoreConfig.store_key``): files are written with its MACs and read only
            when they carry them; ``None``: no MAC written or checked.

    Raises:
        StoreUnavailableError: the directory cannot be created or read (whatever ``on_error`` says: a tier that
            cannot start is a configuration error, not a miss). A full or read-only one starts: it serves what
            it holds, and its writes fail until there is room.
    """

    name = "disk"

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        expected: serde.Expected,
        capacity_bytes: int,
        on_error: Literal["raise", "miss"] = "raise",
        part_bytes: int = 8 * 2**20,
        pin: bool = False,
        retry_s: float = 5.0,
        store_key: bytes | None = None,
    ) -> None:
        self.path = Path(path).expanduser() / expected.fingerprint
        self.capacity_bytes, self._expected, self._on_error = capacity_bytes, expected, on_error
        self._part_bytes, self._pin = part_bytes, pin
        self._store_key = as_store_key(store_key)
        self._largest = disk_file.max_file_bytes(expected)
        self._pinned: set[str] = set()
        self._stats = TierStats(name=self.name, capacity_bytes=capacity_bytes)
        self._last_error: str | None = None
        self._lock = threading.Lock()  # the counters and pins; the directory itself is guarded by flock
        self.breaker = Breaker(f"disk tier at {self.path} (writes)", retry_s=retry_s)
        try:
            disk_file.make_dirs(self.path)
            self._start()
        except OSError as exc:
            if exc.errno not in _START_DESPITE:
                raise StoreUnavailableError(f"disk tier at {self.path} cannot start: {exc}") from exc
            self._start_without_writes(exc)

    def _start(self) -> None:
        """Remove dead writers' temporary files, and evict down to ``capacity_bytes`` (a smaller limit than the
        last run's), redoing the usage record: writes, which a full or read-only disk refuses."""
        removed = disk_file.sweep_tmp(self.path)
        tightened = disk_file.tighten(self.path)
        with disk_file.locked(self.path):
            self._make_room(None, 0, keep=(), rescan=True)
        if removed:
            log.info("pic: removed %d unfinished chunk file(s) of dead writers in %s", removed, self.path)
        if tightened:
            log.info("pic: made %d file(s) in %s readable by their owner only (0600)", tightened, self.path)
        self._warn_if_open()

    def _warn_if_open(self) -> None:
        """Say so when other users may write the folder and nothing authenticates what they write."""
        mode = self.path.stat().st_mode
        if mode & 0o022 and self._store_key is None:
            log.warning(
                "pic: other users may write chunk files into %s (mode %o) and no store key authenticates them: "
                "chmod 700 it, or set a store key", self.path, mode & 0o777,
            )  # fmt: skip

    def _start_without_writes(self, exc: OSError) -> None:
        """Start on a disk that takes no writes (``exc`` said so), with the write breaker open: reads serve the
        chunks it holds. A directory that cannot even be listed is no tier.

        Raises:
            StoreUnavailableError: the directory cannot be listed.
        """
        try:
            held = len(disk_file.listing(self.path))
        except OSError as listing_exc:
            raise StoreUnavailableError(f"disk tier at {self.path} cannot start: {listing_exc}") from listing_exc
        self.breaker.failed(exc)
        reason = errno.errorcode.get(exc.errno or 0, "?")
        log.warning(
            "pic: disk tier at %s is full or read-only (%s: %s): serving the %d chunks it holds; writes fail until "
            "there is room", self.path, reason, exc.strerror or exc, held,
        )  # fmt: skip

    @property
    def last_error(self) -> str | None:
        """Why the latest call failed, for error messages upstream; ``None`` if it did not."""
        return self._last_error

    def _file(self, cache_id: str) -> Path | None:
        return self.path / f"{cache_id}{disk_file.SUFFIX}" if disk_file.is_cache_id(cache_id) else None

    def get(self, cache_id: str, *, readable: Mapping[str, bytes] | None = None) -> ChunkKV | None:
        """The chunk, or ``None``: a miss, also for a file of none of ``readable``'s namespaces (name -> salt;
        ``None``: any namespace's, as before tenants). A damaged or forged file is logged, counted and removed."""
        chunk, path = None, self._file(cache_id)
        with self._guard():
            chunk = None if path is None else self._read(path, cache_id, readable)
        self._count(hits=int(chunk is not None), misses=int(chunk is None))
        return chunk

    def _read(self, path: Path, cache_id: str, readable: Mapping[str, bytes] | None) -> ChunkKV | None:
        try:
            chunk = disk_file.read(
                path, cache_id=cache_id, expected=self._expected, pin=self._pin, readable=readable,
                key=self._store_key,
            )  # fmt: skip
        except FileNotFoundError:  # never written, or evicted (by any process) since
            return None
        except serde.NotReadable:  # perhaps another tenant's: as an id nobody stored
            log.debug("pic: chunk file %s is no namespace's the caller reads: a miss", path)
            return None
        except disk_entry.NotAFileError as exc:
            self._count(errors=1)
            removed = self._discard(path, lambda: disk_entry.remove_stray(path))
            log.warning("pic: %s: a miss (%s)", exc, "removed" if removed else "left in place")
            return None
        except serde.CorruptEntryError as exc:
            self._refuse(path, exc)
            return None
        self._touch(path)  # recently used, for every process sharing the directory
        return chunk

    def _refuse(self, path: Path, exc: serde.CorruptEntryError) -> None:
        """Log, count and remove a file that failed its checks."""
        log.warning("pic: dropping chunk file %s: %s", path, exc)
        self._count(errors=1)
        self._discard(path, lambda: disk_budget.remove(self.path, path))

    @staticmethod
    def _discard(path: Path, remove: Callable[[], bool]) -> bool:
        """``remove()`` a file that reads as a miss; a disk that refuses (read-only) leaves it, and the read is
        still a miss rather than a failure."""
        try:
            return remove()
        except OSError as exc:
            log.warning("pic: cannot remove %s: %s", path, exc)
            return False

    @staticmethod
    def _touch(path: Path) -> bool:
        """Make ``path`` recently used; ``False`` if it is gone. The mtime is only the LRU's hint: a disk that
        cannot record it (read-only) still holds the file."""
        try:
            os.utime(path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        except OSError:
            pass
        return True

    def extent(self, cache_id: str, *, readable: Mapping[str, bytes] | None = None) -> Extent | None:
        """The chunk's size from its file's header and metadata (no payload read; the metadata's MAC checked with
        a store key). A forged file is removed (as by ``get``); a damaged one is a miss here, left for ``get`` to
        remove; one of none of ``readable``'s namespaces is a plain miss."""
        path = self._file(cache_id)
        if path is None:
            return None
        with self._guard():
            try:
                with disk_entry.open_chunk(path) as f:
                    size = os.fstat(f.fileno()).st_size
                    meta = disk_file.read_meta(
                        f, cache_id=cache_id, expected=self._expected, file_bytes=size, readable=readable,
                        key=self._store_key,
                    )  # fmt: skip
                return Extent(len(meta.token_ids), 2 * meta.tensor_bytes, meta.token_ids, meta.options.namespace)
            except serde.ForgedEntryError as exc:
                self._refuse(path, exc)
                return None
            except (FileNotFoundError, serde.CorruptEntryError, serde.NotReadable):
                return None
        return None  # the disk failed and on_error == "miss"

    def peek(self, cache_id: str) -> ChunkKV | None:
        """``None``: reading a chunk from disk is I/O (``get``), not a look at memory."""
        return None

    def contains(self, cache_id: str) -> bool:
        """Whether a regular file holds ``cache_id`` (a FIFO or directory in its name is no chunk)."""
        path = self._file(cache_id)
        return path is not None and disk_entry.is_regular(path)

    def can_fit(self, num_bytes: int, *, keep: Collection[str] = (), namespace: str = "") -> bool:
        """Whether ``num_bytes`` fit after evicting every file that is neither pinned nor in ``keep`` (a ``stat``
        of each of those, no listing: the engine thread asks; another process may fill the directory meanwhile,
        which ``put`` then finds). ``namespace``: unused (the folder is shared by processes: no shares here)."""
        held_bytes = 0
        for path in filter(None, map(self._file, self._pins().union(keep))):
            with contextlib.suppress(OSError):  # not on disk
                held_bytes += os.lstat(path).st_size
        return held_bytes + num_bytes <= self.capacity_bytes

    def put(self, chunk: ChunkKV, *, keep: Collection[str] = ()) -> bool:
        """Write ``chunk``, evicting least-recently-used files that are neither pinned nor in ``keep``.

        ``False`` with ``last_error`` set: the disk failed (under ``"miss"``), or its writes are paused by the
        breaker (a full disk). ``False`` with ``last_error`` ``None``: it cannot fit (nothing is evicted then), or
        a directory holds its name (logged). So the store tells a failure from a chunk too large."""
        with self._guard():
            path = self._file(chunk.cache_id)
            if path is None:
                return False
            held = disk_entry.kind_at(path)
            if held == disk_entry.REGULAR and self._touch(path):
                return True  # there already (content-addressed: the same bytes): now recently used
            if held == "a directory":  # os.replace cannot move a file over it, and it is not ours to remove
                log.warning("pic: cannot store chunk %s: %s is a directory", chunk.cache_id, path)
                return False
            # A FIFO or symbolic link in its name is replaced (the link itself, not what it points to).
            return self.breaker.call(lambda: self._write(path, chunk, keep), unreachable=no_room)
        return False

    def _write(self, path: Path, chunk: ChunkKV, keep: Collection[str]) -> bool:
        """Write ``chunk`` to a temporary file, then rename it to ``path`` if it fits (under the lock)."""
        tmp = disk_file.write(
            path, chunk, fingerprint=self._expected.fingerprint, part_bytes=self._part_bytes, key=self._store_key
        )
        try:
            with disk_file.locked(self.path):
                fits = self._make_room(chunk.cache_id, tmp.stat().st_size, keep=keep)
                if fits:
                    os.replace(tmp, path)
        except IsADirectoryError:  # a directory took its name since put looked
            log.warning("pic: cannot store chunk %s: %s is a directory", chunk.cache_id, path)
            return False
        finally:
            tmp.unlink(missing_ok=True)  # renamed already, or refused
        return fits

    def delete(self, cache_id: str) -> bool:
        path = self._file(cache_id)
        self.unpin(cache_id)
        with self._guard():
            return path is not None and disk_budget.remove(self.path, path)
        return False

    def pin(self, cache_id: str) -> bool:
        """Never evict ``cache_id`` (in this process: another process sharing the directory does not see
        the pin); ``False`` if the tier does not hold it."""
        if not self.contains(cache_id):
            return False
        with self._lock:
            self._pinned.add(cache_id)
        return True

    def unpin(self, cache_id: str) -> None:
        with self._lock:
            self._pinned.discard(cache_id)

    def _pins(self) -> set[str]:
        with self._lock:
            return set(self._pinned)

    def ids(self) -> list[str]:
        with self._guard():
            return sorted(disk_file.listing(self.path))
        return []

    def stats(self) -> TierStats:
        """Counters of this process, with the entries and bytes in the directory (all processes'). ``writable``:
        the write breaker is closed (``False`` while a full or read-only disk refuses writes; reads go on);
        ``up``: the directory can be listed."""
        with self._lock:
            stats = dataclasses.replace(self._stats, writable=not self.breaker.is_open)
        try:
            files = disk_file.listing(self.path)
        except OSError:
            return dataclasses.replace(stats, up=False, writable=False)
        return dataclasses.replace(stats, num_entries=len(files), num_bytes=sum(s for s, _ in files.values()))

    def leases(self, lease_s: float) -> FleetLeases | None:
        """``None``: a local disk is this machine's, not a fleet's."""
        return None

    def _make_room(self, cache_id: str | None, num_bytes: int, *, keep: Collection[str], rescan: bool = False) -> bool:
        """Reserve ``num_bytes`` under the directory's lock (``disk_budget``), evicting neither pinned files nor
        ``keep``; ``False`` when they cannot fit."""
        exempt = self._pins().union(keep)
        room = disk_budget.make_room(
            self.path, capacity=self.capacity_bytes, cache_id=cache_id, num_bytes=num_bytes, exempt=exempt,
            rescan=rescan, largest=self._largest,
        )  # fmt: skip
        self._count(evictions=room.num_evicted)
        return room.fits

    def _count(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                setattr(self._stats, name, getattr(self._stats, name) + n)

    def _guard(self) -> FailureGuard:
        return FailureGuard(self, OSError, on_error=self._on_error)

    def _failed(self, exc: BaseException) -> str:
        self._count(errors=1)
        reason = errno.errorcode.get(getattr(exc, "errno", None) or 0, type(exc).__name__)
        return f"disk tier at {self.path} failed: {reason}: {getattr(exc, 'strerror', None) or exc}"
