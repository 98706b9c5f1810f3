"""A³ (arXiv 2511.17560): a dynamic policy that scores the chunk tokens at one layer of the recompute pass, by
the query's attention, and keeps the best running from the next layer on. Faithful to the authors' code, with the
deviations named in the docstring."""

from __future__ import annotations

import math

import torch
from pydantic import Field

from pic.errors import PolicyError
from pic.link.layout import Layout
from pic.link.policies.base import Policy
from pic.link.policies.scoring import smooth, top_chunk_tokens, with_heads
from pic.link.step import LayerStep


class A3(Policy):
    """A³ (arXiv 2511.17560; its released code, github.com/yczhounlp/ragkv): a dynamic policy.

    Every token runs fresh through layer ``layer`` (1 in the paper). There the query tokens' attention over
    the chunk tokens and themselves is taken with the heads merged (one softmax over ``sum_h q_h . k_h /
    sqrt(num_heads * head_dim)``, the prefix left out), summed over the query tokens, smoothed with a
    moving average of ``smoothing`` tokens (5), and the top ``ratio`` (0.15) of the chunk tokens keep running
    with the query from the next layer on; the others use their cached KV. ``heads`` adds LegoLink's first
    tokens of every later chunk (not in the paper).

    Deviations: ``ratio`` is a share of the chunk tokens (the code takes it of prefix and chunk tokens,
    choosing among chunk tokens only); the code runs layer 0 in full and scores with layer 1's fresh keys,
    as here. The paper's text was not available to check the code against.
    """

    name = "a3"
    ratio: float = Field(default=0.15, ge=0.0, le=1.0)
    layer: int = Field(default=1, ge=0)
    smoothing: int = Field(default=5, ge=1, le=64)
    heads: int = Field(default=0, ge=0)

    def check_model(self, *, num_layers: int) -> None:
        if self.layer >= num_layers:
            raise PolicyError(f"policy {self.spec!r}: layer={self.layer} but the model has {num_layers} layers")

    def select(self, layout: Layout) -> torch.Tensor:
        return torch.ones(layout.num_tokens, dtype=torch.bool)

    def after_layer(self, step: LayerStep) -> torch.Tensor | None:
        if step.layer != self.layer:
            return None
        layout = step.layout
        scores = step.query_scores()  # [Hq, nq, T], scaled by 1/sqrt(head_dim) per head
        merged = scores.sum(0) / math.sqrt(scores.shape[0])  # [nq, T]: the heads' dot products over sqrt(H * D)
        prefix = ~layout.cached.to(merged.device)
        prefix[layout.query.tokens] = False
        attention = merged.masked_fill(prefix, float("-inf")).softmax(-1).sum(0)  # [T]
        attention = attention.masked_fill(~layout.cached.to(attention.device), 0.0)  # smooth over the chunks only
        chosen = with_heads(top_chunk_tokens(smooth(attention, self.smoothing), layout, self.ratio), layout, self.heads)
        return chosen.to(step.tokens.device)[step.tokens]
