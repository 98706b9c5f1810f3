"""The recompute pass: cached chunk KV in, selected tokens run fresh, first-token logits out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pic.kv import ChunkKV, KVPool, RequestKV
from pic.link.layout import Layout
from pic.model import ModelRunner


@dataclass
class Recomputed:
    """A linked request ready to decode.

    Attributes:
        req: the request's KV (caller releases it).
        logits: ``[num_query_tokens, vocab_size]`` float32, next-token logits at each query position.
    """

    req: RequestKV
    logits: torch.Tensor


def recompute(
    runner: ModelRunner, pool: KVPool, layout: Layout, chunks: Sequence[ChunkKV], selected: torch.Tensor
) -> Recomputed:
    """Lay cached KV into a new request and run the selected tokens through every layer.

    Args:
        layout: the linked prompt's layout.
        chunks: the chunks of ``layout.chunks``, in order.
        selected: ``[T]`` bool, tokens to recompute; must include every uncached token.

    Raises:
        KVPoolExhaustedError: the pool cannot hold the request (nothing is allocated then).
    """
    assert bool((selected | layout.cached).all()), "uncached tokens must be recomputed"
    device = runner.spec.device
    req = RequestKV(pool, layout.num_slots)
    try:
        slots, positions = layout.slots.to(device), layout.positions.to(device)
        req.kv_positions[slots] = positions
        for seg, chunk in zip(layout.chunks, chunks, strict=True):
            keep = ~selected[seg.tokens].to(device)  # cached tokens whose KV is reused
            rows = req.physical(slots[seg.tokens][keep])
            pool.k_rows[:, rows] = chunk.k[:, keep]
            pool.v_rows[:, rows] = chunk.v[:, keep]
        index = selected.nonzero().squeeze(1).to(device)
        num_query = layout.query.num_tokens
        logits = runner.forward(
            req,
            token_ids=layout.token_ids.to(device)[index],
            positions=positions[index],
            slots=slots[index],
            logits_rows=torch.arange(index.shape[0] - num_query, index.shape[0], device=device),
        )
    except BaseException:
        req.release()
        raise
    return Recomputed(req=req, logits=logits)
