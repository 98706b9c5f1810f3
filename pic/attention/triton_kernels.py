"""Triton kernels: fused-RoPE paged attention over NoPE K (with a split-K reduction) and the KV store.

One program of ``paged_attention_kernel`` takes a tile of one sequence's query tokens and one KV head,
with the ``GROUP`` query heads that share it (GQA) stacked as rows: row ``r`` is query token
``r // GROUP`` of the tile and head ``kv_head * GROUP + r % GROUP``. It rotates its queries by their
positions, then walks its *work list*: the ``BLOCK_N``-slot KV tiles that hold a slot some row of the
tile may attend (the plan builds the lists once per forward, so tiles wholly after the queries or
before the window are never visited). For each, it looks up the slots' blocks, loads NoPE K and V
together (only slots that were written: stale slots are never read, so never multiplied in), rotates K
from the rotary table at each slot's logical position, masks by position (exact causality, sliding
window) and accumulates with an online softmax in float32. With ``WHOLE_TILES`` the list's leading *whole*
tiles (every slot written and attended by every row: most of a long prompt's) run in a first loop without
the mask, as flash attention runs its off-diagonal tiles, and the rest in a second loop, masked.

The loop bodies have no branch: every load's address depends only on the loop index, so Triton's
software pipeliner can issue the next tiles' loads (async copies) while this tile computes.
Rotate-half is done on the two halves of the head dimension, so each K element is read once: for
``x = [x1, x2]``, ``rope(x) = [x1 cos - x2 sin, x2 cos + x1 sin]``; the table holds one half, in the
model's dtype (as transformers rounds it), and the products are taken in float32.

With ``SPLIT_KV`` (flash-decoding, for decodes and recompute passes alike: ``triton_split``), the launch's
third grid axis splits each work list into shares of ``work_chunk[tile]`` tiles: split ``s`` writes its
unnormalized accumulator, running max and sum, and ``combine_splits_kernel`` merges the tile's
``cdiv(work_len, work_chunk)`` splits. Programs past a tile's last split store nothing, so no split is
empty. Split counts are run-time values: a decode whose split count changes as its context grows compiles
nothing new.

K rotated once (``rotate_k_kernel``, ``K_SEQ_ROWS``): a recompute passes' launch of many query tiles per sequence
would rotate each KV tile once per query tile visiting it (16 times for a 512-row pass at 128 rows a tile). Instead
``rotate_k_kernel`` rotates the launch's sequences' K once per layer into rows laid out per sequence in slot order
(one per-forward buffer, rewritten by each layer), with the float32 half-table, and the attention kernel reads
them with ``ROTATE_K=False`` and ``K_SEQ_ROWS``: no rotation and no block-table lookup for K in its loop (V is still
paged). The table is read once per slot there, so it is not rounded to the model's dtype: the rotated rows are
what SDPA is given in ``benchmarks/attention.py`` (bit for bit in the interpreter), and the kernel's error against
float64 is flash attention's (the in-loop table in the model's dtype made it larger than SDPA's on the H100 run:
docs/gpu.md#the-first-run-an-nvidia-h100-2026-11-26).

Every kernel is the one the CUDA path runs; the CPU tests run the same source in Triton's interpreter.
Offsets that scale with the pool or the batch (cache rows, query rows, partials) are int64.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rotate(x1, x2, table_row, cos_ptr, sin_ptr, cols, col_ok, HALF: tl.constexpr):
    """Rotate ``[rows, HALF_PAD]`` halves by the half-table rows ``table_row`` ``[rows]``; float32 out."""
    at = table_row[:, None] * HALF + cols[None, :]
    ok = col_ok[None, :]
    c = tl.load(cos_ptr + at, mask=ok, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + at, mask=ok, other=0.0).to(tl.float32)
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit
def _kv_tiles(
    m_i, l_i, acc, q1, q2, q_pos, row_ok, work, kv_pos, table, k_ptr, v_ptr, stride_kr, stride_vr,
    rope_off, cos_ptr, sin_ptr, window, first, last, cols, col_ok, d, d_ok, k_first,
    HALF: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, MASKED: tl.constexpr,
    HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, ROTATE_K: tl.constexpr, K_SEQ_ROWS: tl.constexpr,
):  # fmt: skip
    """The online softmax over work-list entries ``first .. last - 1`` of one (query tile, KV head): the running
    max ``m_i`` and sum ``l_i`` ``[BLOCK_M]`` and unnormalized output ``acc`` ``[BLOCK_M, D_PAD]`` (float32), updated.
    ``k_ptr, v_ptr``: this head's K and V in row 0; ``rope_off``: the sequence's row of the rotary halves.
    ``MASKED``: mask each score by position (exact causality, window) and load only written slots; without it
    (whole tiles) every slot is written and attended by every row. ``K_SEQ_ROWS``: slot ``s``'s K is row
    ``k_first + s`` (``rotate_k_kernel``'s rows, already rotated), not the block table's. Branch-free: the loads
    pipeline."""
    dot_dtype = q1.dtype
    offs_n = tl.arange(0, BLOCK_N)
    for i in range(first, last):
        slots = tl.load(work + i) * BLOCK_N + offs_n
        k_pos = tl.load(kv_pos + slots)
        written = k_pos >= 0
        row = tl.load(table + slots // PAGE).to(tl.int64) * PAGE + slots % PAGE
        if K_SEQ_ROWS:
            k_at = k_ptr + (k_first + slots)[:, None] * stride_kr + cols[None, :]
        else:
            k_at = k_ptr + row[:, None] * stride_kr + cols[None, :]
        v_at = v_ptr + row[:, None] * stride_vr + d[None, :]
        if MASKED:
            k_ok, v_ok = written[:, None] & col_ok[None, :], written[:, None] & d_ok[None, :]
        else:
            k_ok, v_ok = col_ok[None, :], d_ok[None, :]
        k1 = tl.load(k_at, mask=k_ok, other=0.0)
        k2 = tl.load(k_at + HALF, mask=k_ok, other=0.0)
        v = tl.load(v_at, mask=v_ok, other=0.0)
        if ROTATE_K:
            k1, k2 = _rotate(k1, k2, rope_off + tl.maximum(k_pos, 0), cos_ptr, sin_ptr, cols, col_ok, HALF)
        s = tl.dot(q1, tl.trans(k1.to(dot_dtype)), input_precision=DOT_PRECISION)
        s += tl.dot(q2, tl.trans(k2.to(dot_dtype)), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N], log2
        if MASKED:
            allowed = written[None, :] & (k_pos[None, :] <= q_pos[:, None]) & row_ok[:, None]
            if HAS_WINDOW:
                allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)
            s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = m_new  # a whole tile gives every row a finite score
        if MASKED:
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing allowed yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


# Arguments that change from step to step as tables grow: not specialized (a value of 1 or a multiple of
# 16 would otherwise compile another variant mid-generation).
@triton.jit(do_not_specialize=["stride_table", "stride_kv_pos", "stride_work", "window"])
def paged_attention_kernel(
    q_ptr,  # [N, Hq, D] NoPE queries
    k_ptr,  # [num_blocks * block_size, Hkv, D] NoPE K rows of one layer
    v_ptr,  # [num_blocks * block_size, Hkv, D]
    out_ptr,  # [N, Hq, D], or with SPLIT_KV the partial accumulators [T, Hkv, max_splits, BLOCK_M, D_PAD] fp32
    part_ml_ptr,  # [T, Hkv, max_splits, 2, BLOCK_M] fp32 running max (log2 units) and sum (SPLIT_KV)
    cos_ptr,  # [R, D // 2] model dtype: one half of the rotate-half table
    sin_ptr,  # [R, D // 2]
    rope_off_ptr,  # [B] int32 table row of position 0 per sequence
    k_first_ptr,  # [B] int64 first K row of each sequence (K_SEQ_ROWS: slot s of sequence b is row k_first[b] + s)
    tile_seq_ptr,  # [T] int32 sequence of each tile
    tile_row_ptr,  # [T] int32 first query row of each tile
    cu_q_ptr,  # [B + 1] int32 query rows per sequence
    q_pos_ptr,  # [N] int32 query positions
    tables_ptr,  # [B, S // PAGE] int32 block tables (padded with block 0 to the slots)
    kv_pos_ptr,  # [B, S] int32 slot positions, -1 = never attended (S a multiple of BLOCK_N)
    work_ptr,  # [T, W] int32 KV tiles each query tile visits, in slot order (the first work_len)
    work_len_ptr,  # [T] int32
    work_whole_ptr,  # [T] int32 whole KV tiles leading each list (read unmasked)
    work_chunk_ptr,  # [T] int32 KV tiles per split (SPLIT_KV)
    stride_qn,
    stride_qh,
    stride_kr,
    stride_kh,
    stride_vr,
    stride_vh,
    stride_on,
    stride_oh,
    stride_table,
    stride_kv_pos,
    stride_work,
    sm_scale_log2,  # softmax scale * log2(e)
    window,  # sliding window (used when HAS_WINDOW)
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF_PAD: tl.constexpr,  # next power of two >= max(16, HEAD_DIM // 2)
    D_PAD: tl.constexpr,  # next power of two >= max(16, HEAD_DIM)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,  # slots per KV block
    SPLIT_KV: tl.constexpr,  # write partials for combine_splits_kernel (the number of splits is grid axis 2)
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs (no TF32), else None (the default)
    WHOLE_TILES: tl.constexpr,  # run the list's whole tiles in an unmasked loop (else every tile masked)
    ROTATE_K: tl.constexpr = True,  # False: K is read already rotated (rotate_k_kernel's rows, or benchmarks' cache)
    K_SEQ_ROWS: tl.constexpr = False,  # K of each sequence in slot order from k_first (rotate_k_kernel's), no table
):
    tile, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    HALF: tl.constexpr = HEAD_DIM // 2
    seq = tl.load(tile_seq_ptr + tile)
    rope_off = tl.load(rope_off_ptr + seq)
    rows = tl.arange(0, BLOCK_M)
    q_row = tl.load(tile_row_ptr + tile) + rows // GROUP
    row_ok = (rows < (BLOCK_M // GROUP) * GROUP) & (q_row < tl.load(cu_q_ptr + seq + 1))
    q_row = q_row.to(tl.int64)
    head = kv_head * GROUP + rows % GROUP
    cols = tl.arange(0, HALF_PAD)
    col_ok = cols < HALF
    q_at = q_ptr + q_row[:, None] * stride_qn + head[:, None] * stride_qh + cols[None, :]
    q_ok = row_ok[:, None] & col_ok[None, :]
    q1 = tl.load(q_at, mask=q_ok, other=0.0)
    q2 = tl.load(q_at + HALF, mask=q_ok, other=0.0)
    q_pos = tl.load(q_pos_ptr + q_row, mask=row_ok, other=0)
    q1, q2 = _rotate(q1, q2, rope_off + q_pos, cos_ptr, sin_ptr, cols, col_ok, HALF)
    dot_dtype = q_ptr.dtype.element_ty
    q1, q2 = (q1 * sm_scale_log2).to(dot_dtype), (q2 * sm_scale_log2).to(dot_dtype)

    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    n_work = tl.load(work_len_ptr + tile)
    if SPLIT_KV:
        chunk = tl.load(work_chunk_ptr + tile)
        start = split * chunk
        end = tl.minimum(n_work, start + chunk)
    else:
        start, end = 0, n_work
    work = work_ptr + tile.to(tl.int64) * stride_work
    kv_pos = kv_pos_ptr + seq.to(tl.int64) * stride_kv_pos
    table = tables_ptr + seq.to(tl.int64) * stride_table
    k_head, v_head = k_ptr + kv_head * stride_kh, v_ptr + kv_head * stride_vh
    k_first = tl.load(k_first_ptr + seq).to(tl.int64) if K_SEQ_ROWS else 0
    masked_from = start
    if WHOLE_TILES:  # the list's whole tiles in this program's share, unmasked
        n_whole = tl.load(work_whole_ptr + tile)
        m_i, l_i, acc = _kv_tiles(
            m_i, l_i, acc, q1, q2, q_pos, row_ok, work, kv_pos, table, k_head, v_head, stride_kr, stride_vr,
            rope_off, cos_ptr, sin_ptr, window, start, tl.minimum(end, n_whole), cols, col_ok, d, d_ok, k_first,
            HALF, BLOCK_N, PAGE, False, HAS_WINDOW, DOT_PRECISION, ROTATE_K, K_SEQ_ROWS,
        )  # fmt: skip
        masked_from = tl.maximum(start, n_whole)
    m_i, l_i, acc = _kv_tiles(
        m_i, l_i, acc, q1, q2, q_pos, row_ok, work, kv_pos, table, k_head, v_head, stride_kr, stride_vr,
        rope_off, cos_ptr, sin_ptr, window, masked_from, end, cols, col_ok, d, d_ok, k_first,
        HALF, BLOCK_N, PAGE, True, HAS_WINDOW, DOT_PRECISION, ROTATE_K, K_SEQ_ROWS,
    )  # fmt: skip

    if not SPLIT_KV:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_at = out_ptr + q_row[:, None] * stride_on + head[:, None] * stride_oh + d[None, :]
        tl.store(o_at, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        used = rows < tl.where(start < end, BLOCK_M, 0)  # a program past its tile's last split stores nothing
        part = ((tile * tl.num_programs(1) + kv_head) * tl.num_programs(2) + split).to(tl.int64)
        acc_at = out_ptr + (part * BLOCK_M + rows[:, None]) * D_PAD + d[None, :]
        tl.store(acc_at, acc, mask=used[:, None] & (d[None, :] < D_PAD))
        tl.store(part_ml_ptr + part * 2 * BLOCK_M + rows, m_i, mask=used)
        tl.store(part_ml_ptr + part * 2 * BLOCK_M + BLOCK_M + rows, l_i, mask=used)


@triton.jit(do_not_specialize=["max_splits"])  # splits change with the batch: one variant for every count
def combine_splits_kernel(
    part_acc_ptr,  # [T, Hkv, max_splits, BLOCK_M, D_PAD] fp32
    part_ml_ptr,  # [T, Hkv, max_splits, 2, BLOCK_M] fp32
    out_ptr,  # [N, Hq, D]
    tile_seq_ptr,
    tile_row_ptr,
    cu_q_ptr,
    work_len_ptr,  # [T] int32
    work_chunk_ptr,  # [T] int32
    stride_on,
    stride_oh,
    max_splits,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    ROWS: tl.constexpr,  # rows per program (divides BLOCK_M): grid axis 2 is BLOCK_M // ROWS
):
    """Merge the splits of ``ROWS`` rows of one (tile, KV head): ``out = sum_s 2^(m_s - m) acc_s / sum_s 2^(m_s - m)
    l_s``. A recompute pass's few tiles of 128 rows are merged by many programs of a few rows, not by one each."""
    tile, kv_head = tl.program_id(0), tl.program_id(1)
    rows = tl.program_id(2) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, D_PAD)
    m = tl.full([ROWS], float("-inf"), tl.float32)
    l_sum = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D_PAD], tl.float32)
    num_splits = tl.cdiv(tl.load(work_len_ptr + tile), tl.load(work_chunk_ptr + tile))
    first = (tile * tl.num_programs(1) + kv_head).to(tl.int64) * max_splits
    for split in range(num_splits):
        part = first + split
        m_s = tl.load(part_ml_ptr + part * 2 * BLOCK_M + rows)
        l_s = tl.load(part_ml_ptr + part * 2 * BLOCK_M + BLOCK_M + rows)
        acc_s = tl.load(part_acc_ptr + (part * BLOCK_M + rows[:, None]) * D_PAD + d[None, :])
        m_new = tl.maximum(m, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha, beta = tl.exp2(m - m_safe), tl.exp2(m_s - m_safe)
        acc = acc * alpha[:, None] + acc_s * beta[:, None]
        l_sum = l_sum * alpha + l_s * beta
        m = m_new
    seq = tl.load(tile_seq_ptr + tile)
    q_row = tl.load(tile_row_ptr + tile) + rows // GROUP
    row_ok = (rows < (BLOCK_M // GROUP) * GROUP) & (q_row < tl.load(cu_q_ptr + seq + 1))
    head = kv_head * GROUP + rows % GROUP
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    o_at = out_ptr + q_row.to(tl.int64)[:, None] * stride_on + head[:, None] * stride_oh + d[None, :]
    tl.store(o_at, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (d[None, :] < HEAD_DIM))


@triton.jit
def store_kv_kernel(
    k_ptr,  # [N, Hkv * D] fresh NoPE K
    v_ptr,  # [N, Hkv * D]
    k_rows_ptr,  # [num_blocks * block_size, Hkv * D] one layer's K rows
    v_rows_ptr,
    rows_ptr,  # [N] int64 cache rows; -1: none (a padded row of a graph's bucket: pic.model.graphs)
    stride_k,
    stride_v,
    stride_kr,
    stride_vr,
    WIDTH: tl.constexpr,  # Hkv * D
    BLOCK: tl.constexpr,
):
    """Write token ``i``'s K and V into cache row ``rows[i]``: one launch for both."""
    token = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + token)
    if row >= 0:
        for start in range(0, WIDTH, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < WIDTH
            tl.store(k_rows_ptr + row * stride_kr + cols, tl.load(k_ptr + token * stride_k + cols, mask=ok), mask=ok)
            tl.store(v_rows_ptr + row * stride_vr + cols, tl.load(v_ptr + token * stride_v + cols, mask=ok), mask=ok)


@triton.jit(do_not_specialize=["stride_table", "stride_kv_pos"])
def rotate_k_kernel(
    k_ptr,  # [num_blocks * block_size, Hkv, D] NoPE K rows of one layer
    out_ptr,  # [P * S, Hkv, D] K rotated: sequence seqs[p]'s slot s at row p * S + s
    cos_ptr,  # [R, D // 2] as paged_attention_kernel's
    sin_ptr,
    rope_off_ptr,  # [B] int32
    seqs_ptr,  # [P] int32 the sequences rotated
    tables_ptr,  # [B, S // PAGE] int32
    kv_pos_ptr,  # [B, S] int32, -1 = never attended
    stride_kr,
    stride_kh,
    stride_or,
    stride_oh,
    stride_table,
    stride_kv_pos,
    num_slots,  # S, a multiple of BLOCK (and of 16: specialized, always the same variant)
    HEAD_DIM: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK: tl.constexpr,  # slots per program
    PAGE: tl.constexpr,
):
    """Rotate ``BLOCK`` slots of one KV head of one sequence at their positions, once per layer and forward, for a
    recompute pass's launch to read with ``K_SEQ_ROWS`` (no rotation, no block table for K) instead of rotating them
    again in every query tile that visits them. The arithmetic is the attention kernel's ``_rotate`` (float32
    products of the model-dtype K and half-table, rounded once to the model's dtype), so the attention kernel's dot
    reads the values it would have rotated itself. Unwritten slots are never loaded (their rows get zeros)."""
    block, p, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    HALF: tl.constexpr = HEAD_DIM // 2
    seq = tl.load(seqs_ptr + p).to(tl.int64)
    slots = block * BLOCK + tl.arange(0, BLOCK)
    k_pos = tl.load(kv_pos_ptr + seq * stride_kv_pos + slots)
    written = k_pos >= 0
    row = tl.load(tables_ptr + seq * stride_table + slots // PAGE).to(tl.int64) * PAGE + slots % PAGE
    cols = tl.arange(0, HALF_PAD)
    col_ok = cols < HALF
    k_at = k_ptr + kv_head * stride_kh + row[:, None] * stride_kr + cols[None, :]
    ok = written[:, None] & col_ok[None, :]
    k1 = tl.load(k_at, mask=ok, other=0.0)
    k2 = tl.load(k_at + HALF, mask=ok, other=0.0)
    rope_off = tl.load(rope_off_ptr + seq)
    k1, k2 = _rotate(k1, k2, rope_off + tl.maximum(k_pos, 0), cos_ptr, sin_ptr, cols, col_ok, HALF)
    out_row = p.to(tl.int64) * num_slots + slots
    o_at = out_ptr + kv_head * stride_oh + out_row[:, None] * stride_or + cols[None, :]
    dtype = out_ptr.dtype.element_ty
    tl.store(o_at, k1.to(dtype), mask=col_ok[None, :])
    tl.store(o_at + HALF, k2.to(dtype), mask=col_ok[None, :])
