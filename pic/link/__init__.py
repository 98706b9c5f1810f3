"""Linking cached chunks with a query: layout, policies, the recompute pass and generation."""

from pic.link.generate import FinishReason, Generation, GenerationStats
from pic.link.layout import Layout, Segment, SegmentKind, lay_out
from pic.link.linked import Linked, generate_together
from pic.link.sampling import SamplingParams

__all__ = [
    "FinishReason",
    "Generation",
    "GenerationStats",
    "Layout",
    "Linked",
    "SamplingParams",
    "Segment",
    "SegmentKind",
    "generate_together",
    "lay_out",
]
