"""Planning a linked request's block table: shared chunk blocks, copy-on-write, admission.

Every chunk segment of a layout covers whole blocks (front padding), block ``j`` of the segment
holding exactly what block ``j`` of the chunk's canonical copy holds. A block the request writes
nothing into is mapped as it is: the request's table names the chunk's physical block and takes a
reference, no copy. A block holding a token the request recomputes is *dirty*: the request gets a
private block with the canonical block's KV copied in, then the recompute pass overwrites the
recomputed tokens' slots. Prefix and query blocks are private (nothing is cached for them), and
so are decode blocks, appended later.

Here the plan is counted and the table laid out (pure functions); the pool work, admission first, is the KV
manager's (``KVManager.allocate``), the pool's one owner.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pic.kv import ChunkInfo, ChunkKV, KVCache, RequestKV, blocks_for
from pic.link.layout import Layout


@dataclass(frozen=True)
class Assembly:
    """A linked request's KV, ready for the recompute pass: ``req`` (the caller releases it), and ``source_rows``,
    ``[T]`` int64 on the cache's device: each prompt token's cache row in its chunk's canonical blocks (-1: prefix
    and query tokens). ``num_shared_blocks`` map a chunk's block without a copy; the request owns the others."""

    req: RequestKV
    source_rows: torch.Tensor
    num_shared_blocks: int
    num_private_blocks: int


@dataclass(frozen=True)
class AssemblyPlan:
    """What a linked request needs from the pool, counted before anything is taken (no tensors touched).

    Attributes:
        chunks: what ``ChunkSources.resolve`` found for the layout's chunks.
        chunk_blocks: request block -> (chunk segment index, block within the chunk), for every chunk block.
        shared: the chunk blocks mapped as they are (no recomputed token in them).
        to_promote: chunks to load from a lower tier into fresh canonical blocks.
        resident: resident chunks the request holds while it links, in prompt order.
        num_private: blocks the request owns (prefix, query, copy-on-write chunk blocks).
    """

    layout: Layout
    chunks: tuple[ChunkInfo | ChunkKV, ...]
    chunk_blocks: dict[int, tuple[int, int]]
    shared: dict[int, tuple[int, int]]
    to_promote: dict[str, ChunkKV]
    resident: tuple[str, ...]
    num_private: int
    num_promoted_blocks: int

    @property
    def num_blocks_needed(self) -> int:
        """Free or evictable blocks admission takes (besides the resident chunks it holds): private, promoted."""
        return self.num_private + self.num_promoted_blocks

    def describe(self) -> str:
        what = f"a linked prompt of {self.layout.num_tokens} tokens ({self.num_private} private blocks"
        n = len(self.to_promote)
        return what + (f", {n} chunks promoted into {self.num_promoted_blocks} blocks)" if n else ")")


def plan_assembly(
    layout: Layout, chunks: Sequence[ChunkInfo | ChunkKV], dirty: torch.Tensor, *, is_resident: Callable[[str], bool]
) -> AssemblyPlan:
    """Count what the KV manager will take (the module docstring). ``chunks``: what ``ChunkSources.resolve``
    found for each chunk segment of ``layout``, in order (a resident one must still be resident). ``dirty``:
    ``[T]`` bool (CPU), tokens whose KV the request writes: the blocks holding a dirty chunk token are private
    copies (all True: every request its own copy of everything)."""
    num_blocks = blocks_for(layout.num_slots, layout.block_size)
    chunk_blocks = _chunk_blocks(layout)
    dirty_blocks = set((layout.slots[dirty & layout.cached] // layout.block_size).tolist())
    shared = {i: where for i, where in chunk_blocks.items() if i not in dirty_blocks}
    to_promote = {c.cache_id: c for c in chunks if isinstance(c, ChunkKV) and not is_resident(c.cache_id)}
    resident = tuple(cid for cid in dict.fromkeys(c.cache_id for c in chunks) if cid not in to_promote)
    return AssemblyPlan(
        layout=layout,
        chunks=tuple(chunks),
        chunk_blocks=chunk_blocks,
        shared=shared,
        to_promote=to_promote,
        resident=resident,
        num_private=num_blocks - len(shared),
        num_promoted_blocks=sum(blocks_for(c.num_tokens, layout.block_size) for c in to_promote.values()),
    )


def block_table(
    num_blocks: int,
    shared: dict[int, tuple[int, int]],
    chunk_blocks: dict[int, tuple[int, int]],
    canonical: list[list[int]],
    private: list[int],
) -> tuple[list[int], list[tuple[int, int]]]:
    """The block table, and the (canonical, private) block pairs to copy for dirty chunk blocks."""
    table, copies, fresh = [], [], iter(private)
    for i in range(num_blocks):
        if i in shared:
            seg, j = shared[i]
            table.append(canonical[seg][j])
            continue
        table.append(next(fresh))
        if i in chunk_blocks:
            seg, j = chunk_blocks[i]
            copies.append((canonical[seg][j], table[-1]))
    return table, copies


def _chunk_blocks(layout: Layout) -> dict[int, tuple[int, int]]:
    bs = layout.block_size
    return {
        (seg.slot_start - seg.num_padding) // bs + j: (index, j)
        for index, seg in enumerate(layout.chunks)
        for j in range((seg.num_padding + seg.num_tokens) // bs)
    }


def source_rows(layout: Layout, canonical: list[list[int]], cache: KVCache) -> torch.Tensor:
    rows = torch.full((layout.num_tokens,), -1, dtype=torch.long, device=cache.device)
    for seg, blocks in zip(layout.chunks, canonical, strict=True):
        rows[seg.tokens] = cache.rows(blocks, seg.num_tokens)
    return rows
