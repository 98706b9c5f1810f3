"""``anchors``: recompute the tokens a query leans on, found without a probe: each chunk's head and its separators.

A probe (ProphetKV's) runs the query over the linked chunks and recomputes the tokens it attends to most. On both
real models measured here those are mostly the same kinds of token (docs/policies.md): the first token of each
chunk (an attention sink that believes it starts the prompt: EPIC's LegoLink recomputes it) and the separators,
sentence ends above all (SepLLM, arXiv 2412.12094: a separator summarizes the segment it ends, and attention
concentrates on it). A cached separator summarized its sentence without the chunks before it; recomputed, it
reads them, and the query reads it.

So, within ``budget`` of the chunk tokens: the first ``heads`` tokens of every chunk that does not start the
prompt; then the separators (``Layout.separators``: sentence ends and line breaks, then clause ends), chunk by
chunk from the most relevant (the request's ``relevance``, else BM25 of the chunk against the query), each
chunk's from its end; then, if budget is left, the tokens just before the chosen separators (the end of each
sentence), nearest first. No probe: the choice is static, the pass runs in pieces, and it costs the query once.
"""

from __future__ import annotations

import torch
from pydantic import Field

from pic.errors import PolicyError
from pic.link.layout import Layout
from pic.link.lexical import bm25
from pic.link.policies.base import Policy
from pic.link.policies.heads import chunk_heads
from pic.link.separators import Kind


class Anchors(Policy):
    """Each chunk's first ``heads`` tokens and its separators, most relevant chunks first, within ``budget`` of the
    chunk tokens (see the module docstring). Needs the layout's separators (the engine marks them)."""

    name = "anchors"
    budget: float = Field(default=0.2, ge=0.0, le=1.0)
    heads: int = Field(default=1, ge=0)

    def select(self, layout: Layout) -> torch.Tensor:
        limit = int(self.budget * int(layout.cached.sum()))
        chosen = chunk_heads(layout, lambda seg: self.heads)
        if int(chosen.sum()) > limit:  # not even the heads fit
            chosen = torch.zeros_like(chosen)
        return add_anchors(layout, chosen, limit)


def add_anchors(layout: Layout, chosen: torch.Tensor, limit: int) -> torch.Tensor:
    """``chosen`` ``[T]`` bool plus the layout's separators (sentence ends, then clause ends; the most relevant
    chunk first, each from its end), then the tokens before them, until it holds ``limit`` tokens. Chunks that
    start the prompt are exactly as cached and are left alone.

    Raises:
        PolicyError: the layout has no separators marked (made outside an engine).
    """
    if layout.separators is None:
        raise PolicyError("anchors need the layout's separators (Layout.separators), which the engine marks")
    ranked = [i for i in _ranked_chunks(layout) if layout.chunks[i].token_start > 0]
    for kind in (Kind.STRONG, Kind.WEAK):
        for index in ranked:
            seg = layout.chunks[index]
            found = (layout.separators[seg.tokens] == kind).nonzero().flatten().flip(0) + seg.token_start
            chosen = _take(chosen, found, limit)
    ends = (chosen & layout.cached & (layout.separators > 0)).nonzero().flatten()
    for back in range(1, layout.num_tokens):  # the sentences' last words, nearest the separator first
        prior = ends - back
        prior = prior[prior >= 0]
        prior = prior[layout.cached[prior]]
        if int(chosen.sum()) >= limit or not prior.numel():
            break
        chosen = _take(chosen, prior, limit)
    return chosen


def _ranked_chunks(layout: Layout) -> list[int]:
    """Chunk indices, the most relevant first: by the request's scores, else BM25 against the query."""
    chunks = layout.chunks
    scores = [seg.relevance for seg in chunks]
    if any(s is None for s in scores):
        scores = bm25(layout.query_ids, [layout.token_ids[seg.tokens].tolist() for seg in chunks])
    return sorted(range(len(chunks)), key=lambda i: (-scores[i], -i))  # ties: the later chunk first


def _take(chosen: torch.Tensor, indices: torch.Tensor, limit: int) -> torch.Tensor:
    """``chosen`` plus ``indices`` ``[n]`` in order, while ``chosen`` holds fewer than ``limit`` tokens."""
    fresh = indices[~chosen[indices]]
    room = limit - int(chosen.sum())
    if room > 0 and fresh.numel():
        chosen[fresh[:room]] = True
    return chosen
