"""``pic.policies``: recompute policies (re-exported from ``pic.link.policies``), and the layout
types a policy reads."""

from pic.link.layout import Layout, Segment, SegmentKind
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
    "Layout",
    "LegoLink",
    "LegoLinkZero",
    "Naive",
    "Policy",
    "Segment",
    "SegmentKind",
    "available",
    "chunk_heads",
    "register",
    "resolve",
]
