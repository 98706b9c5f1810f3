"""``regions``: pic's own policy. Recompute the regions of the most relevant chunks, whole, within a budget.

ProphetKV and A³ choose scattered tokens by the query's attention. On SmolLM2 that attention, read over
the cached chunks, does not find the document holding the answer (no better than chance on either QA
workload), while recomputing that document's text does most of what Full Recompute does (docs/policies.md).
So this policy ranks first and recomputes contiguous text second:

1. Rank the chunks: by the relevance the request gives (``link(..., relevance=[...])``: a retriever's
   scores), else by their lexical overlap with the query (BM25 over token ids, ``pic.link.order.bm25``),
   or, with ``rank="probe"``, by the query's attention over them (a probe pass first, ProphetKV's).
2. Cut each chunk into windows of ``window`` tokens, aligned to its end as its blocks are (a window of 16
   with blocks of 16 is one block: the blocks left alone stay shared). In the best chunk, take the window
   that overlaps the query most and every window after it to the chunk's end (text after the answer reads
   it, as in the model's own pass), then the chunk's other windows, best first; then the next chunk.
3. Stop at ``budget`` of the chunk tokens: a window the budget ends in is taken in part, from its first token
   the query has (so a short chunk is not left out for being shorter than the window's remainder). The first
   ``heads`` tokens of every chunk that does not start the prompt are recomputed too, inside the budget
   (LegoLink's sinks).

Compile the chunks in context (``compile(docs, context=engine.chat_context(messages))``, or
``link_chat(..., documents=...)``): on SmolLM2 it is what lets a fifth of the chunk tokens do nearly all of Full
Recompute's work on paragraph-length documents asked about first (docs/policies.md).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from pic.link.layout import Layout, Segment
from pic.link.order import bm25, term_stats
from pic.link.policies.base import Policy
from pic.link.policies.heads import chunk_heads
from pic.link.policies.scoring import top_chunk_tokens
from pic.link.probe import Probe


class Regions(Policy):
    """Recompute the most relevant chunks' regions whole, within ``budget`` of the chunk tokens (see the
    module docstring). ``budget=1.0`` with one window per chunk is Full Recompute of the chunks.

    ``picks`` > 0 runs a probe first and spends that share of the budget on its picks (ProphetKV's: the
    chunk tokens the query attends to most, averaged over the layers) after the regions take the rest; the
    probe reruns the query, so its tokens are paid from the budget too. ``auto`` uses it when the question
    comes before the chunks: the regions let the question's document read the question, the picks repair
    the cached tokens the query leans on elsewhere (on Qwen2.5-Coder-0.5B, regions alone lose answers there
    that the probe's picks keep: docs/policies.md#the-default-auto-what-it-does-and-why)."""

    name = "regions"
    budget: float = Field(default=0.2, ge=0.0, le=1.0)
    window: int = Field(default=16, ge=1)
    heads: int = Field(default=1, ge=0)
    rank: Literal["lexical", "probe"] = "lexical"
    picks: float = Field(default=0.0, ge=0.0, le=1.0)

    @property
    def is_query_aware(self) -> bool:
        return self.rank == "probe" or self.picks > 0

    def select(self, layout: Layout) -> torch.Tensor:
        if self.is_query_aware:
            return torch.zeros(layout.num_tokens, dtype=torch.bool)  # the probe: prefix and query
        return self._lexical(layout, self._limit(layout))

    def after_probe(self, probe: Probe) -> torch.Tensor:
        layout, mass = probe.layout, probe.mass.mean(0)  # [T]: the query's attention, averaged over layers
        total = self._limit(layout)
        if self.picks > 0:  # the probe reran the query: paid from the budget
            total = max(total - len(layout.query_ids), 0)
        limit = round((1 - self.picks) * total)
        if self.rank == "lexical":
            chosen = self._lexical(layout, limit)
        else:
            by_chunk = [float(mass[seg.tokens].sum()) for seg in layout.chunks]
            given = _relevance(layout)

            def windows_score(seg: Segment, windows: list[list[int]]) -> list[float]:
                return [float(mass[seg.token_start + w[0] : seg.token_start + w[-1] + 1].sum()) for w in windows]

            chosen = self._choose(layout, windows_score, given if given is not None else by_chunk, limit, offsets=True)
        return _fill(chosen, mass, layout, total) if self.picks > 0 else chosen

    def _limit(self, layout: Layout) -> int:
        return int(self.budget * sum(seg.num_tokens for seg in layout.chunks))

    def _lexical(self, layout: Layout, limit: int) -> torch.Tensor:
        units = [term_stats(layout.token_ids[seg.tokens]) for seg in layout.chunks]  # (every window's corpus)
        query = layout.query_ids
        return self._choose(layout, lambda seg, windows: bm25(query, windows, corpus=units), _relevance(layout), limit)

    def _choose(
        self, layout: Layout, score_windows, chunk_scores: list[float] | None, limit: int, *, offsets: bool = False
    ):
        """``[T]`` bool: heads, then windows of chunks in rank order (module docstring), within ``limit`` tokens.
        ``score_windows(seg, windows)`` scores a chunk's windows, given as token ids (or, with ``offsets``, as
        offsets into the chunk)."""
        chunks = layout.chunks
        chosen = chunk_heads(layout, lambda seg: self.heads)
        if int(chosen.sum()) > limit:
            return torch.zeros_like(chosen)
        if chunk_scores is None and layout.lexical is not None:  # (the link ranked them so already)
            chunk_scores = list(layout.lexical)
        elif chunk_scores is None:
            units = [layout.token_ids[seg.tokens].tolist() for seg in chunks]
            chunk_scores = bm25(layout.query_ids, units)
        for index in sorted(range(len(chunks)), key=lambda i: -chunk_scores[i]):
            seg = chunks[index]
            spans = _windows(seg.num_tokens, self.window)  # offsets into the chunk
            units = spans if offsets else [layout.token_ids[seg.tokens][s].tolist() for s in map(_slice, spans)]
            scores = score_windows(seg, units)
            best = max(range(len(spans)), key=lambda j: (scores[j], -j))
            before = sorted(range(best), key=lambda j: (-scores[j], j))
            for j in [*range(best, len(spans)), *before]:
                first, last = seg.token_start + spans[j][0], seg.token_start + spans[j][-1] + 1
                room = limit - int(chosen.sum()) + int(chosen[first:last].sum())
                if last - first > room:  # the budget ends inside this window: as much of it as fits, then stop
                    start = min(_first_match(layout, first, last), last - room)
                    chosen[start : start + room] = True
                    return chosen
                chosen[first:last] = True
        return chosen


def _relevance(layout: Layout) -> list[float] | None:
    """The request's relevance scores of the chunks, when it gave them."""
    scores = [seg.relevance for seg in layout.chunks]
    return None if any(s is None for s in scores) else scores


def _fill(chosen: torch.Tensor, score: torch.Tensor, layout: Layout, total: int) -> torch.Tensor:
    """``chosen`` plus the chunk tokens not in it with the highest ``score`` ``[T]``, up to ``total`` in all."""
    room = total - int(chosen.sum())
    num_chunk = int(layout.cached.sum())
    if room <= 0 or not num_chunk:
        return chosen
    rest = score.float().cpu().masked_fill(chosen, float("-inf"))  # what is chosen already ranks last
    return chosen | top_chunk_tokens(rest, layout, room / num_chunk)


def _first_match(layout: Layout, first: int, last: int) -> int:
    """The first prompt index in ``[first, last)`` whose token the query has (``first`` when none has): where
    a window that only partly fits the budget is taken from."""
    query = set(layout.query_ids)
    return next((i for i in range(first, last) if int(layout.token_ids[i]) in query), first)


def _windows(num_tokens: int, window: int) -> list[list[int]]:
    """Offsets ``0 .. num_tokens - 1`` cut into windows of ``window``, aligned to the end (the first is the
    remainder), as a front-padded chunk's blocks are."""
    first = num_tokens % window
    starts = ([0] if first else []) + list(range(first, num_tokens, window))
    ends = [*starts[1:], num_tokens]
    return [list(range(a, b)) for a, b in zip(starts, ends, strict=True)]


def _slice(span: list[int]) -> slice:
    return slice(span[0], span[-1] + 1)
