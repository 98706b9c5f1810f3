"""A minimal in-process store of compiled chunks, keyed by cache id."""

from __future__ import annotations

from pic.kv import ChunkKV


class MemoryStore:
    """Chunks held in a dict on the engine's device. Never evicts; the tiered store replaces it."""

    def __init__(self) -> None:
        self._chunks: dict[str, ChunkKV] = {}

    def contains(self, cache_id: str) -> bool:
        return cache_id in self._chunks

    def get(self, cache_id: str) -> ChunkKV | None:
        return self._chunks.get(cache_id)

    def put(self, chunk: ChunkKV) -> None:
        self._chunks[chunk.cache_id] = chunk

    def ids(self) -> list[str]:
        return list(self._chunks)

    def __len__(self) -> int:
        return len(self._chunks)
