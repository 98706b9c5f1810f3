"""The disk tier: compiled chunks in files on a local disk, so they survive a restart.

One file per chunk (``pic.store.disk_file``: the store's serialized form with its checksum, written
atomically) under ``{path}/{model fingerprint}/``, so two models never read each other's chunks. The
directory is the index: a chunk's size is its file's, its last use is the file's mtime (a read touches
it), so two processes on one machine that share the directory share one LRU. Every write commits under
an exclusive ``flock`` on ``{dir}/.lock``: it evicts the least recently used files (never a pinned one
or one the call keeps) until its own fits in ``capacity_bytes``, then renames its file into place. So
the byte limit holds across processes, and reads take no lock (a file evicted while it is being read
stays readable through its open descriptor). The byte budget's bookkeeping is ``pic.store.disk_budget``.

A damaged, truncated or foreign file is logged, removed and a miss (a recompile, never a wrong answer).
A failing disk (full, read-only, I/O errors) is a ``StoreUnavailableError`` naming the path, or with
``on_error="miss"`` a logged miss, as for Redis.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import threading
from collections.abc import Collection
from pathlib import Path
from typing import Literal

from pic.errors import StoreUnavailableError
from pic.kv import ChunkKV
from pic.store import disk_budget, disk_file, serde
from pic.store.guard import FailureGuard
from pic.store.lease import FleetLeases
from pic.store.tier import Extent, TierStats

log = logging.getLogger("pic.store")


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

    Raises:
        StoreUnavailableError: the directory cannot be created or written (whatever ``on_error`` says:
            a tier that cannot start is a configuration error, not a miss).
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
    ) -> None:
        self.path = Path(path).expanduser() / expected.fingerprint
        self.capacity_bytes, self._expected, self._on_error = capacity_bytes, expected, on_error
        self._part_bytes, self._pin = part_bytes, pin
        self._pinned: set[str] = set()
        self._stats = TierStats(name=self.name, capacity_bytes=capacity_bytes)
        self._last_error: str | None = None
        self._lock = threading.Lock()  # the counters and pins; the directory itself is guarded by flock
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            (self.path / ".lock").touch()
            removed = disk_file.sweep_tmp(self.path)
            with disk_file.locked(self.path):  # a smaller limit than the last run's evicts; the usage record is redone
                self._make_room(None, 0, keep=(), rescan=True)
        except OSError as exc:
            raise StoreUnavailableError(f"disk tier at {self.path} cannot start: {exc}") from exc
        if removed:
            log.info("pic: removed %d unfinished chunk file(s) of dead writers in %s", removed, self.path)

    @property
    def last_error(self) -> str | None:
        """Why the latest call failed, for error messages upstream; ``None`` if it did not."""
        return self._last_error

    def _file(self, cache_id: str) -> Path | None:
        return self.path / f"{cache_id}{disk_file.SUFFIX}" if disk_file.is_cache_id(cache_id) else None

    def get(self, cache_id: str) -> ChunkKV | None:
        chunk, path = None, self._file(cache_id)
        with self._guard():
            chunk = None if path is None else self._read(path, cache_id)
        self._count(hits=int(chunk is not None), misses=int(chunk is None))
        return chunk

    def _read(self, path: Path, cache_id: str) -> ChunkKV | None:
        try:
            chunk = disk_file.read(path, cache_id=cache_id, expected=self._expected, pin=self._pin)
        except FileNotFoundError:  # never written, or evicted (by any process) since
            return None
        except serde.CorruptEntryError as exc:
            log.warning("pic: dropping chunk file %s: %s", path, exc)
            self._count(errors=1)
            disk_budget.remove(self.path, path)
            return None
        with contextlib.suppress(FileNotFoundError):
            os.utime(path)  # recently used, for every process sharing the directory
        return chunk

    def extent(self, cache_id: str) -> Extent | None:
        """The chunk's size from its file's header and metadata (no payload read); a damaged file is a miss
        here, left for ``get`` to remove."""
        path = self._file(cache_id)
        if path is None:
            return None
        with self._guard():
            try:
                with open(path, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    meta = disk_file.read_meta(f, cache_id=cache_id, expected=self._expected, file_bytes=size)
                return Extent(len(meta.token_ids), 2 * meta.tensor_bytes)
            except (FileNotFoundError, serde.CorruptEntryError):
                return None
        return None  # the disk failed and on_error == "miss"

    def peek(self, cache_id: str) -> ChunkKV | None:
        """``None``: reading a chunk from disk is I/O (``get``), not a look at memory."""
        return None

    def contains(self, cache_id: str) -> bool:
        path = self._file(cache_id)
        return path is not None and path.exists()

    def can_fit(self, num_bytes: int, *, keep: Collection[str] = ()) -> bool:
        """Whether ``num_bytes`` fit after evicting every file that is neither pinned nor in ``keep`` (a ``stat``
        of each of those, no listing: the engine thread asks; another process may fill the directory meanwhile,
        which ``put`` then finds)."""
        held_bytes = 0
        for path in filter(None, map(self._file, self._pins().union(keep))):
            with contextlib.suppress(OSError):  # not on disk
                held_bytes += path.stat().st_size
        return held_bytes + num_bytes <= self.capacity_bytes

    def put(self, chunk: ChunkKV, *, keep: Collection[str] = ()) -> bool:
        """Write ``chunk``, evicting least-recently-used files that are neither pinned nor in ``keep``;
        ``False`` when it cannot fit (nothing is evicted then) or the disk failed under ``"miss"``."""
        path = self._file(chunk.cache_id)
        if path is None:
            return False
        with self._guard():
            with contextlib.suppress(FileNotFoundError):
                os.utime(path)  # there already (content-addressed: the same bytes): now recently used
                return True
            tmp = disk_file.write(path, chunk, fingerprint=self._expected.fingerprint, part_bytes=self._part_bytes)
            try:
                with disk_file.locked(self.path):
                    fits = self._make_room(chunk.cache_id, tmp.stat().st_size, keep=keep)
                    if fits:
                        os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)  # renamed already, or refused
            return fits
        return False

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
        """Counters of this process, with the entries and bytes in the directory (all processes')."""
        with self._lock:
            stats = dataclasses.replace(self._stats)
        try:
            files = disk_file.listing(self.path)
        except OSError:
            return dataclasses.replace(stats, up=False)
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
            rescan=rescan,
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
