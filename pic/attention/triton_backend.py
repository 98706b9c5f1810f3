"""Host side of the Triton backend: per-forward tiles (planned once, memoized on the plan) and launches.

Imported only when the Triton backend is chosen (``pic.attention.backend``), so ``import pic`` never
imports Triton. On CUDA it compiles the kernels; on the CPU it needs Triton's interpreter
(``TRITON_INTERPRET=1`` set before Triton is first imported), which is how CI tests the same source.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from pic.attention.plan import BatchPlan
from pic.attention.triton_kernels import combine_splits_kernel, paged_attention_kernel, store_kv_kernel


@dataclass(frozen=True)
class _Meta:
    """The plan's int32 tensors, as the kernels read them (built once per forward)."""

    cu_q: torch.Tensor  # [B + 1]
    q_pos: torch.Tensor  # [N]
    tables: torch.Tensor  # [B, max_blocks]
    kv_pos: torch.Tensor  # [B, S]
    kv_len: torch.Tensor  # [B]
    rope_off: torch.Tensor  # [B]


@dataclass(frozen=True)
class _Tiles:
    """One launch's query tiles: ``seq[t]`` and its first query row ``row[t]``, ``[T]`` int32 each."""

    seq: torch.Tensor
    row: torch.Tensor
    block_m: int
    num_splits: int

    @property
    def num_tiles(self) -> int:
        return self.seq.shape[0]


def _pow2(n: int, *, at_least: int = 16) -> int:
    return max(at_least, triton.next_power_of_2(n))


def _meta(plan: BatchPlan, device: torch.device) -> _Meta:
    def i32(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=torch.int32, non_blocking=True).contiguous()

    return _Meta(
        cu_q=i32(plan.cu_seqlens_q),
        q_pos=i32(plan.q_positions),
        tables=i32(plan.block_tables),
        kv_pos=i32(plan.kv_positions),
        kv_len=i32(plan.kv_lens),
        rope_off=i32(plan.rope_offsets),
    )


def _tiles(plan: BatchPlan, *, decode: bool, block_m: int, group: int, num_splits: int, device) -> _Tiles:
    """Tiles of ``block_m // group`` query tokens over the decode (one token) or the prefill sequences.
    Built from ``cu_seqlens_q``, which lives on the host: no device sync."""
    per_tile = block_m // group
    cu = plan.cu_seqlens_q.tolist()
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
    return _Tiles(seq=seq, row=row, block_m=block_m, num_splits=num_splits)


