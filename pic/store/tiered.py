"""``TieredStore``: device, CPU and Redis tiers behind one get / put.

Writes go through to every tier (a fleet shares what one worker compiles); reads go down the tiers
and promote what they find into the tiers above, so the next link of the same chunk is a device hit.
The device and CPU tiers are byte-bounded LRUs; evicting a chunk from one leaves it in the tiers
below. Pinned chunks are never evicted.
"""

from __future__ import annotations

import torch

from pic.config import StoreConfig
from pic.errors import StoreFullError, UnknownCacheIdError
from pic.kv import ChunkKV
from pic.store import serde
from pic.store.lru import LruTier
from pic.store.redis_tier import RedisTier
from pic.store.tier import Tier, TierStats


class TieredStore:
    """Chunks in tiers, fastest first; ``get`` returns them on ``device``.

    Args:
        tiers: fastest first (``LruTier`` device, ``LruTier`` CPU, ``RedisTier``), at least one.
        device: the engine's device.
    """

    def __init__(self, tiers: list[Tier], *, device: torch.device) -> None:
        assert tiers, "a store needs at least one tier"
        self.tiers, self.device = tiers, device
        self._pinned: set[str] = set()

    @classmethod
    def from_config(cls, config: StoreConfig, *, device: torch.device, expected: serde.Expected) -> TieredStore:
        pin = torch.cuda.is_available()
        tiers: list[Tier] = [LruTier("device", device=device, capacity_bytes=config.device_bytes)]
        if config.cpu_bytes != 0:
            tiers.append(LruTier("cpu", device=torch.device("cpu"), capacity_bytes=config.cpu_bytes, pin=pin))
        if config.redis_url is not None:
            redis = RedisTier(
                config.redis_url,
                expected=expected,
                namespace=config.namespace,
                part_bytes=config.part_bytes,
                on_error=config.on_redis_error,
                timeout_s=config.redis_timeout_s,
                pin=pin,
            )
            tiers.append(redis)
        return cls(tiers, device=device)

    def put(self, chunk: ChunkKV) -> None:
        """Write ``chunk`` to every tier, lowest first (the shared copy exists before the local ones).

        Raises:
            StoreFullError: no tier could take it.
            StoreUnavailableError: Redis failed (``on_redis_error="raise"``).
        """
        stored = [tier.put(chunk) for tier in reversed(self.tiers)]
        if not any(stored):
            raise StoreFullError(
                f"chunk {chunk.cache_id} ({chunk.num_bytes} bytes) fits in no tier: "
                + ", ".join(_describe(t.stats()) for t in self.tiers)
            )

    def get(self, cache_id: str) -> ChunkKV | None:
        """The chunk on the engine's device, promoted into every tier above the one that had it."""
        for level, tier in enumerate(self.tiers):
            chunk = tier.get(cache_id)
            if chunk is not None:
                for upper in reversed(self.tiers[:level]):  # CPU before device: copy to the GPU from pinned memory
                    if upper.put(chunk) and isinstance(upper, LruTier):
                        chunk = upper.peek(cache_id)  # the copy nearest the device
                        if cache_id in self._pinned:
                            upper.pin(cache_id)
                return chunk.to(self.device, non_blocking=True)
        return None

    def require(self, cache_id: str) -> ChunkKV:
        """``get``, or an ``UnknownCacheIdError`` that says where it looked and what failed."""
        chunk = self.get(cache_id) if isinstance(cache_id, str) else None
        if chunk is not None:
            return chunk
        failures = [t.last_error for t in self.tiers if getattr(t, "last_error", None)]
        raise UnknownCacheIdError(
            f"unknown cache id {cache_id!r}: in no tier ({', '.join(t.name for t in self.tiers)}); "
            + (f"{'; '.join(failures)}; " if failures else "")
            + "compile its document first"
        )

    def contains(self, cache_id: str) -> bool:
        return any(tier.contains(cache_id) for tier in self.tiers)

    def lookup(self, cache_id: str) -> list[str]:
        """Names of the tiers that hold ``cache_id``, fastest first."""
        return [tier.name for tier in self.tiers if tier.contains(cache_id)]

    def pin(self, cache_id: str) -> None:
        """Never evict ``cache_id`` from the device and CPU tiers (also once promoted into them).

        Raises:
            UnknownCacheIdError: no tier holds it.
        """
        if not self.contains(cache_id):
            raise UnknownCacheIdError(f"cannot pin unknown cache id {cache_id!r}")
        self._pinned.add(cache_id)
        for tier in self._lru_tiers():
            tier.pin(cache_id)

    def unpin(self, cache_id: str) -> None:
        self._pinned.discard(cache_id)
        for tier in self._lru_tiers():
            tier.unpin(cache_id)

    def expire(self, cache_id: str) -> bool:
        """Remove ``cache_id`` from every tier (pinned or not); ``True`` if any held it."""
        self._pinned.discard(cache_id)
        return any([tier.delete(cache_id) for tier in self.tiers])

    def ids(self) -> list[str]:
        """Every cache id in any tier."""
        return sorted({cid for tier in self.tiers for cid in tier.ids()})

    def stats(self) -> list[TierStats]:
        """One snapshot per tier, fastest first."""
        return [tier.stats() for tier in self.tiers]

    def _lru_tiers(self) -> list[LruTier]:
        return [t for t in self.tiers if isinstance(t, LruTier)]


def _describe(stats: TierStats) -> str:
    capacity = "unbounded" if stats.capacity_bytes is None else f"{stats.capacity_bytes} bytes"
    return f"{stats.name} {stats.num_bytes} used of {capacity}"
