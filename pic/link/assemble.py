"""Planning a linked request's block table: shared chunk blocks, copy-on-write, admission.

Every chunk segment of a layout covers whole blocks (front padding), block ``j`` of the segment
holding exactly what block ``j`` of the chunk's canonical copy holds. A block the request writes
nothing into is mapped as it is: the request's table names the chunk's physical block and takes a
reference, no copy. A block holding a token the request recomputes is *dirty*: the request gets a
private block with the canonical block's KV copied in, then the recompute pass overwrites the
recomputed tokens' slots; a dirty block every chunk token of which the pass rewrites in every layer
(a static policy's document recomputed whole) is not copied: nothing reads a slot before its token is
written (``KVCache``), so the copy would only be overwritten. Prefix and query blocks are private (nothing is
cached for them), and so are decode blocks, appended later.

Here the plan is counted and the table laid out (pure functions); the pool work, admission first, is the KV
manager's (``KVManager.allocate``), the pool's one owner.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pic.kv import ChunkInfo, ChunkKV, KVCache, RequestKV, blocks_for
from pic.kv.transfer import to_device
from pic.link.layout import Layout


@dataclass(frozen=True)
class Assembly:
    """A linked request's KV, ready for the recompute pass: ``req`` (the caller releases it), and ``canonical``, each
    chunk's canonical blocks in prompt order (int64 arrays, read by ``source_rows``). ``num_shared_blocks`` map a
    chunk's block without a copy; the request owns the others."""

    req: RequestKV
    layout: Layout
    canonical: list[np.ndarray]
    num_shared_blocks: int
    num_private_blocks: int

    @functools.cached_property
    def source_rows(self) -> torch.Tensor:
        """``[T]`` int64 on the cache's device: each prompt token's cache row in its chunk's canonical blocks (-1:
        prefix and query tokens). Made on first use: only a policy that reads the chunks' KV as compiled does (a
        dynamic one's layer steps), and a 32K link has 2,048 blocks of it."""
        return source_rows(self.layout, self.canonical, self.req.cache)


@dataclass(frozen=True)
class ChunkBlocks:
    """The chunk blocks of a layout's table, in prompt order (every chunk segment's blocks, first to last):
    ``index``, ``[n]`` int64 (CPU), each one's request block; ``sizes``, each chunk segment's number of blocks
    (``sum(sizes) == n``). Tensors, not a dict per block: a 32K-token link has 2,048 of them."""

    index: torch.Tensor
    sizes: tuple[int, ...]

    def __len__(self) -> int:
        return self.index.shape[0]


