"""``pic.policies``: recompute policies (re-exported from ``pic.link.policies``)."""

from pic.link.policies import (
    MEPIC,
    CacheBlend,
    FullRecompute,
    LayerStep,
    LegoLink,
    LegoLinkZero,
    Naive,
    Policy,
    available,
    chunk_heads,
    register,
    resolve,
)

__all__ = [
    "MEPIC",
    "CacheBlend",
    "FullRecompute",
    "LayerStep",
    "LegoLink",
    "LegoLinkZero",
    "Naive",
    "Policy",
    "available",
    "chunk_heads",
    "register",
    "resolve",
]
