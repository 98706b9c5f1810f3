"""Attention scores of a few query rows over one sequence's KV, in plain torch, whatever backend attends.

A query-aware policy reads where the query looks: ProphetKV's probe (the query's attention over the linked
chunks, every layer) and A³'s scores at one layer. Neither kernel returns attention weights (SDPA and the
Triton kernel keep them on chip), so they are recomputed here for the rows asked, from the same NoPE
queries and the same paged NoPE K, rotated at the same logical positions, under the same masks (exact
causality by position, the layer's sliding window): ``softmax(scores)`` over a row's allowed slots is the
attention the backend computed for it, to float32 rounding. The cost is ``rows x slots x heads`` per layer,
small beside the layer itself for a query of tens of tokens.
"""

from __future__ import annotations

import torch

from pic.attention.rope import RopeTable, apply_rope


def query_scores(
    q: torch.Tensor,
    q_positions: torch.Tensor,
    k: torch.Tensor,
    k_positions: torch.Tensor,
    *,
    rope: RopeTable,
    scaling: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Scaled dot products of query rows with keys, both rotated at their positions, masked by position.

    Args:
        q: ``[n, num_q_heads, head_dim]`` NoPE queries (the layer's, before RoPE).
        q_positions: ``[n]`` int64 logical positions of the rows.
        k: ``[S, num_kv_heads, head_dim]`` NoPE keys (gathered from the cache).
        k_positions: ``[S]`` int64 logical positions of the keys (``-1``: not a key, masked).
        rope: the engine's rotary table.
        scaling: the softmax scale (``self_attn.scaling``).
        sliding_window: the layer's window (``None``: none).

    Returns:
        ``[num_q_heads, n, S]`` float32: ``scaling * <rot(q), rot(k)>``, ``-inf`` where the row may not attend
        the key (a later position, outside the window, or no key). GQA: query head ``h`` reads KV head
        ``h // (num_q_heads // num_kv_heads)``.
    """
    positions = torch.cat((q_positions, k_positions.clamp(min=0)))
    cos, sin = rope(positions)  # [n + S, head_dim] in the model dtype (one call: dynamic rope types need both)
    n = q.shape[0]
    q_rot = apply_rope(q[None], cos[None, :n], sin[None, :n])[0].float()  # [n, Hq, D]
    k_rot = apply_rope(k[None], cos[None, n:], sin[None, n:])[0].float()  # [S, Hkv, D]
    group = q.shape[1] // k.shape[1]
    k_rot = k_rot.repeat_interleave(group, dim=1)  # [S, Hq, D]
    scores = torch.einsum("nhd,shd->hns", q_rot, k_rot) * scaling  # [Hq, n, S]
    allowed = (k_positions[None, :] >= 0) & (k_positions[None, :] <= q_positions[:, None])  # [n, S]
    if sliding_window is not None:
        allowed &= k_positions[None, :] > q_positions[:, None] - sliding_window
    return scores.masked_fill(~allowed[None], float("-inf"))
