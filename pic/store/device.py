"""The device tier: chunks resident in the KV pool as canonical blocks (no second copy of their KV).

A chunk is resident when ``compile`` prefilled it into the pool, or when ``link`` promoted it from a
lower tier into fresh blocks. Requests map its blocks directly; the pool evicts unreferenced chunks,
least recently used first, when it needs their blocks, and never evicts pinned ones.
"""

from __future__ import annotations

import dataclasses

from pic.kv import BlockPool, ChunkInfo, ChunkKV, KVCache, blocks_for
from pic.store.tier import TierStats


class DeviceTier:
    """The store's view of the resident chunks of a ``BlockPool`` whose KV lives in a ``KVCache``."""

    name = "device"

    def __init__(self, pool: BlockPool, cache: KVCache) -> None:
        self.pool, self.cache = pool, cache
        self._stats = TierStats(name=self.name, capacity_bytes=pool.num_blocks * cache.bytes_per_block)

    def num_blocks_for(self, num_tokens: int) -> int:
        """Canonical blocks of a chunk of ``num_tokens`` tokens (front-padded to whole blocks)."""
        return blocks_for(num_tokens, self.cache.block_size)

    def info(self, cache_id: str) -> ChunkInfo | None:
        """The resident chunk's description, counting a hit or a miss."""
        chunk = self.pool.chunks.get(cache_id)
        if chunk is None:
            self._stats.misses += 1
            return None
        self._stats.hits += 1
        return chunk.info  # type: ignore[return-value]

    def add(self, info: ChunkInfo, block_ids: list[int]) -> None:
        """Make prefilled blocks resident as ``info``'s chunk (the caller's references become holds)."""
        assert len(block_ids) == self.num_blocks_for(info.num_tokens)
        self.pool.add_chunk(info.cache_id, block_ids, info)

    def promote(self, chunk: ChunkKV) -> list[int]:
        """Load a chunk from a lower tier into fresh canonical blocks and make it resident; returns
        its blocks, held once for the caller. The caller checked that the pool has room."""
        blocks = self.pool.allocate(self.num_blocks_for(chunk.num_tokens))
        try:
            self.cache.write(blocks, chunk.k, chunk.v)
        except BaseException:
            self.pool.free(blocks)
            raise
        self.add(chunk.info, blocks)
        return blocks

    def read(self, cache_id: str) -> ChunkKV | None:
        """A copy of a resident chunk's KV out of its blocks (to write it through to lower tiers)."""
        chunk = self.pool.chunks.get(cache_id)
        if chunk is None:
            return None
        info: ChunkInfo = chunk.info  # type: ignore[assignment]
        k, v = self.cache.read(chunk.block_ids, info.num_tokens)
        return ChunkKV(cache_id=cache_id, token_ids=info.token_ids, k=k, v=v, options=info.options)

    def contains(self, cache_id: str) -> bool:
        return cache_id in self.pool.chunks

    def delete(self, cache_id: str) -> bool:
        return self.pool.drop(cache_id)

    def pin(self, cache_id: str) -> bool:
        return self.pool.pin(cache_id)

    def unpin(self, cache_id: str) -> None:
        self.pool.unpin(cache_id)

    def ids(self) -> list[str]:
        return list(self.pool.chunks)

    def stats(self) -> TierStats:
        num_chunk_blocks = sum(len(c.blocks) for c in self.pool.chunks.values())
        return dataclasses.replace(
            self._stats,
            num_entries=len(self.pool.chunks),
            num_bytes=num_chunk_blocks * self.cache.bytes_per_block,
            evictions=self.pool.num_evicted_chunks,
        )
