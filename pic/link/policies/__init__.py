"""Recompute policies: which tokens of a linked prompt to run fresh.

Use a spec string (``"naive"``, ``"full"``, ``"legolink:16"``, ``"legolink0"``, ``"cacheblend:0.15"``,
``"mepic"``) or an object; add your own by subclassing ``Policy`` and decorating it with ``register``.
"""

from pic.link.policies.base import Policy
from pic.link.policies.builtin import FullRecompute, Naive
from pic.link.policies.cacheblend import CacheBlend
from pic.link.policies.heads import MEPIC, LegoLink, LegoLinkZero, chunk_heads
from pic.link.policies.registry import available, register, resolve
from pic.link.step import LayerStep

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
