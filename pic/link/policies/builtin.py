"""The reference policies (recompute nothing cached, or everything), the suffix a vLLM connector can run, and
``auto``, the default: the most relevant chunks next to the query, recomputed whole, and nothing else.

Measured on SmolLM2-135M and Qwen2.5-Coder-0.5B / 1.5B (docs/policies.md: the frontier of every selection at
budgets of 5 to 30%, and the grid), what keeps ``auto``'s answers is where the tokens are, not how many:

- **The documents' order.** ``auto`` links the chunks by relevance (``Policy.order``: the least relevant first,
  the most relevant next to the query; the request's ``relevance`` scores, else BM25 over token ids), unless the
  link asks for an order (``order="given"`` keeps the caller's). On needles it alone keeps the answers (what each
  choice kept, per model and layout, and the results files it comes from: docs/policies.md, "The default").
- **Whole chunks.** The chunks nearest the query, whole, from the last back, until they hold ``budget`` of the
  chunk tokens (``Suffix(whole=True)``: the vLLM connector's rule, so one rule serves both). A chunk recomputed in
  part reads worse than one left as compiled on Qwen2.5-Coder (its fresh tokens read its stale ones as their own
  context): scattered picks (ProphetKV, InfoFlow, FusionRAG) and cut suffixes lose answers there that whole chunks
  keep, and with the question before the documents only the question's document recomputed whole reads it.
- **No probe.** The selection is static, so the link is one pass of its recomputed rows, which can run in pieces
  beside other work; a probe's extra pass over the query bought no answers in relevance order.
- **A ceiling.** When the whole chunks would be more than ``max_share`` of the chunk tokens (a few long documents,
  the most relevant the longest), the most relevant regions within that share are taken instead (``Regions``), so
  the link recomputes at most about ``max_share`` of the documents whatever their sizes. The prefix and query are
  not counted: they are recomputed under every policy, and a short prompt whose query is half of it still needs
  its document read (a ceiling on the whole prompt left such links with no document token recomputed).
- **A floor on the gain.** Where the prompt is less than ``min_gain`` times what that link would recompute (the
  prefix, the query and the chosen chunk tokens), it runs Full Recompute in the caller's order: a short prompt, one
  document, two of which one is half, a ceiling's regions of half. There a link is at most a little faster and its
  answers are another prompt's (the relevance order's, from stale KV); Full Recompute's are the model's own. Read from
  the counts alone before anything runs, so pic's engine, its server and vLLM's connector choose alike.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from pydantic import Field

from pic.errors import PolicyError
from pic.link.layout import Layout
from pic.link.order import Order
from pic.link.policies.base import Policy
from pic.link.policies.regions import Regions

# ``auto`` runs Full Recompute where the prompt is less than this many times the tokens its link would recompute:
# there a link is not much faster (a short prompt, one document, a budget that is most of the prompt) and it risks
# answers Full Recompute keeps. Chosen from issue 65's cells replayed at other floors (docs/policies.md, "Where a link
# buys no speed"): at 2.5 the links of short documents that still ran lost answers on both models, at 3 none ran.
MIN_GAIN = 3.0


class Naive(Policy):
    """Reuse every chunk's cached KV as is; recompute only the prefix and the query.

    Fastest and least faithful: chunks never see each other, and tokens after the first chunk never
    learn they are no longer at the start of a prompt.
    """

    name = "naive"

    def select(self, layout: Layout) -> torch.Tensor:
        return torch.zeros(layout.num_tokens, dtype=torch.bool)


class FullRecompute(Policy):
    """Recompute every token: exactly the model's own prefill of the linked prompt (the oracle)."""

    name = "full"

    def select(self, layout: Layout) -> torch.Tensor:
        return torch.ones(layout.num_tokens, dtype=torch.bool)


def suffix_length(chunk_lengths: Sequence[int], ratio: float, *, whole: bool) -> int:
    """The chunk tokens a suffix of ``ratio`` recomputes, over chunks of ``chunk_lengths`` tokens in prompt order:
    ``round(ratio * total)``, and with ``whole`` reaching back to the start of the chunk that count would cut. The one
    rule of pic's engine (``Suffix``, ``Auto``) and vLLM's connector (``pic.vllm.params.VllmSuffix``)."""
    total = sum(chunk_lengths)
    num = round(ratio * total)
    if whole and num > 0:
        tail = 0
        for length in reversed(chunk_lengths):  # whole chunks from the last, until they hold the suffix
            tail += length
            if tail >= num:
                break
        num = min(tail, total)
    return num


class AutoChoice(enum.Enum):
    """What ``auto`` runs for a layout (``auto_plan``)."""

    WHOLE_CHUNKS = "whole chunks"  # the last chunks whole: Suffix(whole=True)
    REGIONS = "regions"  # the most relevant regions within max_share: Regions
    FULL = "full"  # Full Recompute in the caller's order: the link would not be much faster


