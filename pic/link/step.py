"""``LayerStep``: one layer of a recompute pass, as a dynamic policy sees it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pic.kv import ChunkKV, KVPool
from pic.link.layout import Layout


class LayerStep:
    """The tokens that just ran layer ``layer``, with their fresh and cached KV at that layer.

    Attributes:
        layer: the layer that just ran (0-based).
        num_layers: layers in the model.
        layout: the linked prompt.
        tokens: ``[N]`` int64 (model device), sorted indices into the linked prompt of the tokens
            that ran the layer.
        cached: ``[N]`` bool (model device), True for chunk tokens (those with cached KV).
    """

    def __init__(
        self,
        *,
        layer: int,
        num_layers: int,
        layout: Layout,
        tokens: torch.Tensor,
        cached: torch.Tensor,
        rows: torch.Tensor,
        pool: KVPool,
        chunks: Sequence[ChunkKV],
    ) -> None:
        self.layer, self.num_layers, self.layout, self.tokens, self.cached = layer, num_layers, layout, tokens, cached
        self._rows, self._pool, self._chunks = rows, pool, chunks

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[0]

    def fresh_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K (before RoPE) and V the layer just computed: ``[N, num_kv_heads, head_dim]`` each."""
        return self._pool.k_rows[self.layer, self._rows], self._pool.v_rows[self.layer, self._rows]

    def cached_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunks' cached K (before RoPE) and V at this layer: ``[N, num_kv_heads, head_dim]``
        each; zero for prefix and query tokens."""
        k, v = (torch.zeros_like(t) for t in self.fresh_kv())
        for seg, chunk in zip(self.layout.chunks, self._chunks, strict=True):
            inside = (self.tokens >= seg.token_start) & (self.tokens < seg.token_start + seg.num_tokens)
            offsets = self.tokens[inside] - seg.token_start
            k[inside] = chunk.k[self.layer, offsets]
            v[inside] = chunk.v[self.layer, offsets]
        return k, v
