"""The tier protocol: one level of the chunk store (device, CPU, Redis)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

from pic.kv import ChunkKV


@dataclass
class TierStats:
    """Counters of one tier (a snapshot when returned by ``stats()``).

    Attributes:
        name: ``"device"``, ``"cpu"`` or ``"redis"``.
        num_entries: chunks it holds.
        num_bytes: bytes of K and V it holds.
        capacity_bytes: its capacity; ``None`` when unbounded.
        hits / misses: ``get`` calls that found / did not find the chunk.
        evictions: chunks evicted to make room (LRU tiers only).
        errors: operations that failed (Redis unreachable, corrupt entries dropped).
    """

    name: str
    num_entries: int = 0
    num_bytes: int = 0
    capacity_bytes: int | None = None
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    errors: int = 0


class Tier(Protocol):
    """A place chunks live. ``get`` returns the chunk in the tier's own memory; the ``TieredStore``
    moves it to the device."""

    name: str

    def get(self, cache_id: str) -> ChunkKV | None:
        """The chunk, or ``None`` (a miss)."""

    def put(self, chunk: ChunkKV, *, keep: Collection[str] = ()) -> bool:
        """Store ``chunk`` without evicting the chunks in ``keep``; ``False`` when it cannot fit
        (nothing is evicted then)."""

    def can_fit(self, num_bytes: int, *, keep: Collection[str] = ()) -> bool:
        """Whether ``num_bytes`` more would fit without evicting pinned chunks or those in ``keep``."""

    def contains(self, cache_id: str) -> bool: ...

    def delete(self, cache_id: str) -> bool:
        """Remove the chunk; ``True`` if it was there."""

    def ids(self) -> list[str]: ...

    def stats(self) -> TierStats: ...