@dataclass(frozen=True)
class AssemblyPlan:
    """What a linked request needs from the pool, counted before anything is taken (no tensors touched).

    Attributes:
        chunks: what ``ChunkSources.fetch`` found for the layout's chunks.
        chunk_blocks: the request blocks of every chunk block (``ChunkBlocks``).
        shared: the request blocks (indices into its table, increasing, int64) mapped as they are: chunk blocks with
            no recomputed token in them.
        rewritten: the request blocks (increasing, int64) whose every chunk token the pass rewrites in every layer:
            private, and no canonical KV copied in.
        to_promote: chunks to load from a lower tier into fresh canonical blocks.
        resident: resident chunks the request holds while it links, in prompt order.
        num_private: blocks the request owns (prefix, query, copy-on-write chunk blocks).
    """

    layout: Layout
    chunks: tuple[ChunkInfo | ChunkKV, ...]
    chunk_blocks: ChunkBlocks
    shared: np.ndarray
    rewritten: np.ndarray
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
    layout: Layout,
    chunks: Sequence[ChunkInfo | ChunkKV],
    dirty: torch.Tensor,
    *,
    rewritten: torch.Tensor | None = None,
    is_resident: Callable[[str], bool],
) -> AssemblyPlan:
    """Count what the KV manager will take (the module docstring). ``chunks``: what ``ChunkSources.fetch``
    found for each chunk segment of ``layout``, in order (a resident one must still be resident). ``dirty``:
    ``[T]`` bool (CPU), tokens whose KV the request writes: the blocks holding a dirty chunk token are private
    copies (all True: every request its own copy of everything). ``rewritten``: ``[T]`` bool (CPU), the dirty
    tokens the pass writes in every layer before anything reads their slots (a static policy's selection; ``None``:
    none known, as for a dynamic policy, which drops tokens layer by layer): a private block of nothing else takes
    no copy. Per chunk and in tensors, not per block."""
    num_blocks, bs = blocks_for(layout.num_slots, layout.block_size), layout.block_size
    chunk_blocks = _chunk_blocks(layout)
    clean = torch.zeros(num_blocks, dtype=torch.bool)
    clean[chunk_blocks.index] = True
    clean[layout.slots[dirty & layout.cached] // bs] = False
    shared = clean.nonzero().squeeze(1).numpy()
    if rewritten is None:
        whole = np.empty(0, dtype=np.int64)
    else:  # chunk blocks whose chunk tokens are all rewritten (a block's count of them equal to its count of any)
        tokens = torch.bincount(layout.slots[layout.cached] // bs, minlength=num_blocks)
        written = torch.bincount(layout.slots[rewritten & dirty & layout.cached] // bs, minlength=num_blocks)
        whole = ((tokens > 0) & (written == tokens)).nonzero().squeeze(1).numpy()
    to_promote = {c.cache_id: c for c in chunks if isinstance(c, ChunkKV) and not is_resident(c.cache_id)}
    resident = tuple(cid for cid in dict.fromkeys(c.cache_id for c in chunks) if cid not in to_promote)
    return AssemblyPlan(
        layout=layout,
        chunks=tuple(chunks),
        chunk_blocks=chunk_blocks,
        shared=shared,
        rewritten=whole,
        to_promote=to_promote,
        resident=resident,
        num_private=num_blocks - len(shared),
        num_promoted_blocks=sum(blocks_for(c.num_tokens, layout.block_size) for c in to_promote.values()),
    )


def block_table(
    num_blocks: int,
    shared: np.ndarray,
    chunk_blocks: ChunkBlocks,
    canonical: list[np.ndarray],
    private: list[int],
    rewritten: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The block table (int64), and the canonical and the private blocks of the copies dirty chunk blocks take: the
    ``shared`` request blocks name their chunk's canonical block, the others take the ``private`` blocks in table
    order, and a chunk block among those copies its canonical block in, unless it is ``rewritten`` (request blocks
    the pass rewrites whole). ``canonical``: each chunk segment's blocks."""
    table = np.full(num_blocks, -1, dtype=np.int64)
    table[chunk_blocks.index.numpy()] = _flat(canonical, chunk_blocks)
    is_private = np.ones(num_blocks, dtype=bool)
    is_private[shared] = False
    is_copied = table >= 0  # a private chunk block copies its canonical block in, unless the pass rewrites it whole
    is_copied[rewritten] = False
    source, copied = table[is_private], is_copied[is_private]  # (source -1: prefix, query)
    fresh = np.array(private, dtype=np.int64)
    assert fresh.shape == source.shape, (len(private), source.shape)
    table[is_private] = fresh
    return table, source[copied], fresh[copied]


def _chunk_blocks(layout: Layout) -> ChunkBlocks:
    bs = layout.block_size
    firsts = [(seg.slot_start - seg.num_padding) // bs for seg in layout.chunks]
    sizes = [(seg.num_padding + seg.num_tokens) // bs for seg in layout.chunks]
    counts = torch.tensor(sizes, dtype=torch.long)
    total = sum(sizes)
    starts = torch.tensor(firsts, dtype=torch.long) - (counts.cumsum(0) - counts)  # first block, less those before
    index = torch.arange(total) + starts.repeat_interleave(counts, output_size=total)
    return ChunkBlocks(index, tuple(sizes))


def _flat(canonical: list[np.ndarray], chunk_blocks: ChunkBlocks) -> np.ndarray:
    """``[n]`` int64, every chunk segment's canonical blocks in ``chunk_blocks``' order."""
    assert tuple(map(len, canonical)) == chunk_blocks.sizes, (tuple(map(len, canonical)), chunk_blocks.sizes)
    return np.concatenate(canonical) if canonical else np.empty(0, dtype=np.int64)


def source_rows(layout: Layout, canonical: list[np.ndarray], cache: KVCache) -> torch.Tensor:
    """``[T]`` int64 on the cache's device: each prompt token's row in its chunk's canonical blocks (-1: prefix and
    query): a table of every request slot's canonical row, built per block, read at the tokens' slots."""
    bs = layout.block_size
    chunk_blocks = _chunk_blocks(layout)
    rows = torch.full((blocks_for(layout.num_slots, bs), bs), -1, dtype=torch.long)  # [num_blocks, block_size]
    flat = torch.from_numpy(_flat(canonical, chunk_blocks))
    rows.index_copy_(0, chunk_blocks.index, flat[:, None] * bs + torch.arange(bs))
    return to_device(rows.view(-1).index_select(0, layout.slots), cache.device)
