"""Prefilling one chunk alone, at positions 0..L-1, straight into its canonical blocks."""

from __future__ import annotations

import torch

from pic.kv import BlockPool, KVCache, RequestKV, blocks_for
from pic.model import ModelRunner, SeqInput


def prefill_blocks(num_tokens: int, *, num_dropped: int, block_size: int) -> tuple[int, int]:
    """Blocks a chunk prefill takes: ``(canonical blocks kept, lead blocks freed afterwards)``."""
    return blocks_for(num_tokens - num_dropped, block_size), blocks_for(num_dropped, block_size)


def prefill_chunk(
    runner: ModelRunner, pool: BlockPool, cache: KVCache, token_ids: list[int], *, num_dropped: int = 0
) -> list[int]:
    """Run ``token_ids`` through the model as a prompt of its own, writing its KV into fresh blocks.

    The kept tokens fill their blocks front-padded (MEPIC's canonical layout: the last slots of the
    last block are the chunk's last tokens), so the blocks can be mapped into any linked request as
    they are. Dropped tokens (LegoLink-0's extra BOS tokens) run in lead blocks of their own, freed
    when the prefill is done.

    Args:
        token_ids: the full compile-time sequence (BOS tokens included).
        num_dropped: leading tokens whose KV is not kept.

    Returns:
        the canonical blocks, one reference each owned by the caller (``BlockPool.add_chunk`` them).

    Raises:
        KVPoolExhaustedError: the pool cannot hold the prefill (nothing is taken).
    """
    bs = cache.block_size
    num_kept = len(token_ids) - num_dropped
    num_canonical, num_lead = prefill_blocks(len(token_ids), num_dropped=num_dropped, block_size=bs)
    blocks = pool.allocate(num_lead + num_canonical)
    lead, canonical = blocks[:num_lead], blocks[num_lead:]
    try:
        device = runner.spec.device
        req = RequestKV(pool, cache, blocks, num_slots=len(blocks) * bs)
        kept_start = (num_lead + num_canonical) * bs - num_kept  # after the front padding
        slots = torch.cat(
            (torch.arange(num_lead * bs - num_dropped, num_lead * bs), torch.arange(kept_start, kept_start + num_kept))
        )
        ids = torch.tensor(token_ids, dtype=torch.long, device=device)
        positions = torch.arange(len(token_ids), device=device)
        runner.forward([SeqInput(kv=req, token_ids=ids, positions=positions, slots=slots.to(device))])
    except BaseException:
        pool.free(blocks)
        raise
    pool.free(lead)
    return canonical
