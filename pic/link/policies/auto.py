"""``auto``: read where the question is, then choose the policy that keeps the answers there.

Measured on SmolLM2-135M and Qwen2.5-Coder-0.5B (docs/policies.md), no one policy keeps the answers in both
layouts a RAG prompt comes in:

- **The question before the documents** (and usually again after them): Full Recompute's document tokens
  attend to the question, a cached chunk's never did. What brings the answers back is recomputing the
  document the question is about, whole, so its tokens read the question: ``regions`` (ranked by the
  request's relevance or BM25, compiled in context). The query's attention over the stale chunks (a probe)
  does not find that document, and ProphetKV loses 10-15 points there.
- **The question only after the documents** (RULER's needle-in-a-haystack, most RAG templates): no
  document token sees the question, even in Full Recompute, so recomputing the answer's document buys
  nothing; what differs is what the chunks never saw of each other. The query's attention in a probe finds
  the tokens that carry it (the needle, sinks, the other documents' competing facts) and ProphetKV's
  scattered picks keep the answers, where ``regions`` loses every early needle.

So ``auto`` asks one question of the layout: does a run of at least ``question_run`` of the query's tokens
appear in the prefix (the text before the first chunk)? Then the question came before: ``Regions(budget)``.
Otherwise ``ProphetKV`` picks the tokens, its probe counted in the budget: the probe reruns the query, so
the second pass recomputes ``budget * chunk tokens - query tokens`` of them (none when the query alone
exceeds the budget). The chosen policy is what ``Linked.policy`` reports.

The rule reads token ids only: a chat template's tokens shared by the prefix and the query (``<|im_end|>\n
<|im_start|>``: three tokens in ChatML) are shorter than the default run of 5; a question of fewer than 5
tokens repeated before and after reads as asked after. ``tests/test_auto_policy.py`` pins both branches on
real chat prompts.
"""

from __future__ import annotations

import torch
from pydantic import Field

from pic.errors import PolicyError
from pic.link.layout import Layout, SegmentKind
from pic.link.policies.base import Policy
from pic.link.policies.query import ProphetKV
from pic.link.policies.regions import Regions


class Auto(Policy):
    """Regions when the question precedes the chunks, a probe's picks when it follows them (module
    docstring); ``budget`` is the share of the chunk tokens' token-layers the link recomputes, probe included."""

    name = "auto"
    budget: float = Field(default=0.2, ge=0.0, le=1.0)
    picks: float = Field(default=0.5, ge=0.0, le=1.0)
    question_run: int = Field(default=5, ge=1)

    def for_layout(self, layout: Layout) -> Policy:
        if question_before(layout, self.question_run):
            return Regions(budget=self.budget, picks=self.picks)
        num_chunk = sum(seg.num_tokens for seg in layout.chunks)
        probe = len(layout.query_ids)
        ratio = max(self.budget * num_chunk - probe, 0.0) / max(num_chunk, 1)
        return ProphetKV(ratio=min(round(ratio, 4), 1.0))

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
