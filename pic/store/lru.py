"""The CPU tier: a byte-bounded LRU of chunks in process memory, with pinning."""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections import OrderedDict
from collections.abc import Collection, Mapping

import torch

from pic.kv import ChunkKV
from pic.store.lease import FleetLeases
from pic.store.tier import Extent, TierStats

_CPU = torch.device("cpu")


def _locked(method):
    """Run ``method`` under the tier's lock: the engine's loader threads and its callers' threads share it."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


class LruTier:
    """Chunks in CPU memory, least recently used evicted first.

    Args:
        capacity_bytes: bytes of K and V it may hold; ``None``: unbounded.
        pin: keep CPU tensors page-locked (so copies to a GPU can be asynchronous).

    Pinned chunks (``pin``) are never evicted, nor are the chunks a ``put`` is told to ``keep``. A chunk
    that does not fit even after evicting every other chunk is refused (``put`` returns ``False``) and
    nothing is evicted.
    """

    name = "cpu"

    def __init__(self, *, capacity_bytes: int | None = None, pin: bool = False) -> None:
        self.capacity_bytes, self._pin = capacity_bytes, pin
        self._chunks: OrderedDict[str, ChunkKV] = OrderedDict()  # least recently used first
        self._pinned: set[str] = set()
        self._stats = TierStats(name=self.name, capacity_bytes=capacity_bytes)
        self._lock = threading.RLock()

    @property
    def last_error(self) -> str | None:
        """Always ``None``: process memory does not fail."""
        return None

    def _readable(self, cache_id: str, readable: Mapping[str, bytes] | None) -> ChunkKV | None:
        """The chunk if held and of one of ``readable``'s namespaces (by its label: this memory holds only what
        this process compiled or verified; ``None``: any)."""
        chunk = self._chunks.get(cache_id)
        return chunk if chunk is None or readable is None or chunk.options.namespace in readable else None

    @_locked
    def get(self, cache_id: str, *, readable: Mapping[str, bytes] | None = None) -> ChunkKV | None:
        chunk = self._readable(cache_id, readable)
        if chunk is None:
            self._stats.misses += 1
            return None
        self._chunks.move_to_end(cache_id)
        self._stats.hits += 1
        return chunk

    @_locked
    def peek(self, cache_id: str) -> ChunkKV | None:
        """The chunk without counting a hit or making it recently used."""
        return self._chunks.get(cache_id)

    @_locked
    def extent(self, cache_id: str, *, readable: Mapping[str, bytes] | None = None) -> Extent | None:
        chunk = self._readable(cache_id, readable)
        if chunk is None:
            return None
        return Extent(chunk.num_tokens, chunk.num_bytes, tuple(chunk.token_ids.tolist()), chunk.options.namespace)

    @_locked
    def can_fit(self, num_bytes: int, *, keep: Collection[str] = ()) -> bool:
        """Whether ``num_bytes`` fit after evicting every chunk that is neither pinned nor in ``keep``."""
        if self.capacity_bytes is None:
            return True
        held = self._pinned.union(c for c in keep if c in self._chunks)
        return sum(self._chunks[c].num_bytes for c in held) + num_bytes <= self.capacity_bytes

    @_locked
    def put(self, chunk: ChunkKV, *, keep: Collection[str] = ()) -> bool:
        """Store ``chunk``, evicting least-recently-used chunks that are neither pinned nor in ``keep``
        (the chunks a ``compile`` call returns); ``False`` when it cannot fit (nothing is evicted then)."""
        if chunk.cache_id in self._chunks:
            self._chunks.move_to_end(chunk.cache_id)
            return True
        if not self.can_fit(chunk.num_bytes, keep=keep):
            return False
        self._evict_for(chunk.num_bytes, keep=keep)
        self._chunks[chunk.cache_id] = chunk.to(_CPU, pin=self._pin, non_blocking=True)
        self._stats.num_bytes += chunk.num_bytes
        return True

    def _evict_for(self, num_bytes: int, *, keep: Collection[str]) -> None:
        if self.capacity_bytes is None:
            return
        victims = (c for c in list(self._chunks) if c not in self._pinned and c not in keep)
        while self._stats.num_bytes + num_bytes > self.capacity_bytes:
            victim = next(victims)  # can_fit guarantees enough evictable bytes
            self._remove(victim)
            self._stats.evictions += 1

    @_locked
    def contains(self, cache_id: str) -> bool:
        return cache_id in self._chunks

    @_locked
    def delete(self, cache_id: str) -> bool:
        if cache_id not in self._chunks:
            return False
        self._remove(cache_id)
        return True

    def _remove(self, cache_id: str) -> None:
        self._stats.num_bytes -= self._chunks.pop(cache_id).num_bytes
        self._pinned.discard(cache_id)

    @_locked
    def pin(self, cache_id: str) -> bool:
        """Never evict ``cache_id``; ``False`` if this tier does not hold it."""
        if cache_id not in self._chunks:
            return False
        self._pinned.add(cache_id)
        return True

    @_locked
    def unpin(self, cache_id: str) -> None:
        self._pinned.discard(cache_id)

    @_locked
    def ids(self) -> list[str]:
        return list(self._chunks)

    @_locked
    def stats(self) -> TierStats:
        return dataclasses.replace(self._stats, num_entries=len(self._chunks))

    def leases(self, lease_s: float) -> FleetLeases | None:
        """``None``: this memory is the process's alone."""
        return None
