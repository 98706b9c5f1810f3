"""Compiling a batch of new chunks into the pool, and through to the lower store tiers.

The compiler knows the store only as a ``WriteThrough`` (two calls), so compile sits below the store:
the engine hands it the pool it allocates from, the KV tensors it writes, and the store (a
``TieredStore``) that takes each new chunk.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Protocol

import torch
from tqdm.auto import tqdm

from pic.compile.prefill import prefill_blocks, prefill_chunk
from pic.config import CompileOptions
from pic.kv import BlockPool, ChunkInfo, KVCache
from pic.model import ModelRunner


class WriteThrough(Protocol):
    """Where a compiled chunk goes: resident in the pool, and copied down to the lower tiers."""

    def lower_can_fit(self, num_bytes: int, *, keep: Collection[str] = ()) -> bool:
        """Whether a lower tier can take ``num_bytes`` more without evicting pinned chunks or ``keep``."""

    def add(self, info: ChunkInfo, block_ids: list[int], *, keep: Collection[str] = ()) -> bool:
        """Make the prefilled ``block_ids`` resident as ``info``'s chunk and write it through; whether a
        lower tier holds it too."""


def lead_tokens(options: CompileOptions, bos_token_id: int | None) -> list[int]:
    """What a chunk's content is prefilled after: the extra BOS tokens and the context (both dropped from
    the cached KV), then the chunk's own BOS (kept). No BOS at all when the model has none."""
    bos = [] if bos_token_id is None else [bos_token_id]
    return bos * options.num_extra_bos + list(options.context) + bos * options.add_bos


def compile_chunks(
    runner: ModelRunner,
    todo: Mapping[str, list[int]],
    *,
    pool: BlockPool,
    cache: KVCache,
    store: WriteThrough,
    options: CompileOptions,
    bos_token_id: int | None,
    keep: Sequence[str],
    progress: bool,
) -> None:
    """Prefill each new chunk into canonical blocks of the pool and write it through to the lower tiers.

    Every id of the call (``keep``) is held by some tier when this returns: the call's resident
    chunks are held in the pool while it runs, and a new chunk stays held too unless a lower tier
    took it. Room is checked before any prefill.

    Args:
        todo: cache id -> content tokens of the chunks no tier holds.
        pool, cache: the KV pool the chunks are prefilled into, and its tensors.
        store: takes each new chunk (``TieredStore``).
        keep: every cache id the ``compile`` call returns.

    Raises:
        KVPoolExhaustedError: the new chunks do not fit in the pool beside the chunks in use (nothing
            is prefilled then).
        StoreUnavailableError: Redis failed (``on_redis_error="raise"``).
    """
    lead = lead_tokens(options, bos_token_id)  # prefilled before every chunk's content
    num_dropped = options.num_dropped
    sizes = [
        prefill_blocks(len(lead) + len(t), num_dropped=num_dropped, block_size=cache.block_size) for t in todo.values()
    ]
    num_bytes = sum(len(t) + options.add_bos for t in todo.values()) * runner.spec.kv_bytes_per_token
    hold_new = not store.lower_can_fit(num_bytes, keep=keep)  # the pool keeps the only copy: hold them all
    num_needed = (sum(c for c, _ in sizes) if hold_new else max(c for c, _ in sizes)) + max(lead for _, lead in sizes)
    resident = [cid for cid in dict.fromkeys(keep) if pool.is_resident(cid)]
    pool.check_available(num_needed, holding=resident, what=f"the {len(todo)} new chunks of this compile call")
    held = [b for cid in resident for b in pool.hold(cid)]
    try:
        for cid, tokens in tqdm(todo.items(), desc="pic compile", unit="chunk", disable=not progress):
            blocks = prefill_chunk(runner, pool, cache, lead + tokens, num_dropped=num_dropped)
            kept = torch.tensor((lead + tokens)[num_dropped:], dtype=torch.long)
            info = ChunkInfo(cache_id=cid, token_ids=kept, options=options)
            stored_below = store.add(info, blocks, keep=keep)
            if hold_new or not stored_below:
                held += blocks
            else:
                pool.free(blocks)
    finally:
        pool.free(held)
