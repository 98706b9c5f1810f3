"""CacheBlend: recompute the chunk tokens whose KV deviates most, chosen at a check layer."""

from __future__ import annotations

import torch
from pydantic import Field

from pic.errors import PolicyError
from pic.link.layout import Layout
from pic.link.policies.base import Policy
from pic.link.step import LayerStep


class CacheBlend(Policy):
    """CacheBlend (Yao et al., 2024), a dynamic policy.

    Every token runs fresh up to and including layer ``check_layer``. There each chunk token is
    scored by the squared L2 distance between its fresh and its cached V (summed over heads and
    head dims); the ``round(ratio * num_chunk_tokens)`` highest-scoring chunk tokens and the whole
    prefix and query keep running through the remaining layers, with the exact causal mask by
    position. The other chunk tokens use their cached KV from the next layer on.

    ``ratio=1.0`` is Full Recompute. The layers up to the check layer cost as much as Full Recompute,
    so ``Linked.recomputed_by_layer`` reports every token there.
    """

    name = "cacheblend"
    ratio: float = Field(default=0.15, ge=0.0, le=1.0)
    check_layer: int = Field(default=1, ge=0)

    def select(self, layout: Layout) -> torch.Tensor:
        return torch.ones(layout.num_tokens, dtype=torch.bool)

    def check_model(self, *, num_layers: int) -> None:
        if self.check_layer >= num_layers:
            raise PolicyError(
                f"policy {self.spec!r}: check_layer={self.check_layer} but the model has {num_layers} layers"
            )

    def after_layer(self, step: LayerStep) -> torch.Tensor | None:
        if step.layer != self.check_layer:
            return None
        fresh_v, cached_v = step.fresh_kv()[1], step.cached_kv()[1]
        score = (fresh_v.float() - cached_v.float()).square().sum(dim=(1, 2))  # [N]
        score = score.masked_fill(~step.cached, float("-inf"))
        # At most every token of the step, not every *chunk* token of it: counting those would read the
        # device back (a host sync). Picks beyond the chunk tokens score -inf and are prefix or query
        # tokens, which run on anyway, so the mask is the same.
        num_keep = min(round(self.ratio * int(step.layout.cached.sum())), step.num_tokens)
        keep = torch.zeros_like(step.cached)
        keep[score.topk(num_keep).indices] = True
        return keep
