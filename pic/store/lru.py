"""The CPU tier: a byte-bounded LRU of chunks in process memory, with pinning and per-namespace shares."""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from collections import Counter, OrderedDict
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
        shares: namespace -> the share of ``capacity_bytes`` its chunks keep against other namespaces
            (``Quota.store_share``).

    Pinned chunks (``pin``) are never evicted, nor are the chunks a ``put`` is told to ``keep``. A ``put`` of a
    namespace's chunk evicts that namespace's chunks first, least recently used first, then other namespaces'
    chunks, least recently used first among those over their share (``floor(share * capacity_bytes)``): a namespace
    at or under its share never loses a chunk to another's. A namespace whose chunk keeps it within its share takes
    back what it is owed first (the others' chunks over their share before its own), as the KV pool does. Without
    shares, and with one namespace, that is plain LRU. A chunk that does not fit even after evicting every chunk it
    may is refused (``put`` returns ``False``) and nothing is evicted.
    """

    name = "cpu"

    def __init__(
        self, *, capacity_bytes: int | None = None, pin: bool = False, shares: Mapping[str, float] | None = None
    ) -> None:
        self.capacity_bytes, self._pin = capacity_bytes, pin
        bounded = {} if capacity_bytes is None else (shares or {})
        self._shares = {n: math.floor(s * capacity_bytes + 1e-9) for n, s in bounded.items()}  # namespace -> bytes
        self._usage: Counter[str] = Counter()  # namespace -> bytes of its chunks here
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
    def can_fit(self, num_bytes: int, *, keep: Collection[str] = (), namespace: str = "") -> bool:
        """Whether ``num_bytes`` of ``namespace``'s fit after evicting what a ``put`` of its may: chunks neither
        pinned nor in ``keep``, of ``namespace`` or of namespaces over their share."""
        return self._victims(num_bytes, namespace=namespace, keep=keep) is not None

    @_locked
    def put(self, chunk: ChunkKV, *, keep: Collection[str] = ()) -> bool:
        """Store ``chunk``, evicting least-recently-used chunks that are neither pinned nor in ``keep`` (the chunks a
        ``compile`` call returns), its namespace's first, then those of namespaces over their share; ``False`` when
        it cannot fit (nothing is evicted then)."""
        if chunk.cache_id in self._chunks:
            self._chunks.move_to_end(chunk.cache_id)
            return True
        victims = self._victims(chunk.num_bytes, namespace=chunk.options.namespace, keep=keep)
        if victims is None:
            return False
        for victim in victims:
            self._remove(victim)
            self._stats.evictions += 1
        self._chunks[chunk.cache_id] = chunk.to(_CPU, pin=self._pin, non_blocking=True)
        self._stats.num_bytes += chunk.num_bytes
        self._usage[chunk.options.namespace] += chunk.num_bytes
        return True

    def _victims(self, num_bytes: int, *, namespace: str, keep: Collection[str]) -> list[str] | None:
        """The chunks to evict, in order, so that ``num_bytes`` of ``namespace``'s fit (``None``: they cannot):
        ``namespace``'s own least recently used first, then, least recently used first, those of other namespaces
        while each is over its share (those first when the chunk keeps ``namespace`` within its share). Two walks of
        the tier's chunks at most (a put's eviction was one already)."""
        if self.capacity_bytes is None:
            return []
        need = self._stats.num_bytes + num_bytes - self.capacity_bytes
        if need <= 0:
            return []
        kept = set(keep)
        candidates = [(cid, c) for cid, c in self._chunks.items() if cid not in self._pinned and cid not in kept]
        usage = Counter(self._usage)
        victims: list[str] = []

        def take(own: bool) -> None:
            nonlocal need
            for cid, chunk in candidates:
                if need <= 0:
                    return
                owner = chunk.options.namespace
                if own and owner == namespace:
                    victims.append(cid)
                    need -= chunk.num_bytes
                elif not own and owner != namespace and usage[owner] > self._shares.get(owner, 0):
                    victims.append(cid)
                    need -= chunk.num_bytes
                    usage[owner] -= chunk.num_bytes

        reclaim = usage[namespace] + num_bytes <= self._shares.get(namespace, 0)
        for own in (False, True) if reclaim else (True, False):
            take(own)
        return victims if need <= 0 else None

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
        chunk = self._chunks.pop(cache_id)
        self._stats.num_bytes -= chunk.num_bytes
        self._usage[chunk.options.namespace] -= chunk.num_bytes
        if not self._usage[chunk.options.namespace]:
            del self._usage[chunk.options.namespace]
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
