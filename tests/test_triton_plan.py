"""The Triton plan's work lists and splits, which take every branch out of the kernel's KV loop, held to
brute force; and kernels that must not visit what the lists leave out (checked through NaN they would read).

Runs in Triton's interpreter on the CPU (``TRITON_INTERPRET=1``, set by conftest), like ``test_triton.py``.
"""

from __future__ import annotations

import os

import pytest
import torch

from pic.attention import AttentionShape, TorchBackend
from tests.attention_cases import make_case, rel_error

triton_backend = pytest.importorskip(
    "pic.attention.triton_backend", reason="needs triton: pip install 'pic-kv[triton]' (.ci/run installs it)"
)
from pic.attention import triton_plan, triton_split  # noqa: E402  (imports Triton)
from tests.compile_kernels import jit_cache_sizes  # noqa: E402

DEVICE = torch.device(os.environ.get("PIC_TEST_DEVICE", "cpu"))


def _random_plan_inputs(gen: torch.Generator, *, num_seqs: int, num_slots: int, block_n: int):
    """Slot positions in random order with holes (-1), and each sequence's queries at random positions."""
    kv_pos = torch.full((num_seqs, num_slots), -1, dtype=torch.int32)
    q_pos, cu = [], [0]
    for b in range(num_seqs):
        length = int(torch.randint(1, num_slots, (1,), generator=gen))
        slots = torch.randperm(num_slots, generator=gen)[:length]
        kv_pos[b, slots] = torch.randperm(length, generator=gen).int()
        queries = torch.randint(0, length, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen)
        q_pos.append(queries.int())
        cu.append(cu[-1] + queries.numel())
    return kv_pos, torch.cat(q_pos), torch.tensor(cu, dtype=torch.int32)


@pytest.mark.parametrize("window", [None, 7])
def test_work_lists_never_skip_a_tile_a_row_attends(window):
    """For shuffled positions with holes: every KV tile holding a slot some query of the tile may attend is
    listed, and no tile is listed twice; the list leads with exactly the whole tiles (every slot written and
    attended by every query of the tile: the kernel reads them unmasked), then the others, each in slot order.
    For single-token tiles (decodes) without a window the lists are exact: a listed tile always holds an
    attended slot."""
    gen = torch.Generator().manual_seed(1)
    block_n, num_whole = 4, 0
    for per_tile in (1, 3):
        kv_pos, q_pos, cu = _random_plan_inputs(gen, num_seqs=5, num_slots=40, block_n=block_n)
        seqs, rows = [], []
        for b in range(5):
            for start in range(int(cu[b]), int(cu[b + 1]), per_tile):
                seqs.append(b)
                rows.append(start)
        seq, row = torch.tensor(seqs, dtype=torch.int32), torch.tensor(rows, dtype=torch.int32)
        spans = triton_plan.tile_spans(kv_pos, block_n=block_n)
        work = triton_plan.work_lists(
            seq, row, per_tile=per_tile, cu_q=cu, q_pos=q_pos, spans=spans, window=window, max_splits=1
        )
        for t, (b, start) in enumerate(zip(seqs, rows, strict=True)):
            listed, whole = work.ids[t, : work.lens[t]].tolist(), int(work.whole[t])
            assert len(set(listed)) == len(listed) and whole <= len(listed)
            assert listed[:whole] == sorted(listed[:whole]) and listed[whole:] == sorted(listed[whole:])
            queries = q_pos[start : min(start + per_tile, int(cu[b + 1]))]
            pos = kv_pos[b].view(-1, block_n)
            may = (pos[None] >= 0) & (pos[None] <= queries[:, None, None])
            if window is not None:
                may &= pos[None] > queries[:, None, None] - window
            needed = may.any(0).any(1).nonzero().flatten().tolist()
            assert set(needed) <= set(listed), (t, needed, listed)
            assert listed[:whole] == may.all(0).all(1).nonzero().flatten().tolist(), (t, whole, listed)
            num_whole += whole
            if per_tile == 1 and window is None:
                assert needed == sorted(listed)
    assert num_whole > 0  # the case has whole tiles


