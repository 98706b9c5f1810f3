"""Attention of a pass's many query rows through bfloat16 matrix products, for the CPU.

Why: on a CPU with AVX512-BF16 (this project's 2-core EPYC; no AMX), oneDNN's bfloat16 products run several times
faster than float32 ones, but torch's fused CPU attention (``scaled_dot_product_attention``'s flash kernel) runs
bfloat16 no faster than float32, so in a bfloat16 Full Recompute attention took most of the forward. Here each small
tile of query rows takes its scores from one bfloat16 ``bmm`` per KV head (its query heads as rows), masked only past
the slots every row of the tile sees, softmax while the tile's scores are still in the cache, then one ``bmm`` with V,
faster than SDPA for such passes (the figures: docs/cpu.md#float32-or-bfloat16).

Numerics are transformers' eager attention in bfloat16: the product rounds the scores to bfloat16 (the scale is
applied to the queries first), the softmax computes in float32 (torch's CPU softmax of bfloat16 equals softmax of the
scores widened, bit for bit) and returns bfloat16 weights for the product with V. Its error against float64 is larger
than SDPA's, which keeps the scores in float32; ``tests/test_gemm_attention.py`` holds it within 0.03 on unit-normal
inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Scores of one tile (query heads x rows x keys) kept under this many, so a tile's scores stay in the cache: larger
# tiles ran slower in a micro-benchmark of a 2K-row pass on one thread.
TILE_SCORES = 1 << 20
# Rows per tile at least (short of it the products are too thin) and at most.
MIN_TILE_ROWS, MAX_TILE_ROWS = 16, 128
# A pass of fewer query rows attends through SDPA (decode steps, a probe's query): the products gain only over many.
MIN_ROWS = 16


@dataclass(frozen=True)
class GemmTile:
    """A tile of a pass's query rows, planned once per forward (every layer reads the same).

    Attributes:
        rows: the query rows (a slice of the pass's ``n``).
        end: the rows attend slots ``[0, end)`` only.
        open: slots ``[0, open)`` are attended by every row of the tile: only ``[open, end)`` is masked.
        hidden: ``[t, end - open]`` bool, True where a row may not attend a slot of ``[open, end)``.
    """

    rows: slice
    end: int
    open: int
    hidden: torch.Tensor


def prefers_gemm(dtype: torch.dtype, device: torch.device, num_rows: int) -> bool:
    """Whether a pass of ``num_rows`` query rows attends here: bfloat16 on the CPU, ``MIN_ROWS`` rows or more."""
    return dtype == torch.bfloat16 and device.type == "cpu" and num_rows >= MIN_ROWS


def tile_rows(num_heads: int, num_keys: int) -> int:
    """Query rows per tile of ``num_heads`` heads over ``num_keys`` keys (``TILE_SCORES``, a multiple of 16)."""
    rows = TILE_SCORES // max(1, num_heads * num_keys) // 16 * 16
    return min(MAX_TILE_ROWS, max(MIN_TILE_ROWS, rows))


def gemm_tiles(
    tiles: tuple[tuple[slice, int], ...], mask: torch.Tensor | None, *, num_heads: int
) -> tuple[GemmTile, ...]:
    """The pass's tiles, each cut to ``tile_rows`` rows, with what each masks.

    Args:
        tiles: ``(rows, end)`` pairs covering the pass's ``n`` rows in order (``TorchGroup.tiles``).
        mask: ``[n, S]`` bool, True where a row may attend a slot; ``None``: a causal run (``n == S``, row ``i``
            attends slots ``0..i``).
        num_heads: query heads (the tile's scores are ``num_heads x rows x end``).
    """
    planned = []
    for rows, end in tiles:
        step = tile_rows(num_heads, end)
        for start in range(rows.start, rows.stop, step):
            stop = min(rows.stop, start + step)
            if mask is None:  # the tile's diagonal block
                block = torch.ones(stop - start, stop - start, dtype=torch.bool)
                planned.append(GemmTile(slice(start, stop), stop, start, block.triu_(1)))
                continue
            hidden = ~mask[start:stop, :end]  # [t, end]
            masked = torch.cat((hidden.any(0), hidden.new_ones(1)))  # (a sentinel: ``end`` when no slot is masked)
            first = int(masked.to(torch.int8).argmax())  # (a host sync, once a forward)
            planned.append(GemmTile(slice(start, stop), end, first, hidden[:, first:]))
    return tuple(planned)


def gemm_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: tuple[GemmTile, ...], *, scaling: float
) -> torch.Tensor:
    """One pass's attention, tile by tile.

    Args:
        q: ``[1, Hq, n, D]`` bfloat16, rotated queries (any strides).
        k, v: ``[1, Hkv, S, D]`` bfloat16, rotated keys and values of the slots read; ``Hq`` a multiple of ``Hkv``
            (query head ``h`` reads KV head ``h // (Hq / Hkv)``).
        tiles: ``gemm_tiles`` of the pass.

    Returns:
        ``[1, Hq, n, D]`` bfloat16. Every row must attend at least one slot (a row with none gives NaN, as SDPA does).
    """
    _, num_q_heads, n, dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    out = q.new_empty(num_kv_heads, group, n, dim)
    for tile in tiles:
        num_rows, end = tile.rows.stop - tile.rows.start, tile.end
        # the scale on the queries (transformers scales the rounded scores; both round once more in bfloat16)
        rows = (q[0, :, tile.rows] * scaling).reshape(num_kv_heads, group * num_rows, dim)  # a KV head's q heads
        scores = torch.bmm(rows, k[0, :, :end].transpose(1, 2)).view(num_kv_heads, group, num_rows, end)
        if tile.open < end:
            scores[..., tile.open :].masked_fill_(tile.hidden, float("-inf"))
        weights = torch.softmax(scores, dim=-1)  # bfloat16 in and out, computed in float32 (as .float() first)
        attended = torch.bmm(weights.view(num_kv_heads, -1, end), v[0, :, :end])  # [Hkv, G * t, D]
        out[:, :, tile.rows] = attended.view(num_kv_heads, group, num_rows, dim)
    return out.view(1, num_q_heads, n, dim)
