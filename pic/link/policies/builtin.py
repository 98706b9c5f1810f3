"""The two reference policies, recompute nothing cached or everything, and the suffix a vLLM connector can run."""

from __future__ import annotations

import torch
from pydantic import Field

from pic.link.layout import Layout
from pic.link.policies.base import Policy


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


class Suffix(Policy):
    """Recompute the last ``ratio`` of the chunk tokens (those right before the query), reuse the rest as is;
    ``whole``: extended back to the start of the chunk the cut falls in, so no chunk is part fresh, part cached.

    It is what ``PicConnector`` runs inside vLLM, whose forward computes only a suffix of the prompt
    (``pic.vllm.params.Suffix``, the same count: ``round(ratio * chunk tokens)``); here it lets pic's engine
    measure that policy beside its own (docs/vllm.md). With the relevance order, the recomputed tokens are the
    most relevant documents'."""

    name = "suffix"
    ratio: float = Field(default=0.2, ge=0.0, le=1.0)
    whole: bool = False

    def select(self, layout: Layout) -> torch.Tensor:
        chunk = layout.cached.nonzero().flatten()  # chunk token indices, in prompt order
        chosen = torch.zeros(layout.num_tokens, dtype=torch.bool)
        num = round(self.ratio * chunk.numel())
        if not num:
            return chosen
        start = int(chunk[-num])
        if self.whole:
            start = next(seg.token_start for seg in layout.chunks if seg.token_start + seg.num_tokens > start)
        chosen[start:] = True
        return chosen & layout.cached
