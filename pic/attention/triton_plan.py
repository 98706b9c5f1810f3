"""The Triton backend's plan: a forward's batch as the kernels read it, built once and shared by every layer.

Besides the int32 copies of the batch, the plan builds each query tile's *work list*: the KV tiles
(``block_n`` slots) holding a slot some row of the tile may attend. A tile is visited when its earliest
written position is at or before the tile's latest query position and, under a sliding window, its latest
position is inside the window of the tile's earliest query. The list holds first the *whole* tiles, which
every row of the query tile attends in full (every slot written, at or before the earliest query, inside
the latest query's window), then the others, each part in slot order: the kernel runs the whole ones
without a mask. Deciding this here, with a few tensor ops per forward, takes the branch out of the
kernel's KV loops (they pipeline) and keeps the skipping exact for any order of positions over slots (a
linked request's are not sorted).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import triton

from pic.attention.backend import SCRATCH_FIELD
from pic.attention.batch import AttentionBatch
from pic.attention.triton_split import MIN_TILES_PER_SPLIT, SplitScratch

_NO_POSITION = torch.iinfo(torch.int32).max


@dataclass(frozen=True)
class TritonWork:
    """Which KV tiles each query tile visits, for one sliding window.

    Attributes:
        ids: ``[T, W]`` int32, per query tile its KV tiles to visit, first ``lens[t]`` of them: its ``whole[t]``
            whole tiles (attended in full by every row), then the rest, each part in slot order.
        lens: ``[T]`` int32.
        whole: ``[T]`` int32, the whole tiles leading each list (the kernel reads them without a mask).
        chunk: ``[T]`` int32, KV tiles per split: tile ``t`` runs ``cdiv(lens[t], chunk[t])`` splits.
        max_splits: splits launched per tile (grid axis 2); programs past a tile's own count store nothing.
    """

    ids: torch.Tensor
    lens: torch.Tensor
    whole: torch.Tensor
    chunk: torch.Tensor
    max_splits: int


@dataclass(frozen=True)
class Launch:
    """A launch configuration of ``paged_attention_kernel`` (one compiled variant per sliding-window kind).

    Attributes:
        block_m: rows (query tokens x GQA heads) per program.
        block_n: slots per KV tile (a power of two, at least 16).
        num_warps: warps per program.
        split: split-KV partials, merged by ``combine_splits_kernel`` (``triton_split``).
        num_stages: KV tiles in flight in the software pipeline (async copies issued ahead).
        max_registers: per thread (PTX ``.maxnreg``; ``None``: ptxas chooses).
        whole_tiles: run each work list's whole tiles in a loop without the mask (a second loop: more registers).
        rotate_k: rotate K as it is read (``False``: K is read already rotated, from ``rotated_once``'s rows or,
            in benchmarks, from a cache holding it rotated).
        rotated_once: read each sequence's K from ``RotatedK.rows``, which ``rotate_k_kernel`` fills once per layer
            before the launch (in slot order: no block table for K), instead of rotating it in the KV loop.
    """

    block_m: int
    block_n: int
    num_warps: int
    split: bool
    num_stages: int = 3
    max_registers: int | None = None
    whole_tiles: bool = True
    rotate_k: bool = True
    rotated_once: bool = False


@dataclass(frozen=True)
class RotatedK:
    """A recompute passes' launch's K rotated once per layer (``Launch.rotated_once``): ``rotate_k_kernel`` rewrites
    ``rows`` at each layer, and the attention kernel reads them instead of the pool's NoPE K.

    Attributes:
        seqs: ``[P]`` int32, the sequences whose K is rotated (the launch's), in batch order.
        first: ``[B]`` int64, the row of ``rows`` holding each sequence's slot 0 (``p * S`` for ``seqs[p]``; 0 for
            the others, never read).
        rows: ``[P * S, Hkv, D]`` in the model's dtype, shared by every layer of the forward.
        cos, sin: ``[R, head_dim // 2]`` float32, one half of the rotary table: what ``rotate_k_kernel`` rotates K
            with and the launch rotates its queries with (read once per row, so unrounded to the model's dtype).
        block: slots per program of ``rotate_k_kernel`` (divides ``S``).
        num_warps: of ``rotate_k_kernel``.
    """

    seqs: torch.Tensor
    first: torch.Tensor
    rows: torch.Tensor = field(metadata=SCRATCH_FIELD)
    cos: torch.Tensor
    sin: torch.Tensor
    block: int
    num_warps: int

    @classmethod
    def empty(
        cls, seqs: list[int], cos: torch.Tensor, sin: torch.Tensor, *, num_seqs: int, num_slots: int,
        num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, block: int, num_warps: int,
    ) -> RotatedK:  # fmt: skip
        """Rows for ``seqs`` (host list) of a batch of ``num_seqs`` sequences of ``num_slots`` slots each."""
        first = [0] * num_seqs
        for p, b in enumerate(seqs):
            first[b] = p * num_slots
        return cls(
            seqs=torch.tensor(seqs, dtype=torch.int32).to(device, non_blocking=True),
            first=torch.tensor(first, dtype=torch.int64).to(device, non_blocking=True),
            rows=torch.empty(len(seqs) * num_slots, num_kv_heads, head_dim, dtype=dtype, device=device),
            cos=cos,
            sin=sin,
            block=block,
            num_warps=num_warps,
        )


@dataclass(frozen=True)
class TritonTiles:
    """One launch's query tiles of ``launch.block_m`` rows.

    Attributes:
        seq: ``[T]`` int32, the sequence of each tile.
        row: ``[T]`` int32, the tile's first query row in the batch.
        launch: how the tiles are launched.
        work: per sliding window of the model (``None``: none), the tiles' work lists.
        scratch: a split launch's partial results (``None`` unsplit), shared by every layer and window.
        rotated: the rows of K rotated once per layer that a ``Launch.rotated_once`` launch reads (else ``None``).
    """

    seq: torch.Tensor
    row: torch.Tensor
    launch: Launch
    work: dict[int | None, TritonWork]
    scratch: SplitScratch | None = None
    rotated: RotatedK | None = None

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
        decode, prefill: the tiles of the decode launch (one query token per sequence) and of the recompute passes,
            each split or not (``TritonTiles.launch.split``).
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


@dataclass(frozen=True)
class TileSpans:
    """Per sequence and KV tile of ``block_n`` slots (``[B, S // block_n]`` each): the earliest written position
    (int32 max: none), the latest (-1: none), and whether every slot is written."""

    first: torch.Tensor
    last: torch.Tensor
    full: torch.Tensor


def tile_spans(kv_pos: torch.Tensor, *, block_n: int) -> TileSpans:
    """The ``TileSpans`` of ``kv_pos`` ``[B, S]`` (slot positions, ``-1``: unwritten)."""
    pos = kv_pos.view(kv_pos.shape[0], -1, block_n)
    written = pos >= 0
    return TileSpans(torch.where(written, pos, _NO_POSITION).amin(-1), pos.amax(-1), written.all(-1))


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
    tiles: tuple[list[int], list[int]],
    launch: Launch,
    *,
    group: int,
    cu_q: torch.Tensor,
    q_pos: torch.Tensor,
    kv_pos: torch.Tensor,
    windows: set[int | None],
    max_splits: int,
    min_chunk: int = MIN_TILES_PER_SPLIT,
    num_kv_heads: int,
    d_pad: int,
) -> TritonTiles:
    """The query ``tiles`` (``query_tiles``: sequence and first row of each) for ``launch``, with their work lists
    for each of the model's ``windows`` and, for a split launch, the scratch of its ``num_kv_heads * max_splits``
    programs per tile (``d_pad`` wide); ``cu_q`` and ``q_pos`` as in ``work_lists``, ``kv_pos`` as in the plan."""
    spans = tile_spans(kv_pos, block_n=launch.block_n)
    device = q_pos.device
    seq, row = (torch.tensor(t, dtype=torch.int32).to(device, non_blocking=True) for t in tiles)
    common = dict(cu_q=cu_q, q_pos=q_pos, spans=spans, max_splits=max_splits, min_chunk=min_chunk)
    work = {w: work_lists(seq, row, per_tile=launch.block_m // group, window=w, **common) for w in windows}
    scratch = None
    if launch.split and tiles[0]:  # shared by every layer and window of the forward
        num_programs = len(tiles[0]) * num_kv_heads * max_splits
        scratch = SplitScratch.empty(num_programs=num_programs, block_m=launch.block_m, d_pad=d_pad, device=device)
    return TritonTiles(seq=seq, row=row, launch=launch, work=work, scratch=scratch)


def work_lists(
    seq: torch.Tensor,
    row: torch.Tensor,
    *,
    per_tile: int,
    cu_q: torch.Tensor,
    q_pos: torch.Tensor,
    spans: TileSpans,
    window: int | None,
    max_splits: int,
    min_chunk: int = MIN_TILES_PER_SPLIT,
) -> TritonWork:
    """The KV tiles each query tile (``seq``, ``row``: ``[T]`` int32, of ``per_tile`` query tokens) visits
    under ``window``, the whole ones first, and its splits. ``cu_q``: ``[B + 1]`` int32 query rows per sequence;
    ``q_pos``: ``[N]`` int32 query positions; ``spans``: ``tile_spans`` of the batch's slots; a split takes at
    least ``min_chunk`` KV tiles."""
    b = seq.long()
    rows = row[:, None].long() + torch.arange(per_tile, device=row.device)  # [T, per_tile]
    ok = rows < cu_q[b + 1][:, None]
    pos = q_pos[rows.clamp(max=q_pos.shape[0] - 1)]
    q_max = torch.where(ok, pos, -1).amax(1)[:, None]
    q_min = torch.where(ok, pos, _NO_POSITION).amin(1)[:, None]
    first, last = spans.first[b], spans.last[b]  # [T, num_kv_tiles]
    live = first <= q_max
    whole = spans.full[b] & (last <= q_min)
    if window is not None:
        live &= last > q_min - window
        whole &= first > q_max - window
    kind = torch.where(whole, 0, torch.where(live, 1, 2)).to(torch.uint8)  # whole, live, skipped
    ids = torch.argsort(kind, dim=1, stable=True).to(torch.int32)  # each kind in slot order
    lens = live.sum(1, dtype=torch.int32)
    chunk = torch.clamp(triton.cdiv(lens, max_splits), min=min_chunk).to(torch.int32)
    return TritonWork(ids=ids, lens=lens, whole=whole.sum(1, dtype=torch.int32), chunk=chunk, max_splits=max_splits)


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
