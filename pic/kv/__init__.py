"""Paged KV memory: the block pool (allocator, no tensors), the KV tensors, one request's block table,
and compiled chunks."""

from pic.kv.block_pool import BlockPool, KVStats
from pic.kv.cache import ChunkInfo, ChunkKV, KVCache, RequestKV, blocks_for

__all__ = ["BlockPool", "ChunkInfo", "ChunkKV", "KVCache", "KVStats", "RequestKV", "blocks_for"]
