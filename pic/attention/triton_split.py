"""Split-KV (flash-decoding) for the Triton kernel: how many splits a launch takes, and where their partials go.

A launch of ``paged_attention_kernel`` runs one program per (query tile, KV head). When those programs are few
(decodes of a small batch, a link's recompute pass of a few dozen rows over a long context) most SMs idle while
each program walks its whole work list. Splitting each work list across ``s`` programs (grid axis 2) and
merging their partial softmaxes (running max, sum and unnormalized output, ``combine_splits_kernel``) puts
``s`` times the programs on the GPU for a second, small launch (``split_limit``: to fill one wave for decodes, to
balance waves for recompute passes). The plan decides it once per forward from host data only (rows, heads,
slots, SMs): no device sync.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pic.attention.backend import SCRATCH_FIELD

# A split takes at least this many KV tiles (fewer would cost more to combine than to run).
MIN_TILES_PER_SPLIT = 4
MAX_SPLITS = 64
# What one more program of a split costs beside its KV tiles, in KV tiles: loading and rotating its queries, writing
# its partials (128 x 128 float32: 64 KB, two tiles' K and V) and the combine reading them back. An estimate; the
# GPU run's forced splits (benchmarks/attention.py, pic_splits_*) say whether it is right.
SPLIT_COST_TILES = 8


@dataclass(frozen=True)
class SplitScratch:
    """Where a split launch's programs leave their partial results for ``combine_splits_kernel``.

    Attributes:
        acc: ``[T * Hkv * max_splits * block_m * D_PAD]`` float32, unnormalized outputs.
        ml: ``[T * Hkv * max_splits * 2 * block_m]`` float32, running maxima (log2 units) and sums.
    """

    acc: torch.Tensor = field(metadata=SCRATCH_FIELD)
    ml: torch.Tensor = field(metadata=SCRATCH_FIELD)

    @classmethod
    def empty(cls, *, num_programs: int, block_m: int, d_pad: int, device: torch.device) -> SplitScratch:
        """Scratch for ``num_programs`` (tile, KV head, split) programs of ``block_m`` rows, ``d_pad`` wide."""
        parts = num_programs * block_m
        return cls(torch.empty(parts * d_pad, device=device), torch.empty(parts * 2, device=device))


def split_limit(*, num_programs: int, num_kv_tiles: int, resident: int, balance_waves: bool = False) -> int:
    """Splits per query tile for a launch of ``num_programs`` (tile, KV head) programs over at most
    ``num_kv_tiles`` KV tiles each, when ``resident`` programs fit on the GPU at once; none shorter than
    ``MIN_TILES_PER_SPLIT`` tiles, at most ``MAX_SPLITS``.

    Decodes (memory-bound: programs past a first wave share its bandwidth) split only to fill one wave without
    starting a second, and not at all when the launch alone fills half the GPU. A recompute pass's programs
    (``balance_waves``: compute-bound, one 128-row program per SM) run in waves, a partial last wave as long as a
    full one: 136 programs on 132 SMs take two. So the split is the one with the least modelled time, waves x (KV
    tiles per split + ``SPLIT_COST_TILES``), every program taken as long as the longest."""
    most = max(1, min(num_kv_tiles // MIN_TILES_PER_SPLIT, MAX_SPLITS))
    if num_programs == 0 or resident == 0:
        return 1
    if not balance_waves:
        return 1 if num_programs * 2 > resident else min(resident // num_programs, most)

    def modelled(splits: int) -> float:
        waves = -(-num_programs * splits // resident)
        return waves * (num_kv_tiles / splits + SPLIT_COST_TILES)

    return min(range(1, most + 1), key=modelled)
