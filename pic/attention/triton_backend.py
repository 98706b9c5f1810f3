"""The Triton backend: its plan (the batch's int32 tensors and query tiles, built once per forward) and its launches.

Imported only when the Triton backend is chosen (``pic.attention.select``), so ``import pic`` never
imports Triton. On CUDA it compiles the kernels; on the CPU it needs Triton's interpreter
(``TRITON_INTERPRET=1`` set before Triton is first imported), which is how CI tests the same source.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from pic.attention.backend import AttentionBackend, AttentionShape
from pic.attention.batch import AttentionBatch
from pic.attention.triton_kernels import combine_splits_kernel, paged_attention_kernel, store_kv_kernel

# Warps per program: the defaults compile for sm_90 in bfloat16 at head_dim 128 without register spills
# (``tests/compile_kernels.py`` reports them; 4 warps spill).
NUM_WARPS = 8


@dataclass(frozen=True)
class TritonTiles:
    """One launch's query tiles of ``block_m`` rows (query tokens x GQA heads).

    Attributes:
        seq: ``[T]`` int32, the sequence of each tile.
        row: ``[T]`` int32, the tile's first query row in the batch.
        block_m: rows per program.
        num_splits: KV splits per tile (flash-decoding; 1: none).
    """

    seq: torch.Tensor
    row: torch.Tensor
    block_m: int
    num_splits: int

    @property
    def num_tiles(self) -> int:
        return self.seq.shape[0]


@dataclass(frozen=True)
class TritonPlan:
    """The Triton backend's plan of one forward: the batch as the kernels read it, shared by every layer.

    Attributes:
        batch: what the forward attends over (its float32 rotary tables are read as they are).
        cu_q: ``[B + 1]`` int32, ``batch.cu_seqlens_q``.
        q_pos: ``[N]`` int32 query positions.
        tables: ``[B, max_blocks]`` int32 block tables.
        kv_pos: ``[B, S]`` int32 slot positions, ``-1``: never attended.
        kv_len: ``[B]`` int32 slots in each sequence's table.
        rope_off: ``[B]`` int32 rotary-table row of each sequence's position 0.
        decode, prefill: the tiles of the decode launch (one query token per sequence) and of the recompute passes.
        split_acc: ``[T_decode * Hkv * splits * block_m * D_PAD]`` float32 partial accumulators of a split decode
            launch (``None`` without splits); ``split_ml``: ``[T_decode * Hkv * splits * 2 * block_m]`` float32,
            their running maxima and sums.
    """

    batch: AttentionBatch
    cu_q: torch.Tensor
    q_pos: torch.Tensor
    tables: torch.Tensor
    kv_pos: torch.Tensor
    kv_len: torch.Tensor
    rope_off: torch.Tensor
    decode: TritonTiles
    prefill: TritonTiles
    split_acc: torch.Tensor | None
    split_ml: torch.Tensor | None


def _pow2(n: int, *, at_least: int = 16) -> int:
    return max(at_least, triton.next_power_of_2(n))


def _tiles(
    batch: AttentionBatch, *, decode: bool, block_m: int, group: int, num_splits: int, device: torch.device
) -> TritonTiles:
    """Tiles of ``block_m // group`` query tokens over the decode (one token) or the prefill sequences.
    Built from ``cu_seqlens_q``, which lives on the host: no device sync."""
    per_tile = block_m // group
    cu = batch.cu_seqlens_q.tolist()
    seqs, rows = [], []
    for b in range(len(cu) - 1):
        if (cu[b + 1] - cu[b] == 1) != decode:
            continue
        for start in range(cu[b], cu[b + 1], per_tile):
            seqs.append(b)
            rows.append(start)
    as_i32 = {"dtype": torch.int32}
    seq = torch.tensor(seqs, **as_i32).to(device, non_blocking=True)
    row = torch.tensor(rows, **as_i32).to(device, non_blocking=True)
    return TritonTiles(seq=seq, row=row, block_m=block_m, num_splits=num_splits)


def _default_splits(num_programs: int, max_slots: int, block_n: int, device: torch.device) -> int:
    """Flash-decoding: split long KV when the launch alone would not fill the GPU (two programs per SM)."""
    if device.type != "cuda":
        return 1
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    kv_tiles = triton.cdiv(max_slots, block_n)
    if num_programs >= target or kv_tiles < 8:
        return 1
    return max(1, min(triton.cdiv(target, num_programs), kv_tiles // 4, 64))


class TritonBackend(AttentionBackend[TritonPlan]):
    """The fused-RoPE paged kernel (``triton_kernels.py``); same contract as the reference backend.

    Args:
        shape: the model's attention shape (``head_dim`` even: the kernel rotates the two halves).
        block_n: slots per KV tile (a power of two, at least 16).
        prefill_block_m: rows (query tokens x GQA heads) per program of the recompute passes.
        num_splits: KV splits of the decode launch (flash-decoding); ``None`` picks by GPU occupancy, per forward.
    """

    name = "triton"

    def __init__(
        self, shape: AttentionShape, *, block_n: int = 64, prefill_block_m: int = 64, num_splits: int | None = None
    ) -> None:
        super().__init__(shape)
        assert shape.head_dim % 2 == 0, shape
        self.block_n, self.prefill_block_m, self.num_splits = block_n, prefill_block_m, num_splits

    def plan(self, batch: AttentionBatch) -> TritonPlan:
        shape, device = self.shape, batch.q_positions.device
        assert batch.rope_cos.shape[1] == shape.head_dim, (shape.head_dim, batch.rope_cos.shape)
        for table in (batch.rope_cos, batch.rope_sin):  # the kernel reads rows at row * head_dim, in float32
            assert table.dtype == torch.float32 and table.is_contiguous(), (table.dtype, table.stride())
        group = shape.num_q_heads // shape.num_kv_heads
        splits = self.num_splits
        if splits is None:  # by occupancy: once per forward, not per layer
            programs = batch.decode_seqs.numel() * shape.num_kv_heads
            splits = _default_splits(programs, batch.kv_positions.shape[1], self.block_n, device)
        decode_m = _pow2(group)
        prefill_m = max(self.prefill_block_m, decode_m)
        decode = _tiles(batch, decode=True, block_m=decode_m, group=group, num_splits=splits, device=device)
        prefill = _tiles(batch, decode=False, block_m=prefill_m, group=group, num_splits=1, device=device)
        split_acc = split_ml = None
        if splits > 1 and decode.num_tiles:  # scratch for the splits' partial results, shared by every layer
            parts = decode.num_tiles * shape.num_kv_heads * splits * decode_m
            split_acc = torch.empty(parts * _pow2(shape.head_dim), device=device)
            split_ml = torch.empty(parts * 2, device=device)

        def i32(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=torch.int32, non_blocking=True).contiguous()

        return TritonPlan(
            batch=batch,
            cu_q=i32(batch.cu_seqlens_q),
            q_pos=i32(batch.q_positions),
            tables=i32(batch.block_tables),
            kv_pos=i32(batch.kv_positions),
            kv_len=i32(batch.kv_lens),
            rope_off=i32(batch.rope_offsets),
            decode=decode,
            prefill=prefill,
            split_acc=split_acc,
            split_ml=split_ml,
        )

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: TritonPlan,
        *,
        scaling: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        assert q.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
        out = torch.empty_like(q)
        for tiles in (plan.decode, plan.prefill):
            if tiles.num_tiles:
                _launch(q, k_cache, v_cache, out, plan, tiles, scaling, sliding_window, self.block_n)
        return out

    def store(self, k_rows: torch.Tensor, v_rows: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """One launch for K and V."""
        if not rows.numel():
            return
        k, v = k.reshape(k.shape[0], -1), v.reshape(v.shape[0], -1)
        width = k.shape[1]
        store_kv_kernel[(rows.shape[0],)](
            k, v, k_rows, v_rows, rows, k.stride(0), v.stride(0), k_rows.stride(0), v_rows.stride(0),
            WIDTH=width, BLOCK=min(1024, _pow2(width)),
        )  # fmt: skip


def _launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    plan: TritonPlan,
    tiles: TritonTiles,
    scaling: float,
    sliding_window: int | None,
    block_n: int,
) -> None:
    """One launch of ``paged_attention_kernel`` over ``tiles`` (and ``combine_splits_kernel`` after a split one);
    shapes as in ``TritonBackend.attend``."""
    page, num_kv_heads, head_dim = k_cache.shape[1:]
    group = q.shape[1] // num_kv_heads
    d_pad, splits = _pow2(head_dim), tiles.num_splits
    k_rows, v_rows = k_cache.flatten(0, 1), v_cache.flatten(0, 1)  # [num_blocks * page, Hkv, D]
    grid = (tiles.num_tiles, num_kv_heads, splits)
    if splits > 1:
        target, part_ml = plan.split_acc, plan.split_ml
    else:
        target, part_ml = out, out  # part_ml is not read with one split
    paged_attention_kernel[grid](
        q, k_rows, v_rows, target, part_ml, plan.batch.rope_cos, plan.batch.rope_sin, plan.rope_off,
        tiles.seq, tiles.row, plan.cu_q, plan.q_pos, plan.tables, plan.kv_pos, plan.kv_len,
        q.stride(0), q.stride(1), k_rows.stride(0), k_rows.stride(1), v_rows.stride(0), v_rows.stride(1),
        out.stride(0), out.stride(1), plan.tables.stride(0), plan.kv_pos.stride(0),
        scaling * 1.4426950408889634, sliding_window or 0,
        GROUP=group, HEAD_DIM=head_dim, HALF_PAD=_pow2(head_dim // 2), D_PAD=d_pad,
        BLOCK_M=tiles.block_m, BLOCK_N=block_n, PAGE=page, SPLIT_KV=splits > 1,
        HAS_WINDOW=sliding_window is not None, DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
        num_warps=NUM_WARPS,
    )  # fmt: skip
    if splits > 1:
        combine_splits_kernel[(tiles.num_tiles, num_kv_heads)](
            target, part_ml, out, tiles.seq, tiles.row, plan.cu_q, out.stride(0), out.stride(1), splits,
            GROUP=group, HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_M=tiles.block_m,
        )  # fmt: skip
