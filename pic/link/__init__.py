"""Linking cached chunks with a query, the algorithm: layout, assembly, the recompute pass, policies, chat."""

from pic.link.layout import Layout, Segment, SegmentKind, lay_out

__all__ = ["Layout", "Segment", "SegmentKind", "lay_out"]
