"""The fused-RoPE paged reference attention equals transformers' attention on pre-rotated K."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from pic.attention import make_plan, paged_attention

HQ, HKV, D, BS = 8, 2, 16, 4


def hf_attention(q, k, v, *, window: int | None):
    """transformers' eager attention over contiguous, already-rotated q/k: [T, H, D] each."""
    t = q.shape[0]
    i = torch.arange(t)
    allowed = i[None, :] <= i[:, None]
    if window is not None:
        allowed &= i[None, :] > i[:, None] - window
    mask = torch.zeros(t, t).masked_fill(~allowed, float("-inf"))[None, None]
    module = types.SimpleNamespace(num_key_value_groups=HQ // HKV, training=False)
    out, _ = eager_attention_forward(
        module, q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, scaling=D**-0.5
    )
    return out[0]  # [T, HQ, D]


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("rope_type", ["default", "yarn"])
def test_paged_fused_rope_equals_hf(window, rope_type):
    torch.manual_seed(0)
    params = {"rope_type": rope_type, "rope_theta": 10000.0}
    if rope_type == "yarn":
        params |= {"factor": 4.0, "original_max_position_embeddings": 16}
    rotary = LlamaRotaryEmbedding(
        LlamaConfig(hidden_size=HQ * D, num_attention_heads=HQ, max_position_embeddings=64, rope_parameters=params)
    )

    def rope(positions):
        cos, sin = rotary(torch.empty(0), positions[None])
        return cos[0], sin[0]

    t = 23
    q, k, v = torch.randn(t, HQ, D), torch.randn(t, HKV, D), torch.randn(t, HKV, D)
    cos, sin = rope(torch.arange(t))
    q_rot, k_rot = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    expected = hf_attention(q_rot[0].transpose(0, 1), k_rot[0].transpose(0, 1), v, window=window)

    # The same tokens in a paged cache: shuffled physical blocks, 3 padding slots in front, NoPE K.
    num_blocks = 12
    k_cache, v_cache = torch.randn(num_blocks, BS, HKV, D), torch.randn(num_blocks, BS, HKV, D)  # garbage elsewhere
    table = torch.randperm(num_blocks)[: -(-(t + 3) // BS)]
    slots = torch.arange(t) + 3
    rows = table[slots // BS] * BS + slots % BS
    k_cache.view(-1, HKV, D)[rows], v_cache.view(-1, HKV, D)[rows] = k, v
    kv_positions = torch.full((table.shape[0] * BS,), -1)
    kv_positions[slots] = torch.arange(t)

    for query in (torch.arange(t), torch.tensor([0, 7, 8, 22])):  # every token, and a recompute subset
        plan = make_plan(block_table=table, q_positions=query, kv_positions=kv_positions, rope=rope)
        out = paged_attention(q[query], k_cache, v_cache, plan, scaling=D**-0.5, sliding_window=window)
        assert (out - expected[query]).abs().max().item() <= 1e-5
