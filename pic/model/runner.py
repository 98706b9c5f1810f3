"""The model runner: a layer-by-layer forward over a Hugging Face model's own modules.

It differs from ``model.forward`` in three ways that make position-independent caching possible:
tokens come with explicit logical positions and KV slots (so a pass may run any subset of a
request's tokens), K is written to the pool *before* RoPE, and attention rotates Q and K inside
(``pic.attention``) with an exact causal mask by position. Run over every token of a prompt it
computes exactly what transformers computes; the tests hold it to that.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pic.attention import AttentionPlan, make_plan, paged_attention
from pic.kv import KVCache, RequestKV
from pic.model.spec import ModelSpec, inspect_model

# (layer, alive [N'] int64, rows [N'] int64) -> None or keep [N'] bool; see ``ModelRunner.forward``.
LayerHook = Callable[[int, torch.Tensor, torch.Tensor], "torch.Tensor | None"]


class ModelRunner:
    """Runs a supported HF causal LM over paged NoPE KV."""

    def __init__(self, model: nn.Module) -> None:
        self.spec: ModelSpec = inspect_model(model)
        self.model = model.eval()
        inner = model.model
        self._embed = inner.embed_tokens
        self._layers = inner.layers
        self._norm = inner.norm
        self._rotary = inner.rotary_emb
        self._lm_head = model.lm_head

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[n, head_dim]`` (model dtype) at ``positions`` ``[n]``, from the model's own
        rotary module, so its rope type and attention scaling apply."""
        like = torch.empty(0, dtype=self.spec.dtype, device=self.spec.device)
        cos, sin = self._rotary(like, positions[None])
        return cos[0], sin[0]

    @torch.no_grad()
    def forward(
        self,
        req: RequestKV,
        *,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        logits_rows: torch.Tensor | None = None,
        after_layer: LayerHook | None = None,
    ) -> torch.Tensor | None:
        """Run ``N`` tokens of a request through every layer, writing their K (NoPE) and V.

        Args:
            req: the request; its other written slots are the context the tokens attend to.
            token_ids: ``[N]`` int64.
            positions: ``[N]`` int64 logical positions.
            slots: ``[N]`` int64 request slots the tokens' KV is written to.
            logits_rows: ``[M]`` int64 indices into the ``N`` tokens whose next-token logits to return.
            after_layer: called after each layer with ``(layer, alive, rows)``: ``alive`` ``[N']``
                int64 indices (into the ``N`` tokens) of the tokens that ran it, ``rows`` ``[N']``
                their cache rows. It returns ``None`` or ``[N']`` bool: the tokens that go on to the
                next layer. Dropped tokens keep whatever KV their slots hold in later layers; the
                ``logits_rows`` tokens must not be dropped.

        Returns:
            ``[M, vocab_size]`` float32 logits, or ``None`` when ``logits_rows`` is ``None``.
        """
        req.kv_positions[slots] = positions
        plan = self._plan(req, positions)
        rows = req.physical(slots)
        alive = torch.arange(token_ids.shape[0], device=token_ids.device)
        hidden = self._embed(token_ids)  # [N, hidden_size]
        for index, layer in enumerate(self._layers):
            hidden = self._layer(index, layer, hidden, req.cache, plan, rows)
            keep = None if after_layer is None else after_layer(index, alive, rows)
            if keep is not None and not bool(keep.all()):
                hidden, positions, rows, alive = hidden[keep], positions[keep], rows[keep], alive[keep]
                plan = self._plan(req, positions)
        if logits_rows is None:
            return None
        picked = torch.searchsorted(alive, logits_rows).clamp(max=alive.shape[0] - 1)
        assert torch.equal(alive[picked], logits_rows), "a logits row was dropped from the pass"
        return self._lm_head(self._norm(hidden[picked])).float()

    def _plan(self, req: RequestKV, q_positions: torch.Tensor) -> AttentionPlan:
        return make_plan(
            block_table=req.block_table, q_positions=q_positions, kv_positions=req.kv_positions, rope=self.rope
        )

    def _layer(
        self,
        index: int,
        layer: nn.Module,
        hidden: torch.Tensor,
        cache: KVCache,
        plan: AttentionPlan,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        """One decoder layer; ``hidden`` ``[N, hidden_size]``, ``rows`` ``[N]`` cache rows to write."""
        attn = layer.self_attn
        num_tokens, head_dim = hidden.shape[0], self.spec.head_dim
        x = layer.input_layernorm(hidden)
        q = attn.q_proj(x).view(num_tokens, -1, head_dim)  # [N, Hq, D]
        k = attn.k_proj(x).view(num_tokens, -1, head_dim)  # [N, Hkv, D]
        v = attn.v_proj(x).view(num_tokens, -1, head_dim)  # [N, Hkv, D]
        if self.spec.has_qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        cache.k_rows[index, rows] = k
        cache.v_rows[index, rows] = v
        out = paged_attention(
            q,
            cache.k[index],
            cache.v[index],
            plan,
            scaling=attn.scaling,
            sliding_window=self.spec.sliding_windows[index],
        )
        hidden = hidden + attn.o_proj(out.reshape(num_tokens, -1))
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))
