"""``auto``, the default: read where the question is, then spend one budget as that layout needs.

Measured on SmolLM2-135M and Qwen2.5-Coder-0.5B (docs/policies.md), what keeps the answers depends on the layout:

- **The question only after the documents** (RULER's needle in a haystack, most RAG templates): no document
  token sees the question, even in Full Recompute, so recomputing the question's document buys nothing; on
  SmolLM2's needles it does harm (the needle's chunk recomputed whole: 50% of needles found, Naive 75%, Full
  Recompute 95%), as its fresh tokens read the stale chunks before it. What differs from Full Recompute is
  what the chunks never saw of each other, and the query's attention in a probe finds the tokens that carry
  it: ProphetKV's picks (82.5%, and 85% with the needle's chunk left out: the repairs are elsewhere, a
  quarter of them in the chunk just before the question). So: ``ProphetKV``.
- **The question before the documents** (and usually again after them): Full Recompute's document tokens
  attend to the question, a cached chunk's never did, so the question's document must be recomputed to read
  it: ``regions`` (ranked by the request's relevance or BM25). On SmolLM2 that alone is within a few points of
  Full Recompute; on Qwen2.5-Coder-0.5B it loses 46 points, where the probe's picks lose none: that model's
  cached tokens the query leans on must be repaired too. So: ``Regions(picks=0.5)``, half the budget on the
  question's regions, half on the probe's picks.
- **Either way, a probe only when it is cheap.** The probe reruns the query, and its tokens are paid from the
  budget: over short documents (a 20-token query, 40 tokens of budget over ~200 chunk tokens) it takes half,
  and what is left is too little: on SmolLM2's ``qa`` the split loses 48 points with the question first
  where ``regions`` alone loses 24.5-29, and the picks alone lose 24 with the question after where
  ``regions`` loses 15. So when the query costs more than ``max_probe`` (a quarter) of the budget, ``auto``
  runs ``Regions(budget)`` alone, in either layout.

- **The documents' order**: ``auto`` links the chunks by relevance (``order_for``: the least relevant first, the
  most relevant next to the query; the request's ``relevance`` scores, else BM25 over token ids), unless the
  link asks for an order (``order="given"`` keeps the caller's). On SmolLM2 the order moves answers more than
  any choice of recomputed tokens (short documents asked about after them: ``auto`` in the given order 15
  points under Full Recompute, in relevance order 11.7 above it), and with the question first it still helps
  the link more than it costs the prompt; on Qwen2.5-Coder it changes little. The most relevant chunk *first*
  was measured and ruins the link. docs/policies.md has the grid the rule was chosen on, every layout and model.

``auto`` asks two questions of the layout: does the probe cost at most ``max_probe`` of the budget, and
does a run of at least ``question_run`` of the query's tokens appear in the prefix (the text before the first
chunk)? The budget is the share of the chunk tokens'
token-layers the link recomputes, the probe included (it reruns the query): the second pass recomputes
``budget * chunk tokens - query tokens`` of them (none when the query alone exceeds the budget). The chosen
policy is what ``Linked.policy`` reports.

The rule reads token ids only: a chat template's tokens shared by the prefix and the query (``<|im_end|>\n
<|im_start|>``: three tokens in ChatML) are shorter than the default run of 5; a question of fewer than 5
tokens repeated before and after reads as asked after. ``tests/test_auto_policy.py`` pins both branches on
the accuracy workloads' real chat prompts.
"""

from __future__ import annotations

import torch
from pydantic import Field

from pic.errors import PolicyError
from pic.link.layout import Layout, SegmentKind
from pic.link.order import Order
from pic.link.policies.base import Policy
from pic.link.policies.query import ProphetKV
from pic.link.policies.regions import Regions


class Auto(Policy):
    """Regions and a probe's picks when the question precedes the chunks, the picks alone when it follows them,
    the regions alone when a probe would cost more than ``max_probe`` of the budget (module docstring).
    ``budget``: the share of the chunk tokens' token-layers the link recomputes, the probe included; ``picks``:
    the budget's share for the probe's picks when the question comes first; ``question_run``: the query tokens
    in a row that, found before the chunks, mean it came first."""

    name = "auto"
    budget: float = Field(default=0.2, ge=0.0, le=1.0)
    picks: float = Field(default=0.5, ge=0.0, le=1.0)
    max_probe: float = Field(default=0.25, ge=0.0, le=1.0)
    question_run: int = Field(default=5, ge=1)

    def for_layout(self, layout: Layout) -> Policy:
        num_chunk = sum(seg.num_tokens for seg in layout.chunks)
        probe = len(layout.query_ids)  # the probe reruns the query: its cost in the budget
        if probe > self.max_probe * self.budget * num_chunk:
            return Regions(budget=self.budget)  # too dear a probe: the regions take the whole budget
        if question_before(layout, self.question_run):
            return Regions(budget=self.budget, picks=self.picks)
        ratio = max(self.budget * num_chunk - probe, 0.0) / max(num_chunk, 1)
        return ProphetKV(ratio=min(round(ratio, 4), 1.0))

    def order_for(self, layout: Layout) -> Order:
        """The relevance order, in every layout (module docstring)."""
        return Order.RELEVANCE

    def select(self, layout: Layout) -> torch.Tensor:
        raise PolicyError(f"policy {self.spec!r} chooses per layout: run for_layout(layout)'s policy (the engine does)")


def question_before(layout: Layout, min_run: int) -> bool:
    """Whether ``min_run`` consecutive tokens of the query (its given tokens) occur in the prefix."""
    prefix = [seg for seg in layout.segments if seg.kind is SegmentKind.PREFIX]
    query = layout.query_ids
    if not prefix or len(query) < min_run:
        return False
    before = layout.token_ids[prefix[0].tokens].tolist()
    runs = {tuple(before[i : i + min_run]) for i in range(len(before) - min_run + 1)}
    return any(tuple(query[i : i + min_run]) in runs for i in range(len(query) - min_run + 1))
