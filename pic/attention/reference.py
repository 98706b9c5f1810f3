"""Reference fused-RoPE paged attention in plain torch (CPU tests, and the fallback everywhere)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pic.attention.plan import BatchPlan
from pic.attention.rope import apply_rope

# Query rows per tile, so the [rows, num_slots] mask and scores stay bounded on long prompts.
_MAX_TILE_ELEMENTS = 1 << 24


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: BatchPlan,
    *,
    scaling: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attend the ``N`` query tokens of a batch over each one's sequence's paged NoPE KV, applying RoPE inside.

    Decoding sequences (one query token each) are attended as one padded batch; each recompute pass
    on its own (a loop over sequences, never a mask over the whole batch).

    Args:
        q: ``[N, num_q_heads, head_dim]``, NoPE queries (not yet rotated), model dtype.
        k_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, NoPE K of one layer.
        v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, V of one layer.
        plan: the batch's ``BatchPlan``; masks by logical position. Slots it marks ``-1`` never reach
            the output, whatever they hold.
        scaling: softmax scale (the model's ``self_attn.scaling``, usually ``head_dim ** -0.5``).
        sliding_window: attend only to keys with position > query position - window.

    Returns:
        ``[N, num_q_heads, head_dim]`` in the dtype of ``q``. GQA: query head ``h`` reads KV head
        ``h // (num_q_heads // num_kv_heads)``.
    """
    out = torch.empty_like(q)
    q_cos, q_sin, _, _ = plan.rotary(q.dtype)
    if plan.decode_seqs.numel():
        rows = plan.cu_seqlens_q[:-1].to(q.device)[plan.decode_seqs]  # [b] the decode tokens' rows
        seqs = plan.decode_seqs
        out[rows] = _attend(
            q[rows][:, None], q_cos[rows][:, None], q_sin[rows][:, None], seqs,
            k_cache, v_cache, plan, -1, scaling=scaling, sliding_window=sliding_window,
        )[:, 0]  # fmt: skip
    for b in plan.prefill_seqs:
        rows, seqs = plan.query_rows(b), torch.tensor([b], device=q.device)
        out[rows] = _attend(
            q[rows][None], q_cos[rows][None], q_sin[rows][None], seqs,
            k_cache, v_cache, plan, b, scaling=scaling, sliding_window=sliding_window,
        )[0]  # fmt: skip
    return out


def attention_weights(
    q: torch.Tensor, k_cache: torch.Tensor, plan: BatchPlan, seq: int, *, scaling: float, sliding_window: int | None
) -> torch.Tensor:
    """The softmax weights with which prefill sequence ``seq``'s query tokens attend over its slots, as
    ``paged_attention`` computes them: for analysis (``pic.evaluation.sinks``), not for serving.

    Args:
        q: ``[N, num_q_heads, head_dim]``, the batch's NoPE queries (``paged_attention``'s ``q``).
        k_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, NoPE K of one layer.
        seq: a sequence of ``plan.prefill_seqs``.

    Returns:
        ``[num_q_heads, n, S]`` float32: row ``i`` of head ``h`` is the attention of the sequence's ``i``-th
        query token over the ``S`` slots of its table (``plan.kv_positions[seq]`` gives their positions;
        unwritten and masked slots get 0).
    """
    rows, seqs = plan.query_rows(seq), torch.tensor([seq], device=q.device)
    q_cos, q_sin, _, _ = plan.rotary(q.dtype)
    q, k, _ = _operands(q[rows][None], q_cos[rows][None], q_sin[rows][None], seqs, k_cache, None, plan)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # [1, Hq, S, D]: query head h reads KV head h // group
    scores = (q.float() @ k.float().transpose(-1, -2)) * scaling  # [1, Hq, n, S]
    scores = scores.masked_fill(~plan.mask(seq, sliding_window)[:, None], float("-inf"))
    return scores.softmax(-1)[0]


def _operands(
    q: torch.Tensor,
    q_cos: torch.Tensor,
    q_sin: torch.Tensor,
    seqs: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    plan: BatchPlan,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Rotated ``q`` ``[b, Hq, n, D]``, the sequences' gathered and rotated K ``[b, Hkv, S, D]`` and V
    ``[b, Hkv, S, D]`` (``None`` without ``v_cache``), from ``q`` ``[b, n, Hq, D]`` and its tables ``[b, n, D]``."""
    # Slots never written for this sequence (padding, stale KV of a freed block, NaN included) are
    # zeroed, not just masked: a masked score still multiplies its V row (0 * NaN = NaN).
    written = (plan.kv_positions[seqs] >= 0)[..., None, None]  # [b, S, 1, 1]
    tables = plan.block_tables[seqs]  # [b, max_blocks]
    k = k_cache[tables].flatten(1, 2).where(written, 0)  # [b, S, Hkv, D]
    q = apply_rope(q, q_cos, q_sin).transpose(1, 2)  # [b, Hq, n, D]
    _, _, k_cos, k_sin = plan.rotary(q.dtype)
    k = apply_rope(k, k_cos[seqs], k_sin[seqs]).transpose(1, 2)  # [b, Hkv, S, D]
    if v_cache is None:
        return q, k, None
    v = v_cache[tables].flatten(1, 2).where(written, 0).transpose(1, 2)  # [b, Hkv, S, D]
    return q, k, v


def _attend(
    q: torch.Tensor,
    q_cos: torch.Tensor,
    q_sin: torch.Tensor,
    seqs: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: BatchPlan,
    group: int,
    *,
    scaling: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """``b`` sequences of ``n`` query tokens each: ``q`` ``[b, n, Hq, D]``, its tables ``[b, n, D]``;
    ``seqs`` ``[b]`` their batch indices. Returns ``[b, n, Hq, D]``."""
    q, k, v = _operands(q, q_cos, q_sin, seqs, k_cache, v_cache, plan)
    mask = plan.mask(group, sliding_window)  # [b, n, S]
    num_q, num_slots = mask.shape[1:]
    tile = max(1, _MAX_TILE_ELEMENTS // max(1, num_slots * q.shape[0] * q.shape[1]))
    out = torch.empty_like(q)
    for start in range(0, num_q, tile):
        rows = slice(start, start + tile)
        out[:, :, rows] = F.scaled_dot_product_attention(
            q[:, :, rows], k, v, attn_mask=mask[:, None, rows], scale=scaling, enable_gqa=True
        )
    return out.transpose(1, 2)