def test_splits_are_never_empty_and_cover_each_list():
    """Split ``s`` of a tile covers list entries ``[s * chunk, min(len, (s + 1) * chunk))``: the tile's
    ``cdiv(len, chunk)`` splits are all non-empty, cover its list, and number at most ``max_splits``."""
    gen = torch.Generator().manual_seed(0)
    kv_pos, q_pos, cu = _random_plan_inputs(gen, num_seqs=6, num_slots=300, block_n=4)
    decode_rows = cu[1:] - 1
    spans = triton_plan.tile_spans(kv_pos, block_n=4)
    for max_splits in (1, 3, 5, 64):
        for min_chunk in (1, 2, triton_split.MIN_TILES_PER_SPLIT):
            work = triton_plan.work_lists(
                torch.arange(6, dtype=torch.int32), decode_rows.int(), per_tile=1, cu_q=cu, q_pos=q_pos, spans=spans,
                window=None, max_splits=max_splits, min_chunk=min_chunk,
            )  # fmt: skip
            num_splits = -(-work.lens // work.chunk)
            assert work.max_splits == max_splits and (num_splits <= max_splits).all()
            assert ((num_splits - 1) * work.chunk < work.lens).all()  # the last split starts inside the list
            assert (num_splits * work.chunk >= work.lens).all()  # and the splits reach its end
            assert (work.chunk >= min_chunk).all()
            balanced = -(-work.lens // max_splits)
            assert (work.chunk == balanced.clamp(min=min_chunk)).all()


def test_split_limit_fills_one_wave():
    """Splits fill the GPU's resident programs without a second, partial wave, of 4 tiles or more each."""
    limit = triton_split.split_limit
    assert limit(num_programs=100, num_kv_tiles=1000, resident=264) == 2  # 300 programs would need 2 waves
    assert limit(num_programs=8, num_kv_tiles=1000, resident=264) == 33
    assert limit(num_programs=1, num_kv_tiles=1000, resident=264) == triton_split.MAX_SPLITS
    assert limit(num_programs=8, num_kv_tiles=20, resident=264) == 5  # 4 tiles per split at least
    assert limit(num_programs=200, num_kv_tiles=1000, resident=264) == 1  # the launch fills the GPU alone
    assert limit(num_programs=0, num_kv_tiles=1000, resident=264) == 1
    for programs in range(1, 300):
        assert programs * limit(num_programs=programs, num_kv_tiles=10**6, resident=264) <= max(264, programs)


def _attend(case, backend, plan, window):
    return backend.attend(case.q, case.k_cache, case.v_cache, plan, scaling=case.scaling, sliding_window=window)


def test_tiles_outside_the_window_are_never_read():
    """A long decode under a sliding window: KV tiles wholly before the window hold NaN, which a visit would
    carry into the output (a zero weight times NaN is NaN). The output equals the reference on clean KV."""
    window, block_n = 24, 16
    case = make_case(seqs=[(200, "decode"), (90, "decode")], num_q_heads=4, num_kv_heads=2, head_dim=16, page=4,
                     device=DEVICE)  # fmt: skip
    reference = TorchBackend(case.shape(window))
    expected = _attend(case, reference, reference.plan(case.batch), window)
    poisoned = case.cast(torch.float32)
    kernel = triton_backend.TritonBackend(poisoned.shape(window), block_n=block_n)
    plan = kernel.plan(case.batch)
    page = case.k_cache.shape[1]
    for b in range(2):
        q = int(case.batch.q_positions[b])
        positions = case.batch.kv_positions[b]
        for tile in range(-(-positions.numel() // block_n)):
            slots = torch.arange(tile * block_n, min((tile + 1) * block_n, positions.numel()), device=DEVICE)
            if int(positions[slots].max()) > q - window:
                continue  # in the window (or after it): visited
            rows = case.batch.block_tables[b][slots // page] * page + slots % page
            for cache in (poisoned.k_cache, poisoned.v_cache):
                cache.view(-1, *cache.shape[2:])[rows] = float("nan")
    assert poisoned.v_cache.isnan().sum() > case.v_cache.isnan().sum()  # some tiles were poisoned
    assert rel_error(_attend(poisoned, kernel, plan, window), expected) <= 1e-3


def test_combine_reads_only_the_splits_that_ran():
    """Decodes of very different lengths under forced splits: the short one runs fewer splits than the launch
    has, and the partials its missing splits would have written hold NaN. The output equals the reference."""
    case = make_case(seqs=[(300, "decode"), (9, "decode"), (70, "decode")], num_q_heads=8, num_kv_heads=2,
                     head_dim=16, page=4, device=DEVICE)  # fmt: skip
    reference = TorchBackend(case.shape())
    expected = _attend(case, reference, reference.plan(case.batch), None)
    c = case.cast(torch.float32)
    kernel = triton_backend.TritonBackend(c.shape(), block_n=16, num_splits=6)
    plan = kernel.plan(c.batch)
    work = plan.decode.work[None]
    assert work.max_splits == 6 and (-(-work.lens // work.chunk)).tolist()[1] < 6
    plan.decode.scratch.acc.fill_(float("nan"))
    plan.decode.scratch.ml.fill_(float("nan"))
    assert rel_error(_attend(c, kernel, plan, None), expected) <= 1e-3


def test_launches_and_rotary_halves():
    """The launch per GPU generation, nothing compiled in the interpreter (and every launch by a compiler: the CUDA
    run), and the rotary table read as one half in the model's dtype, converted once for a static table."""
    shape = AttentionShape(32, 8, 128, torch.float16, (None, 4096))
    cpu = torch.device("cpu")
    hopper = triton_backend.TritonBackend(shape, capability=(9, 0)).launches(cpu)
    ampere = triton_backend.TritonBackend(shape, capability=(8, 0)).launches(cpu)
    assert list(hopper) == ["decode", "prefill 64", "prefill 128", "prefill 128 once", "decode split",
                            "prefill 64 split", "prefill 128 split", "prefill 128 once split"]  # fmt: skip
    assert list(ampere) == ["decode", "prefill 64", "prefill 64 once", "decode split", "prefill 64 split",
                            "prefill 64 once split"]  # fmt: skip
    assert all(launch.split == name.endswith("split") for name, launch in hopper.items())
    assert all(launch.rotated_once == (" once" in name) != launch.rotate_k for name, launch in hopper.items())
    in_loop = triton_backend.TritonBackend(shape, capability=(9, 0), rotate_once=False).launches(cpu)
    assert not any("once" in name for name in in_loop)
    forced = triton_backend.TritonBackend(shape, capability=(9, 0), rotate_once=True).launches(cpu)
    assert {"prefill 64 once", "prefill 64 once split", "prefill 128 once"} <= set(forced)
    assert (hopper["prefill 128"].num_warps, hopper["prefill 128"].block_n) == (8, 64)
    assert (hopper["decode"].block_m, hopper["decode"].num_warps) == (16, 4)
    case = make_case(seqs=[(30, "all"), (12, "decode")], num_q_heads=4, num_kv_heads=2, head_dim=16, page=4)
    c = case.cast(torch.float16)  # on the CPU whatever the test device
    kernel = triton_backend.TritonBackend(c.shape(), capability=(8, 0))
    compiled = kernel.precompile(c.k_cache, c.v_cache)  # the interpreter compiles nothing; a compiler every launch
    if isinstance(triton_backend.paged_attention_kernel, triton_backend.triton.runtime.interpreter.InterpretedFunction):
        assert compiled == []
    else:
        assert {launch.name for launch in compiled} == set(kernel.launches(cpu)) | {"store"}
    first, second = kernel.plan(c.batch), kernel.plan(c.batch)
    assert first.cos.dtype == torch.float16 and first.cos.shape == (c.batch.rope_cos.shape[0], 8)
    assert torch.equal(first.sin.float(), c.batch.rope_sin[:, :8].half().float())
    assert second.cos is first.cos and second.sin is first.sin
    once = triton_backend.TritonBackend(c.shape(), rotate_once=True).plan(c.batch).prefill.rotated  # float32 halves
    assert once.cos.dtype == torch.float32 and torch.equal(once.sin, c.batch.rope_sin[:, :8])


@pytest.mark.skipif(DEVICE.type != "cuda", reason="compiles for the GPU under test")
def test_precompiled_variants_are_the_ones_launched():
    """After ``precompile``, attending a batch of decodes and long recompute passes (the 128-row tile on
    sm_90), split as residency decides, compiles nothing: every launch finds its variant in the JIT's cache."""
    case = make_case(seqs=[(300, "all"), (40, "decode"), (200, "decode")], num_q_heads=8, num_kv_heads=2,
                     head_dim=64, page=16, device=DEVICE)  # fmt: skip
    c = case.cast(torch.bfloat16)
    kernel = triton_backend.TritonBackend(c.shape())
    compiled = kernel.precompile(c.k_cache, c.v_cache)
    assert {launch.name for launch in compiled} >= {"decode", "decode split", "prefill 64", "store"}
    before = jit_cache_sizes()
    plan = kernel.plan(c.batch)
    out = _attend(c, kernel, plan, None)
    assert plan.decode.launch.split and jit_cache_sizes() == before and out.isfinite().all()


def test_launch_configs_come_from_one_table_per_head_dim():
    """``triton_config.LAUNCH_CONFIGS`` sets every launch's KV tile, warps and stages per head dim (a head dim not
    in it takes the next larger row), the ``once`` launches their own row where the table has one, and plans pad
    their slots to a multiple of every KV tile of the row."""
    from pic.attention import triton_config

    cpu = torch.device("cpu")
    assert triton_config.launch_config(100, "decode") == triton_config.LAUNCH_CONFIGS[128]["decode"]
    assert triton_config.launch_config(512, "prefill 64") == triton_config.LAUNCH_CONFIGS[256]["prefill 64"]
    assert triton_config.launch_config(128, "prefill 128 once") == triton_config.LAUNCH_CONFIGS[128]["prefill 128"]
    for head_dim, table in triton_config.LAUNCH_CONFIGS.items():
        launches = triton_backend.TritonBackend(
            AttentionShape(32, 8, head_dim, torch.bfloat16), capability=(9, 0)
        ).launches(cpu)
        assert ("prefill 128" in launches) == (table["prefill 128"] is not None)
        for name, launch in launches.items():
            config = triton_config.launch_config(head_dim, name.removesuffix(" split"))
            assert (launch.block_n, launch.num_warps, launch.num_stages) == (
                config.block_n, config.num_warps, config.num_stages
            ), (head_dim, name)  # fmt: skip
            assert triton_config.slot_step(head_dim) % launch.block_n == 0
    wide = triton_backend.TritonBackend(AttentionShape(32, 8, 64, torch.bfloat16), capability=(9, 0)).launches(cpu)
    assert (wide["prefill 128"].block_n, wide["prefill 128 once"].block_n) == (64, 128)
    c = make_case(seqs=[(300, "all")], num_q_heads=8, num_kv_heads=2, head_dim=64, page=16).cast(torch.float32)
    plan = triton_backend.TritonBackend(c.shape(), capability=(9, 0)).plan(c.batch)  # 10 query tiles of 128 rows
    assert plan.prefill.launch.rotated_once and plan.prefill.launch.block_n == 128
    assert plan.kv_pos.shape[1] % 128 == 0 and plan.prefill.rotated.block == 64
    swept = triton_config.TileConfig(block_n=32, num_warps=4, num_stages=2)  # benchmarks/attention.py --tune
    before = {dim: dict(row) for dim, row in triton_config.LAUNCH_CONFIGS.items()}
    with triton_config.overridden(128, "prefill 128 once", swept), triton_config.overridden(128, "rotate", swept):
        assert (
            triton_backend.TritonBackend(AttentionShape(32, 8, 128, torch.bfloat16), capability=(8, 0))
            .launches(cpu)["prefill 64 once"]
            .block_n
            == triton_config.LAUNCH_CONFIGS[128]["prefill 64"].block_n
        )
        assert triton_config.launch_config(128, "prefill 128 once") == swept
    assert triton_config.LAUNCH_CONFIGS == before