def _default_splits(num_programs: int, max_slots: int, block_n: int, device: torch.device) -> int:
    """Flash-decoding: split long KV when the launch alone would not fill the GPU (two programs per SM)."""
    if device.type != "cuda":
        return 1
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    kv_tiles = triton.cdiv(max_slots, block_n)
    if num_programs >= target or kv_tiles < 8:
        return 1
    return max(1, min(triton.cdiv(target, num_programs), kv_tiles // 4, 64))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: BatchPlan,
    *,
    scaling: float,
    sliding_window: int | None = None,
    block_n: int = 64,
    prefill_block_m: int = 64,
    num_splits: int | None = None,
    num_warps: int = 8,
) -> torch.Tensor:
    """The Triton kernel; same contract as ``pic.attention.reference.paged_attention``.

    Args:
        q: ``[N, num_q_heads, head_dim]`` NoPE queries, float32/float16/bfloat16.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, one layer.
        plan: the batch's ``BatchPlan`` (its rotary table must be ``head_dim`` wide).
        scaling: softmax scale.
        sliding_window: attend only to keys with position > query position - window.
        block_n: slots per KV tile (a power of two, at least 16).
        prefill_block_m: rows (query tokens x GQA heads) per program of the recompute passes.
        num_splits: KV splits of the decode launch (flash-decoding); ``None`` picks by GPU occupancy.
        num_warps: warps per program. The defaults compile for sm_90 in bfloat16 at head_dim 128
            without register spills (``tests/compile_kernels.py`` reports them; 4 warps spill).

    Returns:
        ``[N, num_q_heads, head_dim]`` in ``q``'s dtype.
    """
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    assert head_dim % 2 == 0 and plan.rope_cos.shape[1] == head_dim, (head_dim, plan.rope_cos.shape)
    assert q.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    meta = plan.memo(("triton", q.device), lambda: _meta(plan, q.device))
    out = torch.empty_like(q)
    decode_m = _pow2(group)
    if num_splits is None:  # the decode launch's, by occupancy: once per forward, not per layer
        num_splits = plan.memo(
            ("triton-splits", num_kv_heads, block_n, q.device),
            lambda: _default_splits(
                plan.decode_seqs.numel() * num_kv_heads, plan.kv_positions.shape[1], block_n, q.device
            ),
        )
    for decode, block_m, splits in ((True, decode_m, num_splits), (False, max(prefill_block_m, decode_m), 1)):
        key = ("triton-tiles", decode, block_m, group, splits)
        build = functools.partial(_tiles, plan, decode=decode, block_m=block_m, group=group, num_splits=splits)
        tiles = plan.memo(key, lambda build=build: build(device=q.device))
        if tiles.num_tiles:
            _launch(q, k_cache, v_cache, out, plan, meta, tiles, scaling, sliding_window, block_n, page, num_warps)
    return out


def _launch(q, k_cache, v_cache, out, plan, meta, tiles, scaling, sliding_window, block_n, page, num_warps) -> None:
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    d_pad, splits = _pow2(head_dim), tiles.num_splits
    k_rows, v_rows = k_cache.flatten(0, 1), v_cache.flatten(0, 1)  # [num_blocks * page, Hkv, D]
    grid = (tiles.num_tiles, num_kv_heads, splits)
    if splits > 1:  # scratch for the splits' partial results, shared by every layer of the forward
        parts = tiles.num_tiles * num_kv_heads * splits * tiles.block_m
        target, part_ml = plan.memo(
            ("triton-parts", parts, d_pad, q.device),
            lambda: (torch.empty(parts * d_pad, device=q.device), torch.empty(parts * 2, device=q.device)),
        )
    else:
        target, part_ml = out, out  # part_ml is not read with one split
    paged_attention_kernel[grid](
        q, k_rows, v_rows, target, part_ml, plan.rope_cos, plan.rope_sin, meta.rope_off,
        tiles.seq, tiles.row, meta.cu_q, meta.q_pos, meta.tables, meta.kv_pos, meta.kv_len,
        q.stride(0), q.stride(1), k_rows.stride(0), k_rows.stride(1), v_rows.stride(0), v_rows.stride(1),
        out.stride(0), out.stride(1), meta.tables.stride(0), meta.kv_pos.stride(0),
        scaling * 1.4426950408889634, sliding_window or 0,
        GROUP=group, HEAD_DIM=head_dim, HALF_PAD=_pow2(head_dim // 2), D_PAD=d_pad,
        BLOCK_M=tiles.block_m, BLOCK_N=block_n, PAGE=page, SPLIT_KV=splits > 1,
        HAS_WINDOW=sliding_window is not None, DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
        num_warps=num_warps,
    )  # fmt: skip
    if splits > 1:
        combine_splits_kernel[(tiles.num_tiles, num_kv_heads)](
            target, part_ml, out, tiles.seq, tiles.row, meta.cu_q, out.stride(0), out.stride(1), splits,
            GROUP=group, HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_M=tiles.block_m,
        )  # fmt: skip


def store_kv(k_rows: torch.Tensor, v_rows: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write fresh NoPE K and V into their cache rows in one launch.

    Args:
        k_rows, v_rows: ``[num_blocks * block_size, num_kv_heads, head_dim]``, one layer's rows.
        rows: ``[N]`` int64 rows to write.
        k, v: ``[N, num_kv_heads, head_dim]``, the cache's dtype.
    """
    if not rows.numel():
        return
    k, v = k.reshape(k.shape[0], -1), v.reshape(v.shape[0], -1)
    width = k.shape[1]
    store_kv_kernel[(rows.shape[0],)](
        k, v, k_rows, v_rows, rows, k.stride(0), v.stride(0), k_rows.stride(0), v_rows.stride(0),
        WIDTH=width, BLOCK=min(1024, _pow2(width)),
    )  # fmt: skip
