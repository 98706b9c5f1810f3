"""Reference fused-RoPE paged attention in plain torch (CPU tests, and the fallback everywhere)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pic.attention.plan import AttentionPlan
from pic.attention.rope import apply_rope

# Query rows per tile, so the [rows, num_slots] mask and scores stay bounded on long prompts.
_MAX_TILE_ELEMENTS = 1 << 24


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    *,
    scaling: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attend ``N`` query tokens over one request's paged NoPE KV, applying RoPE inside.

    Args:
        q: ``[N, num_q_heads, head_dim]``, NoPE queries (not yet rotated), model dtype.
        k_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, NoPE K of one layer.
        v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, V of one layer.
        plan: the request's ``AttentionPlan``; masks by logical position. Slots it marks unwritten
            (``kv_positions == -1``) never reach the output, whatever they hold.
        scaling: softmax scale (the model's ``self_attn.scaling``, usually ``head_dim ** -0.5``).
        sliding_window: attend only to keys with position > query position - window.

    Returns:
        ``[N, num_q_heads, head_dim]`` in the dtype of ``q``. GQA: query head ``h`` reads KV head
        ``h // (num_q_heads // num_kv_heads)``.
    """
    # Slots never written for this request (padding, stale KV of a freed block, NaN included) are
    # zeroed, not just masked: a masked score still multiplies its V row (0 * NaN = NaN).
    written = plan.written[:, None, None]  # [S, 1, 1]
    k = k_cache[plan.block_table].flatten(0, 1).where(written, 0)  # [S, Hkv, D]
    v = v_cache[plan.block_table].flatten(0, 1).where(written, 0)  # [S, Hkv, D]
    q = apply_rope(q, plan.q_cos, plan.q_sin).transpose(0, 1)  # [Hq, N, D]
    k = apply_rope(k, plan.k_cos, plan.k_sin).transpose(0, 1)  # [Hkv, S, D]
    v = v.transpose(0, 1)  # [Hkv, S, D]
    mask = plan.mask(sliding_window)  # [N, S]
    num_q, num_slots = mask.shape
    tile = max(1, _MAX_TILE_ELEMENTS // max(1, num_slots * q.shape[0]))
    out = torch.empty_like(q)
    for start in range(0, num_q, tile):
        rows = slice(start, start + tile)
        out[:, rows] = F.scaled_dot_product_attention(
            q[None, :, rows], k[None], v[None], attn_mask=mask[None, None, rows], scale=scaling, enable_gqa=True
        )[0]
    return out.transpose(0, 1)
