"""Paged KV memory: the block pool, one request's block table, and compiled chunk KV."""

from pic.kv.chunk import ChunkKV
from pic.kv.pool import KVPool
from pic.kv.request import RequestKV

__all__ = ["ChunkKV", "KVPool", "RequestKV"]
