"""Turning per-token scores into a recompute set: the pieces query-aware policies share (and user policies use).

Scores are ``[T]`` over a linked prompt's tokens; only chunk tokens (``layout.cached``) are ever chosen.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pic.link.layout import Layout
from pic.link.policies.heads import chunk_heads


def top_chunk_tokens(score: torch.Tensor, layout: Layout, ratio: float) -> torch.Tensor:
    """``[T]`` bool: the ``round(ratio * num_chunk_tokens)`` chunk tokens with the highest ``score`` ``[T]``
    (one global choice over every chunk, as ProphetKV and A³ choose; ties go to the earlier token)."""
    chunk = layout.cached.to(score.device)
    num = min(round(ratio * int(chunk.sum())), int(chunk.sum()))
    chosen = torch.zeros(layout.num_tokens, dtype=torch.bool)
    if num:
        ranked = score.float().masked_fill(~chunk, float("-inf"))
        chosen[ranked.topk(num).indices.cpu()] = True
    return chosen


def smooth(score: torch.Tensor, width: int) -> torch.Tensor:
    """``score`` ``[T]`` averaged over a centred window of ``width`` tokens (zero-padded at the ends, as
    ``avg_pool1d`` with ``count_include_pad``: A³'s smoothing); ``width`` 1 returns it unchanged."""
    if width <= 1:
        return score
    pooled = F.avg_pool1d(score.float()[None, None], kernel_size=width, stride=1, padding=width // 2)[0, 0]
    return pooled[: score.shape[0]]  # an even width pads one more slot than it pools away


def with_heads(chosen: torch.Tensor, layout: Layout, num_heads: int) -> torch.Tensor:
    """``chosen`` ``[T]`` bool plus the first ``num_heads`` tokens of every chunk that does not start the
    prompt (LegoLink's attention-sink tokens); ``num_heads`` 0 adds nothing."""
    return chosen | chunk_heads(layout, lambda seg: num_heads) if num_heads else chosen
