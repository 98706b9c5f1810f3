"""Prefilling one chunk alone, at positions 0..L-1, and keeping its NoPE K and V."""

from __future__ import annotations

import torch

from pic.kv import KVPool, RequestKV
from pic.model import ModelRunner


def prefill_chunk(
    runner: ModelRunner, pool: KVPool, token_ids: list[int], *, num_dropped: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``token_ids`` through the model as a prompt of its own and return its KV.

    Args:
        token_ids: the full compile-time sequence (BOS tokens included).
        num_dropped: leading tokens whose KV is not kept (LegoLink-0's extra BOS tokens).

    Returns:
        k, v: ``[num_layers, len(token_ids) - num_dropped, num_kv_heads, head_dim]``, model dtype,
        on the model's device; K before RoPE.
    """
    num_tokens = len(token_ids)
    device = runner.spec.device
    req = RequestKV(pool, num_tokens)
    try:
        positions = torch.arange(num_tokens, device=device)
        ids = torch.tensor(token_ids, dtype=torch.long, device=device)
        runner.forward(req, token_ids=ids, positions=positions, slots=positions)
        rows = req.physical(positions[num_dropped:])
        return pool.k_rows[:, rows].clone(), pool.v_rows[:, rows].clone()
    finally:
        req.release()
