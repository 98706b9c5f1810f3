"""The two reference policies: recompute nothing cached, or everything."""

from __future__ import annotations

import torch

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