@dataclass(frozen=True)
class AutoPlan:
    """``auto``'s choice for a layout and the chunk tokens it recomputes (every chunk token under ``FULL``)."""

    choice: AutoChoice
    num_recomputed: int


def auto_plan(
    chunk_lengths: Sequence[int],
    num_other_tokens: int,
    *,
    budget: float,
    max_share: float,
    min_chunks: int = 1,
    min_gain: float = 1.0,
) -> AutoPlan:
    """What ``Auto`` runs over chunks of ``chunk_lengths`` tokens (prompt order) and ``num_other_tokens`` more (the
    prefix and the query, recomputed under every policy): the last chunks whole, at least ``budget`` of the chunk
    tokens and at least ``min_chunks`` chunks, when that is at most ``max_share`` of them (or there are none); else
    the best regions within ``max_share``. Then, read from the counts alone before anything runs: when the prompt is
    less than ``min_gain`` times the tokens that choice recomputes, the link would buy little speed for what it
    risks, and Full Recompute runs instead (in the caller's order). The one rule of pic's engine (``Auto``) and vLLM's
    connector (``pic.vllm.params.VllmSuffix``)."""
    total = sum(chunk_lengths)
    num = suffix_length(chunk_lengths, budget, whole=True)
    if min_chunks > 0 and chunk_lengths:
        num = max(num, sum(chunk_lengths[-min_chunks:]))
    plan = AutoPlan(AutoChoice.WHOLE_CHUNKS, num)
    if num > max_share * total and total:
        plan = AutoPlan(AutoChoice.REGIONS, min(round(max_share * total), total))
    if total + num_other_tokens < min_gain * (plan.num_recomputed + num_other_tokens):
        plan = AutoPlan(AutoChoice.FULL, total)
    return plan


class Suffix(Policy):
    """Recompute the last ``ratio`` of the chunk tokens (those right before the query), reuse the rest as is;
    ``whole``: extended back to the start of the chunk the cut falls in, so no chunk is part fresh, part cached.

    It is what ``PicConnector`` runs inside vLLM, whose forward computes only a suffix of the prompt
    (``pic.vllm.params.VllmSuffix``, the same count: ``suffix_length``); here it lets pic's engine measure that
    policy beside its own (docs/vllm.md). With the relevance order, the recomputed tokens are the most relevant
    documents'."""

    name = "suffix"
    ratio: float = Field(default=0.2, ge=0.0, le=1.0)
    whole: bool = False

    def select(self, layout: Layout) -> torch.Tensor:
        chosen = torch.zeros(layout.num_tokens, dtype=torch.bool)
        num = suffix_length([seg.num_tokens for seg in layout.chunks], self.ratio, whole=self.whole)
        if num:
            chosen[int(layout.cached.nonzero().flatten()[-num]) :] = True  # from the num-th last chunk token
        return chosen & layout.cached


class Auto(Policy):
    """The last (most relevant) chunks whole, at least ``budget`` of the chunk tokens and ``min_chunks`` chunks, at most
    ``max_share`` of them (else the best regions within ``max_share``), the chunks in relevance order; Full
    Recompute in the caller's order where the prompt is less than ``min_gain`` times what that recomputes (the
    module docstring; ``auto_plan``). ``Linked.policy`` reports the policy it chose for the layout."""

    name = "auto"
    order = Order.RELEVANCE
    budget: float = Field(default=0.05, ge=0.0, le=1.0)
    max_share: float = Field(default=0.5, gt=0.0, le=1.0)
    min_chunks: int = Field(default=1, ge=0)
    min_gain: float = Field(default=MIN_GAIN, ge=1.0)

    def plan(self, chunk_lengths: Sequence[int], num_other_tokens: int) -> AutoPlan:
        """``auto_plan`` under this policy's settings."""
        return auto_plan(
            chunk_lengths, num_other_tokens, budget=self.budget, max_share=self.max_share,
            min_chunks=self.min_chunks, min_gain=self.min_gain,
        )  # fmt: skip

    def for_layout(self, layout: Layout) -> Policy:
        lengths = [seg.num_tokens for seg in layout.chunks]
        plan = self.plan(lengths, layout.num_tokens - sum(lengths))
        if plan.choice is AutoChoice.FULL:
            return FullRecompute()
        if plan.choice is AutoChoice.REGIONS:
            return Regions(budget=self.max_share)
        if plan.num_recomputed == suffix_length(lengths, self.budget, whole=True):
            return Suffix(ratio=self.budget, whole=True)
        return Suffix(ratio=plan.num_recomputed / sum(lengths), whole=True)  # min_chunks reached further back

    def select(self, layout: Layout) -> torch.Tensor:
        raise PolicyError(f"policy {self.spec!r} chooses per layout: run for_layout(layout)'s policy (the engine does)")
