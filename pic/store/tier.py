"""The tier protocol: one level of the chunk store (the KV pool's resident chunks, CPU, Redis).

Every tier answers the same questions (does it hold a chunk, what size is it, pin it, why did the last
call fail, does it carry the fleet's leases), so ``TieredStore`` walks its tiers without asking which
kind each one is. A tier answers "no" where a question means nothing to it: Redis pins nothing, the
in-process tiers never fail and carry no leases.

The lower tiers (CPU, Redis) hold a chunk as a ``ChunkKV`` (``LowerTier``: get, put, can_fit); the
device tier holds it as canonical blocks of the pool, which the store adds and promotes through
``DeviceTier``'s own methods.

Reads take ``readable`` (namespace name -> salt, ``pic.namespaces.Access.readable``): a chunk of none of those
namespaces is answered as a chunk the tier does not hold. The in-process tiers compare the chunk's
``options.namespace`` label (they hold only what this process compiled or verified); the shared tiers verify
that one of the salts reproduces the entry's cache id (``pic.store.serde``). ``None``: every namespace's, as
before tenants.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Protocol

from pic.kv import ChunkKV
from pic.store.lease import FleetLeases


@dataclass
class TierStats:
    """Counters of one tier (a snapshot when returned by ``stats()``).

    Attributes:
        name: ``"device"``, ``"cpu"``, ``"disk"`` or ``"redis"``.
        num_entries: chunks it holds.
        num_bytes: bytes of K and V it holds.
        capacity_bytes: its capacity; ``None`` when unbounded.
        hits / misses: ``get`` calls that found / did not find the chunk.
        evictions: chunks evicted to make room (LRU tiers only).
        errors: operations that failed (Redis unreachable, corrupt entries dropped).
        up: the tier answered this snapshot (``False``: Redis unreachable; the counts are this process's).
        writable: its writes work (``False``: Redis unreachable, or a disk tier whose writes fail, full or
            read-only, until one succeeds again; what it holds may still be read).
    """

    name: str
    num_entries: int = 0
    num_bytes: int = 0
    capacity_bytes: int | None = None
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    errors: int = 0
    up: bool = True
    writable: bool = True


@dataclass(frozen=True)
class Extent:
    """A chunk as one tier holds it, told without reading its KV.

    Attributes:
        num_tokens: tokens the chunk contributes to a linked prompt.
        num_bytes: bytes of its K and V together.
        token_ids: those tokens (from the metadata: what the vLLM connector matches a prompt against).
        namespace: the namespace it belongs to, by the reader's local name (``""``: the default one).
    """

    num_tokens: int
    num_bytes: int
    token_ids: tuple[int, ...]
    namespace: str = ""


class Tier(Protocol):
    """What ``TieredStore`` asks of every tier."""

    name: str

    @property
    def last_error(self) -> str | None:
        """Why the latest call failed (for error messages upstream); ``None`` when it did not."""

    def contains(self, cache_id: str) -> bool: ...

    def extent(self, cache_id: str, *, readable: Mapping[str, bytes] | None = None) -> Extent | None:
        """The chunk's size from metadata alone (never its KV), or ``None`` when the tier lacks it (or it is
        of none of ``readable``'s namespaces); counts no hit or miss."""

    def peek(self, cache_id: str) -> ChunkKV | None:
        """The chunk's KV if this process holds it (a copy out of the pool for the device tier), without
        counting a hit or making it recently used; ``None`` otherwise, and always for a remote tier
        (reading it there is a download: ``get``)."""

    def delete(self, cache_id: str) -> bool:
        """Remove the chunk; ``True`` if it was there."""

    def pin(self, cache_id: str) -> bool:
        """Never evict the chunk; ``False`` if the tier does not hold it or does not evict by pin (Redis)."""

    def unpin(self, cache_id: str) -> None: ...

    def ids(self) -> list[str]: ...

    def stats(self) -> TierStats: ...

    def leases(self, lease_s: float) -> FleetLeases | None:
        """The fleet's compile leases, kept where this tier's chunks are shared (``None``: not shared)."""


class LowerTier(Tier, Protocol):
    """A tier below the pool: it holds chunks as ``ChunkKV`` in its own memory. The ``TieredStore``
    moves a chunk from it to the device."""

    def get(self, cache_id: str, *, readable: Mapping[str, bytes] | None = None) -> ChunkKV | None:
        """The chunk, or ``None`` (a miss, also for a chunk of none of ``readable``'s namespaces). The chunk's
        ``options.namespace`` is the reader's name of the namespace it belongs to."""

    def put(self, chunk: ChunkKV, *, keep: Collection[str] = ()) -> bool:
        """Store ``chunk`` without evicting the chunks in ``keep``; ``False`` when it cannot fit
        (nothing is evicted then)."""

    def can_fit(self, num_bytes: int, *, keep: Collection[str] = (), namespace: str = "") -> bool:
        """Whether ``num_bytes`` more of ``namespace``'s would fit without evicting pinned chunks, those in ``keep``,
        or (a tier with shares: the CPU's) other namespaces' chunks within their share."""
