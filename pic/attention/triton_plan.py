"""The Triton backend's plan: a forward's batch as the kernels read it, built once and shared by every layer.

Besides the int32 copies of the batch, the plan builds each query tile's *work list*: the KV tiles
(``block_n`` slots) holding a slot some row of the tile may attend, in slot order. A tile is visited when
its earliest written position is at or before the tile's latest query position and, under a sliding
window, its latest position is inside the window of the tile's earliest query. Deciding this here, with
a few tensor ops per forward, takes the branch out of the kernel's KV loop (it pipelines) and keeps the
skipping exact for any order of positions over slots (a linked request's are not sorted).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from pic.attention.batch import AttentionBatch

_NO_POSITION = torch.iinfo(torch.int32).max
# Flash-decoding: a split takes at least this many KV tiles (fewer would cost more to combine than to run).
MIN_TILES_PER_SPLIT = 4
MAX_SPLITS = 64


@dataclass(frozen=True)
class TritonWork:
    """Which KV tiles each query tile visits, for one sliding window.

    Attributes:
        ids: ``[T, W]`` int32, per query tile its KV tiles to visit in slot order, first ``lens[t]`` of them.
        lens: ``[T]`` int32.
        chunk: ``[T]`` int32, KV tiles per split: tile ``t`` runs ``cdiv(lens[t], chunk[t])`` splits.
        max_splits: splits launched per tile (grid axis 2); programs past a tile's own count store nothing.
    """

    ids: torch.Tensor
    lens: torch.Tensor
    chunk: torch.Tensor
    max_splits: int


@dataclass(frozen=True)
class Launch:
    """A launch configuration of ``paged_attention_kernel`` (one compiled variant per sliding-window kind).

    Attributes:
        block_m: rows (query tokens x GQA heads) per program.
        block_n: slots per KV tile (a power of two, at least 16).
        num_warps: warps per program.
        split: flash-decoding partials, merged by ``combine_splits_kernel``.
        num_stages: KV tiles in flight in the software pipeline (async copies issued ahead).
        max_registers: per thread (PTX ``.maxnreg``; ``None``: ptxas chooses).
        rotate_k: rotate K as it is read (``False``: the cache holds it rotated; benchmarks only).
    """

    block_m: int
    block_n: int
    num_warps: int
    split: bool
    num_stages: int = 3
    max_registers: int | None = None
    rotate_k: bool = True


@dataclass(frozen=True)
class TritonTiles:
    """One launch's query tiles of ``launch.block_m`` rows.

    Attributes:
        seq: ``[T]`` int32, the sequence of each tile.
        row: ``[T]`` int32, the tile's first query row in the batch.
        launch: how the tiles are launched.
        work: per sliding window of the model (``None``: none), the tiles' work lists.
    """

    seq: torch.Tensor
    row: torch.Tensor
    launch: Launch
    work: dict[int | None, TritonWork]

    @property
    def num_tiles(self) -> int:
        return self.seq.shape[0]


@dataclass(frozen=True)
class TritonPlan:
    """The Triton backend's plan of one forward.

    Attributes:
        cos, sin: ``[R, head_dim // 2]`` in the model's dtype, one half of the rotary table (the halves are equal).
        rope_off: ``[B]`` int32 rotary-table row of each sequence's position 0.
        cu_q: ``[B + 1]`` int32, ``batch.cu_seqlens_q``.
        q_pos: ``[N]`` int32 query positions.
        tables: ``[B, S // page]`` int32 block tables, padded with block 0.
        kv_pos: ``[B, S]`` int32 slot positions, ``-1``: never attended; ``S`` a multiple of each launch's ``block_n``.
        decode, prefill: the tiles of the decode launch (one query token per sequence) and of the recompute passes.
        split_acc: ``[T_decode * Hkv * max_splits * block_m * D_PAD]`` float32 partial accumulators of a split
            decode launch (``None`` without splits); ``split_ml``: ``[T_decode * Hkv * max_splits * 2 * block_m]``
            float32, their running maxima and sums.
    """

    cos: torch.Tensor
    sin: torch.Tensor
    rope_off: torch.Tensor
    cu_q: torch.Tensor
    q_pos: torch.Tensor
    tables: torch.Tensor
    kv_pos: torch.Tensor
    decode: TritonTiles
    prefill: TritonTiles
    split_acc: torch.Tensor | None
    split_ml: torch.Tensor | None


def padded_slots(batch: AttentionBatch, *, block_n: int, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_pos [B, S]`` and ``tables [B, S // page]`` int32, padded (``-1``, block 0) so that ``S`` is a
    multiple of ``block_n`` and of ``page``: the kernel then loads every tile's positions and blocks unmasked."""
    num_seqs, num_slots = batch.kv_positions.shape
    step = math.lcm(block_n, page)
    padded = triton.cdiv(max(num_slots, 1), step) * step
    kv_pos = torch.full((num_seqs, padded), -1, dtype=torch.int32, device=batch.kv_positions.device)
    kv_pos[:, :num_slots] = batch.kv_positions
    tables = torch.zeros((num_seqs, padded // page), dtype=torch.int32, device=batch.block_tables.device)
    tables[:, : batch.block_tables.shape[1]] = batch.block_tables
    return kv_pos, tables


def tile_spans(kv_pos: torch.Tensor, *, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence and KV tile, the earliest written position (int32 max: none) and the latest (-1: none);
    ``kv_pos [B, S]`` -> two ``[B, S // block_n]``."""
    pos = kv_pos.view(kv_pos.shape[0], -1, block_n)
    first = torch.where(pos >= 0, pos, _NO_POSITION).amin(-1)
    return first, pos.amax(-1)


def query_tiles(batch: AttentionBatch, *, decode: bool, per_tile: int) -> tuple[list[int], list[int]]:
    """Sequence and first row of each tile of ``per_tile`` query tokens, over the decode (one token) or the
    prefill sequences; from ``cu_seqlens_q``, which lives on the host: no device sync."""
    cu = batch.cu_seqlens_q.tolist()
    seqs, rows = [], []
    for b in range(len(cu) - 1):
        if (cu[b + 1] - cu[b] == 1) != decode:
            continue
        for start in range(cu[b], cu[b + 1], per_tile):
            seqs.append(b)
            rows.append(start)
    return seqs, rows


def make_tiles(
    batch: AttentionBatch,
    launch: Launch,
    *,
    decode: bool,
    group: int,
    cu_q: torch.Tensor,
    q_pos: torch.Tensor,
    kv_pos: torch.Tensor,
    windows: set[int | None],
    max_splits: int,
    min_chunk: int = MIN_TILES_PER_SPLIT,
) -> TritonTiles:
    """The decode (one token) or the prefill sequences' query tiles for ``launch``, with their work lists
    for each of the model's ``windows``; ``cu_q`` and ``q_pos`` as in ``work_lists``, ``kv_pos`` as in the plan."""
    spans = tile_spans(kv_pos, block_n=launch.block_n)
    per_tile = launch.block_m // group
    seqs, rows = query_tiles(batch, decode=decode, per_tile=per_tile)
    device = q_pos.device
    seq = torch.tensor(seqs, dtype=torch.int32).to(device, non_blocking=True)
    row = torch.tensor(rows, dtype=torch.int32).to(device, non_blocking=True)
    work = {
        w: work_lists(
            seq,
            row,
            per_tile=per_tile,
            cu_q=cu_q,
            q_pos=q_pos,
            spans=spans,
            window=w,
            max_splits=max_splits,
            min_chunk=min_chunk,
        )
        for w in windows
    }
    return TritonTiles(seq=seq, row=row, launch=launch, work=work)


def work_lists(
    seq: torch.Tensor,
    row: torch.Tensor,
    *,
    per_tile: int,
    cu_q: torch.Tensor,
    q_pos: torch.Tensor,
    spans: tuple[torch.Tensor, torch.Tensor],
    window: int | None,
    max_splits: int,
    min_chunk: int = MIN_TILES_PER_SPLIT,
) -> TritonWork:
    """The KV tiles each query tile (``seq``, ``row``: ``[T]`` int32, of ``per_tile`` query tokens) visits
    under ``window``, and its splits. ``cu_q``: ``[B + 1]`` int32 query rows per sequence; ``q_pos``: ``[N]``
    int32 query positions; ``spans``: ``tile_spans`` of the batch's slots; a split takes at least ``min_chunk``
    KV tiles."""
    first, last = spans
    rows = row[:, None].long() + torch.arange(per_tile, device=row.device)  # [T, per_tile]
    ok = rows < cu_q[seq.long() + 1][:, None]
    pos = q_pos[rows.clamp(max=q_pos.shape[0] - 1)]
    q_max = torch.where(ok, pos, -1).amax(1)
    live = first[seq.long()] <= q_max[:, None]  # [T, num_kv_tiles]
    if window is not None:
        q_min = torch.where(ok, pos, _NO_POSITION).amin(1)
        live &= last[seq.long()] > (q_min - window)[:, None]
    lens = live.sum(1, dtype=torch.int32)
    ids = torch.argsort((~live).to(torch.uint8), dim=1, stable=True).to(torch.int32)  # visited first, in order
    chunk = torch.clamp(triton.cdiv(lens, max_splits), min=min_chunk).to(torch.int32)
    return TritonWork(ids=ids, lens=lens, chunk=chunk, max_splits=max_splits)


def split_limit(*, num_programs: int, num_kv_tiles: int, resident: int) -> int:
    """Flash-decoding splits per tile for a decode launch of ``num_programs`` (tile, KV head) programs over at
    most ``num_kv_tiles`` KV tiles each, when ``resident`` programs fit on the GPU at once: as many as fill
    one wave without starting a second (a partial wave costs as much as a full one), and none shorter than
    ``MIN_TILES_PER_SPLIT`` tiles."""
    if num_programs == 0 or num_programs * 2 > resident:
        return 1
    return max(1, min(resident // num_programs, num_kv_tiles // MIN_TILES_PER_SPLIT, MAX_SPLITS))


def warmup_batch(*, page: int, head_dim: int, device: torch.device) -> AttentionBatch:
    """A batch of one decoding sequence and one two-token recompute pass, each over one block (block 0): what
    ``TritonBackend.precompile`` plans to compile every launch with the argument layout of real ones."""
    kv_positions = torch.full((2, page), -1, dtype=torch.long, device=device)
    kv_positions[0, :1], kv_positions[1, :2] = torch.arange(1), torch.arange(2)
    table = torch.zeros(2, head_dim, device=device)
    return AttentionBatch(
        cu_seqlens_q=torch.tensor([0, 1, 3]),
        q_positions=torch.tensor([0, 0, 1], device=device),
        block_tables=torch.zeros(2, 1, dtype=torch.long, device=device),
        kv_positions=kv_positions,
        rope_cos=table,
        rope_sin=table.clone(),
        rope_offsets=torch.zeros(2, dtype=torch.long, device=device),
        decode_seqs=torch.tensor([0], device=device),
        prefill_seqs=[1],
    )
