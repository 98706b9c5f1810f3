"""Where compiled chunks live: the KV pool (device tier), CPU, disk and Redis tiers behind a ``TieredStore``."""

from pic.store.description import ChunkDescription
from pic.store.device import DeviceTier
from pic.store.disk import DiskTier
from pic.store.lru import LruTier
from pic.store.redis_tier import RedisTier
from pic.store.tier import Extent, LowerTier, Tier, TierStats
from pic.store.tiered import TieredStore

__all__ = [
    "ChunkDescription",
    "DeviceTier",
    "DiskTier",
    "Extent",
    "LowerTier",
    "LruTier",
    "RedisTier",
    "Tier",
    "TierStats",
    "TieredStore",
]
