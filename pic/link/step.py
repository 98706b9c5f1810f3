"""``LayerStep``: one layer of a recompute pass, as a dynamic policy sees it."""

from __future__ import annotations

import torch

from pic.attention.scores import query_scores
from pic.kv import KVCache
from pic.link.layout import Layout
from pic.model.inputs import LayerView


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
        source_rows: torch.Tensor,
        cache: KVCache,
        view: LayerView,
        prompt_rows: torch.Tensor,
    ) -> None:
        self.layer, self.num_layers, self.layout, self.tokens, self.cached = layer, num_layers, layout, tokens, cached
        self._rows, self._source_rows, self._cache = rows, source_rows, cache
        self._view, self._prompt_rows = view, prompt_rows

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[0]

    def fresh_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K (before RoPE) and V the layer just computed: ``[N, num_kv_heads, head_dim]`` each."""
        return self._cache.k_rows[self.layer, self._rows], self._cache.v_rows[self.layer, self._rows]

    def cached_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunks' cached K (before RoPE) and V at this layer: ``[N, num_kv_heads, head_dim]``
        each; zero for prefix and query tokens."""
        inside = (self._source_rows >= 0)[:, None, None]  # [N, 1, 1]
        rows = self._source_rows.clamp(min=0)  # canonical rows: the chunk's blocks as compiled (row 0: unused)
        # where(), not a boolean index: that would count the chunk tokens on the host (a sync); row 0 may
        # hold anything, NaN included, and where() never lets it through.
        zero = torch.zeros((), dtype=self._cache.k_rows.dtype, device=rows.device)
        k = torch.where(inside, self._cache.k_rows[self.layer, rows], zero)
        v = torch.where(inside, self._cache.v_rows[self.layer, rows], zero)
        return k, v

    def query_scores(self) -> torch.Tensor:
        """The query tokens' attention scores at this layer over every prompt token, before the softmax:
        ``[num_q_heads, num_query, T]`` float32 (``pic.attention.scores.query_scores``: RoPE applied at the
        logical positions, ``-inf`` where a query token may not attend). Keys are the request's KV of this
        layer as it stands: fresh for the tokens that ran the layer, cached for the others (A³ scores here)."""
        num_query = self.layout.query.num_tokens  # always run, and last: the step's last rows
        view = self._view
        k = view.k_cache.flatten(0, 1).index_select(0, self._prompt_rows)  # [T, Hkv, D]
        positions = self.layout.positions.to(k.device)
        return query_scores(
            view.q[-num_query:], positions[-num_query:], k, positions,
            rope=view.rope, scaling=view.scaling, sliding_window=view.sliding_window,
        )  # fmt: skip
