"""Split-KV for recompute passes: a link's few query rows over a long context spread over the GPU, each query tile's
work list split across programs and merged by ``combine_splits_kernel``, against the float64 reference.

In Triton's interpreter on the CPU (``TRITON_INTERPRET=1``, set by conftest) with small head counts and dims, so
that 16K keys stay within seconds; on CUDA (``PIC_TEST_DEVICE=cuda``) the same cases in bfloat16 too. The plan
is given an H100's 132 SMs and sm_90 (``num_sms``, ``capability``), so it splits here exactly as it would there.
"""

from __future__ import annotations

import os

import pytest
import torch

from pic.attention import AttentionShape, TorchBackend, make_batch
from tests.attention_cases import make_case, rel_error, rope_table

triton_backend = pytest.importorskip(
    "pic.attention.triton_backend", reason="needs triton: pip install 'pic-kv[triton]' (.ci/run installs it)"
)
from pic.attention import triton_split  # noqa: E402  (imports Triton)

DEVICE = torch.device(os.environ.get("PIC_TEST_DEVICE", "cpu"))
TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 1e-2}  # as tests/test_triton.py
# The interpreter mishandles bfloat16 loads: bfloat16 on a GPU only, where float32 runs in the tests below (each
# dtype compiles its own variants, and the GPU run has one device call for everything).
DTYPES = [torch.bfloat16, torch.float16] if DEVICE.type == "cuda" else [torch.float32, torch.float16]
H100 = dict(capability=(9, 0), num_sms=132)


def _check(case, dtype, window, **options) -> triton_backend.TritonPlan:
    """The kernel's output on ``case`` in ``dtype`` against the float64 reference; returns its plan."""
    reference = TorchBackend(case.shape(window))
    expected = reference.attend(
        case.q, case.k_cache, case.v_cache, reference.plan(case.batch), scaling=case.scaling, sliding_window=window
    )
    c = case.cast(dtype)
    kernel = triton_backend.TritonBackend(c.shape(window), **options)
    plan = kernel.plan(c.batch)
    out = kernel.attend(c.q, c.k_cache, c.v_cache, plan, scaling=c.scaling, sliding_window=window)
    error = rel_error(out, expected)
    assert error <= TOLERANCE[dtype], (dtype, error)
    return plan


