"""Split-KV (flash-decoding) for the Triton kernel: how many splits a launch takes, and where their partials go.

A launch of ``paged_attention_kernel`` runs one program per (query tile, KV head). When those programs are few
(decodes of a small batch, a link's recompute pass of a few dozen rows over a long context) most SMs idle while
each program walks its whole work list. Splitting each work list across ``s`` programs (grid axis 2) and
merging their partial softmaxes (running max, sum and unnormalized output, ``combine_splits_kernel``) puts
``s`` times the programs on the GPU for a second, small launch. Decodes and recompute passes take the same
rule; the plan decides it once per forward from host data only (rows, heads, slots, SMs): no device sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# A split takes at least this many KV tiles (fewer would cost more to combine than to run).
MIN_TILES_PER_SPLIT = 4
MAX_SPLITS = 64


@dataclass(frozen=True)
class SplitScratch:
    """Where a split launch's programs leave their partial results for ``combine_splits_kernel``.

    Attributes:
        acc: ``[T * Hkv * max_splits * block_m * D_PAD]`` float32, unnormalized outputs.
        ml: ``[T * Hkv * max_splits * 2 * block_m]`` float32, running maxima (log2 units) and sums.
    """

    acc: torch.Tensor
    ml: torch.Tensor

    @classmethod
    def empty(cls, *, num_programs: int, block_m: int, d_pad: int, device: torch.device) -> SplitScratch:
        """Scratch for ``num_programs`` (tile, KV head, split) programs of ``block_m`` rows, ``d_pad`` wide."""
        parts = num_programs * block_m
        return cls(torch.empty(parts * d_pad, device=device), torch.empty(parts * 2, device=device))


def split_limit(*, num_programs: int, num_kv_tiles: int, resident: int) -> int:
    """Splits per query tile for a launch of ``num_programs`` (tile, KV head) programs over at most
    ``num_kv_tiles`` KV tiles each, when ``resident`` programs fit on the GPU at once: as many as fill one wave
    without starting a second (a partial wave costs as much as a full one), none shorter than
    ``MIN_TILES_PER_SPLIT`` tiles; 1 (no split) when the launch alone fills half the GPU or more."""
    if num_programs == 0 or num_programs * 2 > resident:
        return 1
    return max(1, min(resident // num_programs, num_kv_tiles // MIN_TILES_PER_SPLIT, MAX_SPLITS))
