"""The Triton backend's launches: one function per kernel launch, shared by serving and by precompiling
(``warmup=True`` compiles through the JIT's own launch path, so a variant compiles exactly as it runs). A launch
that reads K rotated once (``Launch.rotated_once``) runs ``rotate_k_kernel`` first, in ``launch_attention``: what
serving runs and what precompile compiles are the same calls."""

from __future__ import annotations

import torch
import triton

from pic.attention.triton_kernels import (
    combine_splits_kernel,
    paged_attention_kernel,
    rotate_k_kernel,
    store_kv_kernel,
)  # fmt: skip
from pic.attention.triton_plan import RotatedK, TritonPlan, TritonTiles

# Rows each program of ``combine_splits_kernel`` merges: a 128-row tile's accumulators in one 4-warp program would
# spill (``[128, 128]`` float32 twice), and a link's few tiles would leave the GPU idle.
COMBINE_ROWS = 16


def pow2(n: int, *, at_least: int = 16) -> int:
    """The next power of two of ``n``, at least ``at_least`` (a ``tl.dot`` needs 16)."""
    return max(at_least, triton.next_power_of_2(n))


def launch_store(k_rows, v_rows, rows, k, v, *, warmup: bool = False):
    """``store_kv_kernel`` over ``rows`` (shapes as in ``TritonBackend.store``); ``warmup``: compile only."""
    k, v = k.reshape(k.shape[0], -1), v.reshape(v.shape[0], -1)
    width = k.shape[1]
    args = (k, v, k_rows, v_rows, rows, k.stride(0), v.stride(0), k_rows.stride(0), v_rows.stride(0))
    grid = (rows.shape[0],)
    options = dict(WIDTH=width, BLOCK=min(1024, pow2(width)))
    if warmup:
        return store_kv_kernel.warmup(*args, grid=grid, **options)
    return store_kv_kernel[grid](*args, **options)


def launch_rotate(k_cache: torch.Tensor, plan: TritonPlan, rotated: RotatedK, *, warmup: bool = False):
    """``rotate_k_kernel``: the K of ``rotated.seqs`` rotated from the pool's NoPE K (``k_cache``: ``[num_blocks,
    page, Hkv, D]``, one layer's) into ``rotated.rows``, one program per ``rotated.block`` slots, sequence and KV
    head. ``warmup``: compile only."""
    page, num_kv_heads, head_dim = k_cache.shape[1:]
    k_rows, out = k_cache.flatten(0, 1), rotated.rows
    num_slots = plan.kv_pos.shape[1]
    assert num_slots % rotated.block == 0 and out.shape[0] == rotated.seqs.shape[0] * num_slots, out.shape
    args = (
        k_rows, out, rotated.cos, rotated.sin, plan.rope_off, rotated.seqs, plan.tables, plan.kv_pos,
        k_rows.stride(0), k_rows.stride(1), out.stride(0), out.stride(1), plan.tables.stride(0),
        plan.kv_pos.stride(0), num_slots,
    )  # fmt: skip
    grid = (num_slots // rotated.block, rotated.seqs.shape[0], num_kv_heads)
    options = dict(HEAD_DIM=head_dim, HALF_PAD=pow2(head_dim // 2), BLOCK=rotated.block, PAGE=page,
                   num_warps=rotated.num_warps, num_stages=1)  # fmt: skip
    if warmup:
        return rotate_k_kernel.warmup(*args, grid=grid, **options)
    return rotate_k_kernel[grid](*args, **options)


def launch_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    plan: TritonPlan,
    tiles: TritonTiles,
    *,
    scaling: float,
    window: int | None,
    warmup: bool = False,
) -> list:
    """One launch of ``paged_attention_kernel`` over ``tiles`` (and ``combine_splits_kernel`` after a split one);
    shapes as in ``TritonBackend.attend``; a ``rotated_once`` launch first rotates this layer's K into
    ``tiles.rotated``. ``warmup``: compile only, returning the compiled kernels (attention, combine, rotation)."""
    page, num_kv_heads, head_dim = k_cache.shape[1:]
    launch, work = tiles.launch, tiles.work[window]
    cos, sin = (tiles.rotated.cos, tiles.rotated.sin) if launch.rotated_once else (plan.cos, plan.sin)
    for table in (cos, sin):  # the kernel reads half-table rows at row * (head_dim // 2), in q's dtype or float32
        assert table.is_contiguous() and table.shape[1] == head_dim // 2, table.shape
        assert table.dtype == (torch.float32 if launch.rotated_once else q.dtype), table.dtype
    d_pad, splits = pow2(head_dim), work.max_splits
    k_rows, v_rows = k_cache.flatten(0, 1), v_cache.flatten(0, 1)  # [num_blocks * page, Hkv, D]
    k_first, compiled = plan.rope_off, []  # k_first is read only with K_SEQ_ROWS
    if launch.rotated_once:  # this layer's K rotated once, read in slot order
        assert tiles.rotated is not None and not launch.rotate_k, launch
        compiled.append(launch_rotate(k_cache, plan, tiles.rotated, warmup=warmup))
        k_rows, k_first = tiles.rotated.rows, tiles.rotated.first
    grid = (tiles.num_tiles, num_kv_heads, splits)
    target, part_ml = (tiles.scratch.acc, tiles.scratch.ml) if launch.split else (out, out)  # part_ml unread unsplit
    args = (
        q, k_rows, v_rows, target, part_ml, cos, sin, plan.rope_off, k_first,
        tiles.seq, tiles.row, plan.cu_q, plan.q_pos, plan.tables, plan.kv_pos, work.ids, work.lens, work.whole,
        work.chunk,
        q.stride(0), q.stride(1), k_rows.stride(0), k_rows.stride(1), v_rows.stride(0), v_rows.stride(1),
        out.stride(0), out.stride(1), plan.tables.stride(0), plan.kv_pos.stride(0), work.ids.stride(0),
        scaling * 1.4426950408889634, window or 0,
    )  # fmt: skip
    options = dict(
        GROUP=q.shape[1] // num_kv_heads, HEAD_DIM=head_dim, HALF_PAD=pow2(head_dim // 2), D_PAD=d_pad,
        BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, PAGE=page, SPLIT_KV=launch.split, HAS_WINDOW=window is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None, num_warps=launch.num_warps,
        num_stages=launch.num_stages, maxnreg=launch.max_registers, WHOLE_TILES=launch.whole_tiles,
        ROTATE_K=launch.rotate_k, K_SEQ_ROWS=launch.rotated_once,
    )  # fmt: skip
    combine_args = (target, part_ml, out, tiles.seq, tiles.row, plan.cu_q, work.lens, work.chunk)
    combine_args += (out.stride(0), out.stride(1), splits)
    rows = min(launch.block_m, COMBINE_ROWS)
    combine_options = dict(GROUP=options["GROUP"], HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_M=launch.block_m, ROWS=rows)
    combine_grid = (*grid[:2], launch.block_m // rows)
    if warmup:  # the attention kernel first (residency is read from it), the rotation last
        compiled.insert(0, paged_attention_kernel.warmup(*args, grid=grid, **options))
        if launch.split:
            compiled.insert(1, combine_splits_kernel.warmup(*combine_args, grid=combine_grid, **combine_options))
        return compiled
    paged_attention_kernel[grid](*args, **options)
    if launch.split:
        combine_splits_kernel[combine_grid](*combine_args, **combine_options)
    return []