# (query rows, keys, window): a decode, link-sized passes, 544 rows (a 32-chunk link's chunk heads and query).
# In the interpreter a quarter of the keys: the plan splits them the same way (checked below), and the suite keeps
# to its minutes (16K keys cost 10-17 s a case there); the GPU run takes the full lengths.
LONG = 1 if DEVICE.type == "cuda" else 4
CASES = [(1, 16384, None), (16, 4096, None), (32, 16384, None), (32, 16384, 1000), (64, 4096, 300), (544, 4096, None)]
CASES = [(rows, keys // LONG, window) for rows, keys, window in CASES]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, keys, window", CASES)
def test_split_passes_equal_the_reference(rows, keys, window, dtype):
    """GQA 4 (4 query heads per KV head, 2 KV heads), head_dim 16: every pass here leaves an H100 mostly idle,
    so the plan splits it (a decode too), and the merged output equals the float64 reference."""
    case = make_case(seqs=[(keys, rows)], num_q_heads=8, num_kv_heads=2, head_dim=16, page=16, device=DEVICE)
    plan = _check(case, dtype, window, **H100)
    tiles = plan.decode if rows == 1 else plan.prefill
    assert tiles.launch.split and tiles.work[window].max_splits > 1, tiles.work[window].max_splits


@pytest.mark.slow
@pytest.mark.parametrize("window", [None, 4096 // LONG])
def test_a_long_link_pass_splits_and_equals_the_reference(window):
    """544 rows over 16K keys (4K in the interpreter), GQA 2 and two passes beside a decode in one batch."""
    seqs = [(16384 // LONG, 544), (3000 // LONG, 40), (5000 // LONG, "decode")]
    case = make_case(seqs=seqs, num_q_heads=4, num_kv_heads=2, head_dim=16, page=16, shuffled=True, device=DEVICE)
    plan = _check(case, torch.float32, window, **H100)
    assert plan.prefill.launch.split and plan.decode.launch.split


@pytest.mark.parametrize("rotate_once", [False, True] if DEVICE.type == "cpu" else [False])
@pytest.mark.parametrize("window", [None, 6])
def test_forced_prefill_splits_with_shuffled_positions(window, rotate_once):
    """``prefill_splits`` asked for: splits of one KV tile over shuffled positions (some splits see no allowed
    slot, some tiles fewer splits than the launch has); their partials start as NaN, never read. K rotated in the
    loop or once per layer (each split reads the same rotated rows)."""
    seqs = [(23, "all"), (19, "subset"), (30, "decode"), (90, 7)]
    case = make_case(seqs=seqs, num_q_heads=8, num_kv_heads=2, head_dim=16, page=4, shuffled=True, device=DEVICE)
    c = case.cast(torch.float32)
    kernel = triton_backend.TritonBackend(c.shape(window), block_n=16, prefill_block_m=16, prefill_splits=5,
                                          rotate_once=rotate_once)  # fmt: skip
    plan = kernel.plan(c.batch)
    assert plan.prefill.launch.split and not plan.decode.launch.split
    assert plan.prefill.launch.rotated_once == rotate_once and not plan.decode.launch.rotated_once
    plan.prefill.scratch.acc.fill_(float("nan"))
    plan.prefill.scratch.ml.fill_(float("nan"))
    reference = TorchBackend(case.shape(window))
    expected = reference.attend(
        case.q, case.k_cache, case.v_cache, reference.plan(case.batch), scaling=case.scaling, sliding_window=window
    )
    out = kernel.attend(c.q, c.k_cache, c.v_cache, plan, scaling=c.scaling, sliding_window=window)
    assert rel_error(out, expected) <= TOLERANCE[torch.float32]


def _mistral_plan(keys: int, rows: int, **options) -> triton_backend.TritonPlan:
    """The plan of one recompute pass of ``rows`` query rows (the last positions) over ``keys`` slots, for
    Mistral-7B's attention (32 query heads, 8 KV heads, head_dim 128, bfloat16) on an H100 (132 SMs, sm_90)."""
    page = 16
    rope = rope_table(128, keys + 1, "default", "cpu")
    batch = make_batch(
        block_tables=[torch.randperm(keys // page)],
        kv_positions=[torch.arange(keys)],
        q_positions=torch.arange(keys - rows, keys),
        seq_lens=[rows],
        rope=rope,
    )
    return triton_backend.TritonBackend(AttentionShape(32, 8, 128, torch.bfloat16), **H100, **options).plan(batch)


def test_the_plan_splits_a_link_and_not_a_prefill():
    """On an H100, a link's 32 rows over 16K keys are 1 tile of 128 rows (32 tokens x 4 query heads) x 8 KV heads:
    8 programs for 132 SMs. The plan splits each work list 16 ways (132 resident 128-row programs, one per SM),
    each split 16 KV tiles of 64 slots. A 4K-row prefill (128 tiles x 8 heads = 1024 programs, 8 waves) runs
    unsplit. 544 rows (17 x 8 = 136 programs: two waves, the second of 4) split 6 ways: 7 waves of 43 tiles."""
    link = _mistral_plan(16384, 32).prefill
    assert link.launch.block_m == 128 and link.num_tiles == 1 and link.launch.split
    work = link.work[None]
    assert work.max_splits == 16 and work.chunk.tolist() == [16] and work.lens.tolist() == [256]
    assert link.scratch.acc.numel() == 1 * 8 * 16 * 128 * 128
    prefill = _mistral_plan(4096, 4096).prefill
    assert prefill.num_tiles == 128 and not prefill.launch.split and prefill.work[None].max_splits == 1
    assert prefill.scratch is None
    chunk_heads = _mistral_plan(16384, 544).prefill
    assert chunk_heads.num_tiles == 17 and chunk_heads.launch.split and chunk_heads.work[None].max_splits == 6


def test_split_limits_by_waves_for_passes_and_by_one_wave_for_decodes():
    """A recompute pass's split balances waves of compute-bound programs (``balance_waves``); a decode's fills one
    wave. 132 resident programs, 256 KV tiles (16K slots of 64) unless said."""
    limit = triton_split.split_limit
    cost = triton_split.SPLIT_COST_TILES
    assert limit(num_programs=8, num_kv_tiles=256, resident=132, balance_waves=True) == 16  # one wave, as a decode
    assert limit(num_programs=8, num_kv_tiles=256, resident=132) == 16
    assert limit(num_programs=128, num_kv_tiles=256, resident=132, balance_waves=True) == 1  # one full wave
    assert limit(num_programs=1024, num_kv_tiles=64, resident=132, balance_waves=True) == 1
    assert 2 * (256 + cost) > 7 * (256 / 6 + cost)  # 136 programs: 2 waves unsplit, 7 waves of a sixth each
    assert limit(num_programs=136, num_kv_tiles=256, resident=132, balance_waves=True) == 6
    assert limit(num_programs=136, num_kv_tiles=256, resident=132) == 1  # a decode: bandwidth is shared anyway
    assert limit(num_programs=2, num_kv_tiles=256, resident=132, balance_waves=True) == triton_split.MAX_SPLITS
    assert limit(num_programs=2, num_kv_tiles=20, resident=132, balance_waves=True) == 5  # 4 tiles per split
    assert limit(num_programs=8, num_kv_tiles=256, resident=0, balance_waves=True) == 1  # no GPU to fill


def test_the_plan_rotates_k_once_for_passes_of_many_query_tiles():
    """On an H100 with Mistral-7B's heads (a 128-row tile is 32 query tokens x 4 heads): a pass of 4 query tiles or
    more per sequence reads its K rotated once per layer (each of its tiles would rotate every KV tile it visits
    again in the loop): 128, 512 and 544 rows over 16K keys (the 544 split as before); 32 and 96 rows rotate in the
    loop (one and three tiles), decodes always. ``rotate_once`` forces either way; the rows are one layer's K of the
    pass (16K slots x 8 heads x 128, bfloat16: 32 MiB)."""
    for rows, once in ((32, False), (96, False), (128, True), (512, True), (544, True)):
        plan = _mistral_plan(16384, rows)
        assert plan.prefill.launch.rotated_once == once and (plan.prefill.rotated is not None) == once, rows
        assert plan.prefill.launch.rotate_k != once and not plan.decode.launch.rotated_once
    rotated = _mistral_plan(16384, 512).prefill.rotated
    assert rotated.rows.shape == (16384, 8, 128) and rotated.rows.dtype == torch.bfloat16
    assert rotated.cos.dtype == torch.float32 and rotated.block == 64
    heads = _mistral_plan(16384, 544).prefill
    assert heads.launch.split and heads.work[None].max_splits == 6
    assert not _mistral_plan(16384, 512, rotate_once=False).prefill.launch.rotated_once
    assert _mistral_plan(16384, 32, rotate_once=True).prefill.launch.rotated_once
