"""The device tier: chunks resident in the KV pool as canonical blocks (no second copy of their KV).

A chunk is resident when ``compile`` prefilled it into the pool, or when ``link`` promoted it from a
lower tier into fresh blocks. Requests map its blocks directly; the pool evicts unreferenced chunks,
least recently used first, when it needs their blocks, and never evicts pinned ones.

The tier reads the pool and writes nothing itself: it makes chunks resident, promotes, drops and pins them through
the KV manager (``ResidentChunks``), the pool's one writer, which builds it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Protocol

import torch

from pic.kv import BlockPool, ChunkInfo, ChunkKV, KVCache, blocks_for
from pic.store.lease import FleetLeases
from pic.store.tier import Extent, TierStats


class ResidentChunks(Protocol):
    """The writes of the pool's resident chunks the device tier asks for (``pic.engine.core.kv_manager.KVManager``,
    the pool's one writer), and the pool it reads."""

    pool: BlockPool

    def add_chunk(self, info: ChunkInfo, block_ids: list[int]) -> None: ...
    def promote(self, chunk: ChunkKV, *, owner: str) -> list[int]: ...
    def drop(self, cache_id: str) -> bool: ...
    def pin(self, cache_id: str) -> bool: ...
    def unpin(self, cache_id: str) -> None: ...


class DeviceTier:
    """The store's view of the resident chunks of a ``BlockPool`` whose KV lives in a ``KVCache``, written through
    ``kv``."""

    name = "device"

    def __init__(self, kv: ResidentChunks, cache: KVCache) -> None:
        self._kv, self._pool, self._cache = kv, kv.pool, cache
        self._stats = TierStats(name=self.name, capacity_bytes=kv.pool.num_blocks * cache.bytes_per_block)

    @property
    def kv_device(self) -> torch.device:
        """Where the pool's KV lives (chunks read from lower tiers are moved there)."""
        return self._cache.device

    @property
    def last_error(self) -> str | None:
        """Always ``None``: the pool does not fail."""
        return None

    def num_blocks_for(self, num_tokens: int) -> int:
        """Canonical blocks of a chunk of ``num_tokens`` tokens (front-padded to whole blocks)."""
        return blocks_for(num_tokens, self._cache.block_size)

    def info(self, cache_id: str, *, readable: Mapping[str, bytes] | None = None) -> ChunkInfo | None:
        """The resident chunk's description, counting a hit or a miss; a chunk of a namespace not in ``readable``
        (names; ``None``: any) is a miss, as if it were not resident."""
        info = self._info(cache_id, readable)
        if info is None:
            self._stats.misses += 1
            return None
        self._stats.hits += 1
        return info

    def _info(self, cache_id: str, readable: Mapping[str, bytes] | None = None) -> ChunkInfo | None:
        """The resident chunk's info if it is of one of ``readable``'s namespaces (by its label: the pool holds
        only what this process compiled or verified; ``None``: any)."""
        chunk = self._pool.chunks.get(cache_id)
        info: ChunkInfo | None = None if chunk is None else chunk.info  # type: ignore[assignment]
        return info if info is None or readable is None or info.options.namespace in readable else None

    def extent(self, cache_id: str, *, readable: Mapping[str, bytes] | None = None) -> Extent | None:
        info = self._info(cache_id, readable)
        if info is None:
            return None
        num_bytes = info.num_tokens * self._cache.bytes_per_block // self._cache.block_size
        return Extent(info.num_tokens, num_bytes, tuple(info.token_ids.tolist()), info.options.namespace)

    def add(self, info: ChunkInfo, block_ids: list[int]) -> None:
        """Make prefilled blocks resident as ``info``'s chunk (the caller's references become holds)."""
        assert len(block_ids) == self.num_blocks_for(info.num_tokens)
        self._kv.add_chunk(info, block_ids)

    def promote(self, chunk: ChunkKV, *, owner: str | None = None) -> list[int]:
        """Load a chunk from a lower tier into fresh canonical blocks and make it resident (charged to its namespace);
        returns its blocks, held once for the caller. ``owner``: whose work it is (whose chunks are evicted first for
        it: the linking request's namespace; ``None``: the chunk's). The caller checked that the pool has room."""
        return self._kv.promote(chunk, owner=chunk.options.namespace if owner is None else owner)

    def peek(self, cache_id: str, *, readable: Mapping[str, bytes] | None = None) -> ChunkKV | None:
        """A copy of a resident chunk's KV out of its blocks (to write it through to lower tiers); ``None`` also
        when it is of none of ``readable``'s namespaces."""
        info = self._info(cache_id, readable)
        if info is None:
            return None
        k, v = self._cache.read(self._pool.chunks[cache_id].block_ids, info.num_tokens)
        return ChunkKV(cache_id=cache_id, token_ids=info.token_ids, k=k, v=v, options=info.options)

    def contains(self, cache_id: str) -> bool:
        return cache_id in self._pool.chunks

    def delete(self, cache_id: str) -> bool:
        return self._kv.drop(cache_id)

    def pin(self, cache_id: str) -> bool:
        return self._kv.pin(cache_id)

    def unpin(self, cache_id: str) -> None:
        self._kv.unpin(cache_id)

    def ids(self) -> list[str]:
        return list(self._pool.chunks)

    def stats(self) -> TierStats:
        num_chunk_blocks = sum(len(c.blocks) for c in self._pool.chunks.values())
        return dataclasses.replace(
            self._stats,
            num_entries=len(self._pool.chunks),
            num_bytes=num_chunk_blocks * self._cache.bytes_per_block,
            evictions=self._pool.num_evicted_chunks,
        )

    def leases(self, lease_s: float) -> FleetLeases | None:
        """``None``: the pool is this process's alone."""
        return None
