"""Policies that recompute the head of every linked chunk: EPIC's LegoLink and LegoLink-0, MEPIC.

A chunk was prefilled alone, so its first tokens act as attention sinks that believe they start the
prompt; recomputing them lets the chunk's head see what precedes it (EPIC). The chunk that starts
the prompt (no prefix before it) is exactly what was cached, so it is left alone; behind a prefix the
first chunk is recomputed like the others. A chunk's tokens include its own BOS when it was
compiled with one, so ``LegoLink(k=16)`` recomputes the BOS and 15 content tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from pydantic import Field

from pic.config import CompileOptions
from pic.link.layout import Layout, Segment
from pic.link.policies.base import Policy


def chunk_heads(layout: Layout, num_head_tokens: Callable[[Segment], int]) -> torch.Tensor:
    """``[T]`` bool: the first ``num_head_tokens(seg)`` tokens of every chunk that does not start the prompt."""
    mask = torch.zeros(layout.num_tokens, dtype=torch.bool)
    for seg in layout.chunks:
        if seg.token_start > 0:
            mask[seg.token_start : seg.token_start + min(num_head_tokens(seg), seg.num_tokens)] = True
    return mask


class LegoLink(Policy):
    """EPIC's LegoLink: recompute the first ``k`` tokens of every chunk (but one starting the
    prompt) and the query. ``k`` at least every chunk's length is Full Recompute."""

    name = "legolink"
    k: int = Field(default=16, ge=0)

    def select(self, layout: Layout) -> torch.Tensor:
        return chunk_heads(layout, lambda seg: self.k)


class LegoLinkZero(Policy):
    """EPIC's LegoLink-0: compile every chunk after ``extra_bos`` extra BOS tokens whose KV is dropped,
    so the chunk's own tokens never served as the prompt's attention sinks; link by recomputing only
    the query. Chunks compiled without the extra BOS tokens are refused at link time.

    It relies on the model having learned attention sinks on the first tokens of its training
    sequences; a model trained on random windows of text (like the embedded stories260K) has none,
    and LegoLink-0 is then no better than Naive.
    """

    name = "legolink0"
    extra_bos: int = Field(default=3, ge=1, le=64)

    def compile_options(self, base: CompileOptions) -> CompileOptions:
        return base.model_copy(update={"num_extra_bos": self.extra_bos})

    def select(self, layout: Layout) -> torch.Tensor:
        return torch.zeros(layout.num_tokens, dtype=torch.bool)


class MEPIC(Policy):
    """MEPIC: recompute the whole first block of every chunk (but one starting the prompt) and the query.

    Chunks are front-padded to whole blocks, so the first block holds the chunk's first
    ``len % block_size`` real tokens (a whole block when the length is a multiple). Only that block
    differs from the cached chunk; every other block is clean and can be shared across requests.
    """

    name = "mepic"

    def select(self, layout: Layout) -> torch.Tensor:
        size = layout.block_size
        return chunk_heads(layout, lambda seg: size - seg.slot_start % size)
