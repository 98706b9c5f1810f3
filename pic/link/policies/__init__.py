"""Recompute policies: which tokens of a linked prompt to run fresh.

Use a spec string (``"auto"``: the default, ``"naive"``, ``"full"``, ``"legolink:16"``, ``"legolink0"``,
``"cacheblend:0.15"``, ``"mepic"``, ``"prophetkv:0.2"``, ``"infoflow:0.15"``, ``"fusionrag:0.15"``, ``"a3:0.15"``,
``"ape"``, ``"regions:0.2"``, ``"suffix:0.2"``) or an object; add your own by subclassing ``Policy`` and decorating
it with ``register``.
"""

from pic.link.policies.a3 import A3
from pic.link.policies.ape import APE
from pic.link.policies.base import Policy
from pic.link.policies.builtin import Auto, FullRecompute, Naive, Suffix
from pic.link.policies.cacheblend import CacheBlend
from pic.link.policies.heads import MEPIC, LegoLink, LegoLinkZero, chunk_heads
from pic.link.policies.query import FusionRAG, InfoFlow, ProbePicks, ProphetKV
from pic.link.policies.regions import Regions
from pic.link.policies.registry import available, register, resolve
from pic.link.policies.scoring import smooth, top_chunk_tokens, with_heads
from pic.link.probe import Probe
from pic.link.step import LayerStep

__all__ = [
    "A3",
    "APE",
    "Auto",
    "MEPIC",
    "CacheBlend",
    "FullRecompute",
    "FusionRAG",
    "InfoFlow",
    "LayerStep",
    "LegoLink",
    "LegoLinkZero",
    "Naive",
    "Policy",
    "Probe",
    "ProbePicks",
    "ProphetKV",
    "Regions",
    "Suffix",
    "available",
    "chunk_heads",
    "register",
    "resolve",
    "smooth",
    "top_chunk_tokens",
    "with_heads",
]
