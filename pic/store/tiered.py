"""``TieredStore``: device, CPU and Redis tiers behind one get / put.

Writes go through to every tier (a fleet shares what one worker compiles); reads go down the tiers
and promote what they find into the tiers above, so the next link of the same chunk is a device hit.
The device and CPU tiers are byte-bounded LRUs; evicting a chunk from one leaves it in the tiers
below. Pinned chunks are never evicted.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Collection
from typing import TypeVar

import torch

from pic.config import StoreConfig
from pic.errors import StoreFullError, UnknownCacheIdError
from pic.kv import ChunkKV
from pic.store import serde
from pic.store.lru import LruTier
from pic.store.redis_tier import RedisTier
from pic.store.tier import Tier, TierStats

_Method = TypeVar("_Method", bound=Callable)


def _locked(method: _Method) -> _Method:
    """Run the method holding the store's lock (the engine's, so store calls and links never interleave)."""

    @functools.wraps(method)
    def run(self: TieredStore, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)

    return run  # type: ignore[return-value]


class TieredStore:
    """Chunks in tiers, fastest first; ``get`` returns them on ``device``.

    Args:
        tiers: fastest first (``LruTier`` device, ``LruTier`` CPU, ``RedisTier``), at least one.
        device: the engine's device.
        lock: serializes every call (default: a lock of its own); the engine passes its own lock.
    """

    def __init__(self, tiers: list[Tier], *, device: torch.device, lock: threading.RLock | None = None) -> None:
        assert tiers, "a store needs at least one tier"
        self.tiers, self.device = tiers, device
        self.lock = lock or threading.RLock()
        self._pinned: set[str] = set()

    @classmethod
    def from_config(
        cls,
        config: StoreConfig,
        *,
        device: torch.device,
        expected: serde.Expected,
        lock: threading.RLock | None = None,
    ) -> TieredStore:
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
        return cls(tiers, device=device, lock=lock)

    @_locked
    def put(self, chunk: ChunkKV, *, keep: Collection[str] = ()) -> None:
        """Write ``chunk`` to every tier, lowest first (the shared copy exists before the local ones).

        Args:
            keep: cache ids the bounded tiers must not evict for it (the other chunks of a ``compile``
                call, so that every id the call returns is still held somewhere).

        Raises:
            StoreFullError: no tier could take it.
            StoreUnavailableError: Redis failed (``on_redis_error="raise"``).
        """
        stored = [tier.put(chunk, keep=keep) for tier in reversed(self.tiers)]
        if not any(stored):
            raise StoreFullError(
                f"chunk {chunk.cache_id} ({chunk.num_bytes} bytes) fits in no tier: "
                + ", ".join(_describe(t.stats()) for t in self.tiers)
            )

    @_locked
    def check_room(self, num_bytes: int, *, keep: Collection[str] = (), what: str) -> None:
        """Raise unless some tier can take ``num_bytes`` more without evicting pinned chunks or ``keep``.

        Raises:
            StoreFullError: naming ``what``, the bytes and every tier's capacity.
        """
        if any(t.can_fit(num_bytes, keep=keep) for t in self.tiers):
            return
        raise StoreFullError(
            f"{what} ({num_bytes} bytes) fit in no tier beside the pinned chunks and the others the call "
            f"returns: {', '.join(_describe(t.stats()) for t in self.tiers)}; raise StoreConfig.device_bytes "
            f"or cpu_bytes, add a Redis tier, or compile fewer documents per call"
        )

    @_locked
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

    @_locked
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

    @_locked
    def contains(self, cache_id: str) -> bool:
        return any(tier.contains(cache_id) for tier in self.tiers)

    @_locked
    def lookup(self, cache_id: str) -> list[str]:
        """Names of the tiers that hold ``cache_id``, fastest first."""
        return [tier.name for tier in self.tiers if tier.contains(cache_id)]

    @_locked
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

    @_locked
    def unpin(self, cache_id: str) -> None:
        self._pinned.discard(cache_id)
        for tier in self._lru_tiers():
            tier.unpin(cache_id)

    @_locked
    def expire(self, cache_id: str) -> bool:
        """Remove ``cache_id`` from every tier (pinned or not); ``True`` if any held it."""
        self._pinned.discard(cache_id)
        return any([tier.delete(cache_id) for tier in self.tiers])

    @_locked
    def ids(self) -> list[str]:
        """Every cache id in any tier."""
        return sorted({cid for tier in self.tiers for cid in tier.ids()})

    @_locked
    def stats(self) -> list[TierStats]:
        """One snapshot per tier, fastest first."""
        return [tier.stats() for tier in self.tiers]

    def _lru_tiers(self) -> list[LruTier]:
        return [t for t in self.tiers if isinstance(t, LruTier)]


def _describe(stats: TierStats) -> str:
    capacity = "unbounded" if stats.capacity_bytes is None else f"{stats.capacity_bytes} bytes"
    return f"{stats.name} {stats.num_bytes} used of {capacity}"
