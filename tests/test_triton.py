"""The Triton fused-RoPE paged kernel against the torch reference computed in float64.

On the CPU (CI) the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest before
Triton is imported); with ``PIC_TEST_DEVICE=cuda`` the same tests compile and run them on the GPU, in
bfloat16 too. Errors are ``||out - ref|| / ||ref||`` against the reference in float64 on the same inputs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pic
from pic.attention import AttentionShape, TorchBackend, apply_rope, select_backend
from tests.attention_cases import make_case, rel_error, rope_table
from tests.child import child_env
from tests.conftest import make_target_engine
from tests.models import DOCS, PREFIX, QUERY

triton_backend = pytest.importorskip(
    "pic.attention.triton_backend", reason="needs triton: pip install 'pic-kv[triton]' (.ci/run installs it)"
)

DEVICE = torch.device(os.environ.get("PIC_TEST_DEVICE", "cpu"))
# Relative error bounds per dtype (the acceptance bounds).
TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 1e-2}
# The interpreter mishandles bfloat16 loads: bfloat16 is checked on a GPU only.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])

# (num_q_heads, num_kv_heads, head_dim, page): MHA, GQA 4 and 3 (not a power of two), MQA 7; head dims
# 8 (padded to the 16 a dot needs), 24 (halves of 12: padded columns), 32; pages of 1, 4, 16 slots.
SHAPES = [(4, 4, 8, 1), (8, 2, 16, 4), (6, 2, 24, 16), (7, 1, 32, 4)]
SEQS = [(23, "all"), (19, "subset"), (30, "decode"), (5, "decode"), (3, "subset")]


def _check(case, dtype, *, window=None, **kernel_options) -> float:
    reference = TorchBackend(case.shape(window))
    expected = reference.attend(
        case.q, case.k_cache, case.v_cache, reference.plan(case.batch), scaling=case.scaling, sliding_window=window
    )
    c = case.cast(dtype)
    kernel = triton_backend.TritonBackend(c.shape(window), **kernel_options)
    out = kernel.attend(c.q, c.k_cache, c.v_cache, kernel.plan(c.batch), scaling=c.scaling, sliding_window=window)
    assert out.dtype == dtype and out.shape == case.q.shape
    error = rel_error(out, expected)
    assert error <= TOLERANCE[dtype], (dtype, error)
    return error


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_equals_reference(shape, dtype):
    """Five sequences in one launch pair (prefill passes over all or a subset of tokens, decodes), each in
    shuffled blocks with front padding, a trailing unwritten block and NaN everywhere else; KV tiles
    smaller than a sequence, so the online softmax runs over several tiles."""
    num_q_heads, num_kv_heads, head_dim, page = shape
    case = make_case(
        seqs=SEQS, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, page=page, device=DEVICE
    )
    _check(case, dtype, block_n=16, prefill_block_m=16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [None, 6])
def test_window_splits_and_shuffled_positions(window, num_splits, dtype):
    """Sliding window, flash-decoding splits (some splits see no allowed slot, some no slot at all) and
    slots whose positions are not in slot order (a linked request's are not)."""
    case = make_case(seqs=SEQS, num_q_heads=8, num_kv_heads=2, head_dim=16, page=4, shuffled=True, device=DEVICE)
    _check(case, dtype, window=window, block_n=16, prefill_block_m=16, num_splits=num_splits)


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic"])
def test_rope_types(rope_type):
    """A static scaled table and a dynamic type (one table per sequence, read at its row offset)."""
    case = make_case(seqs=SEQS, num_q_heads=4, num_kv_heads=2, head_dim=16, page=4, rope_type=rope_type, device=DEVICE)
    assert case.batch.rope_offsets.any() == (rope_type == "dynamic")
    _check(case, torch.float32, block_n=32)


def test_default_tiles():
    """The defaults the engine uses (64-slot tiles, 64-row prefill tiles, splits by occupancy)."""
    case = make_case(seqs=[(150, "all"), (90, "decode")], num_q_heads=4, num_kv_heads=2, head_dim=16, page=16,
                     device=DEVICE)  # fmt: skip
    _check(case, torch.float32)


def test_store_kernel_writes_only_its_rows():
    k_rows = torch.zeros(40, 2, 8, device=DEVICE)
    v_rows = torch.zeros(40, 2, 8, device=DEVICE)
    rows = torch.tensor([5, 17, 3, 39], device=DEVICE)
    k, v = torch.randn(4, 2, 8, device=DEVICE), torch.randn(4, 2, 8, device=DEVICE)
    triton_backend.TritonBackend(AttentionShape(2, 2, 8, torch.float32)).store(k_rows, v_rows, rows, k, v)
    expected_k, expected_v = torch.zeros_like(k_rows), torch.zeros_like(v_rows)
    expected_k[rows], expected_v[rows] = k, v
    assert torch.equal(k_rows, expected_k) and torch.equal(v_rows, expected_v)


def test_backend_selection(monkeypatch):
    """What each request gets on the CPU, with Triton's interpreter and without it, whichever mode this run's
    kernels were compiled in (``select_backend`` reads ``TRITON_INTERPRET`` when asked; it compiles nothing)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cpu = torch.device("cpu")
    rope = rope_table(16, 8, "default", cpu)
    shape, wide = AttentionShape(4, 2, 16, torch.float32), AttentionShape(4, 2, 32, torch.float32)
    assert isinstance(select_backend("auto", shape, device=cpu, rope=rope), TorchBackend)
    assert isinstance(select_backend("torch", shape, device=cpu, rope=rope), TorchBackend)
    chosen = select_backend("triton", shape, device=cpu, rope=rope)  # the interpreter
    assert isinstance(chosen, triton_backend.TritonBackend) and chosen.name == "triton" and chosen.shape == shape
    with pytest.raises(pic.PicError, match="attention_backend='triton'.*head_dim=32 with a rotary table 16 wide"):
        select_backend("triton", wide, device=cpu, rope=rope)
    rope.halves_equal = False  # e.g. an interleaved (GPT-J) layout
    with pytest.raises(pic.PicError, match="attention_backend='triton'.*halves are not equal"):
        select_backend("triton", shape, device=cpu, rope=rope)
    rope.halves_equal = True
    monkeypatch.delenv("TRITON_INTERPRET")  # as on a GPU machine: Triton on the CPU is refused
    with pytest.raises(pic.PicError, match="attention_backend='triton'.*TRITON_INTERPRET=1"):
        select_backend("triton", shape, device=cpu, rope=rope)
    with pytest.raises(pic.PicError, match="attention_backend='flash'"):
        pic.PICConfig(attention_backend="flash")


@pytest.mark.parametrize("family", ["stories260K", "mistral", "qwen3"])
def test_engine_on_the_kernel_equals_the_reference(family):
    """The whole engine on the Triton backend: logits of a Full Recompute link and a batch of linked
    generations (recompute passes and decodes in shared forwards, CacheBlend dropping tokens, InfoFlow's probe
    leaving the forward before its last layers) give the reference backend's tokens. Mistral has a sliding window,
    Qwen3 q/k norms and head_dim 32. Float32 on every device: batch shapes must not flip a greedy tie between the
    backends."""
    outputs = {}
    for backend in ("torch", "triton"):
        engine = make_target_engine(family, dtype=torch.float32, attention_backend=backend)
        assert engine.attention_backend == backend
        ids = engine.compile(list(DOCS))
        logits = engine.link(ids, QUERY, prefix=PREFIX, policy="full").logits
        requests = [
            pic.Request(cache_ids=ids[::step], query=QUERY, policy=policy, max_new_tokens=6)
            for step, policy in ((1, "legolink:4"), (-1, "mepic"), (2, "cacheblend:0.3"), (1, "infoflow:0.3"))
        ]
        tokens = [g.token_ids for g in engine.generate_many(requests)]
        outputs[backend] = (logits, tokens)
    (ref_logits, ref_tokens), (logits, tokens) = outputs["torch"], outputs["triton"]
    assert (logits - ref_logits).abs().max() <= 1e-3 * ref_logits.abs().max()
    assert tokens == ref_tokens


@pytest.mark.parametrize("arch", [90, 80])
def test_kernels_compile_as_launched_pipelined_without_spills(arch):
    """Triton's compiler (no GPU needed) builds every variant the engine launches for a Mistral-7B shape in
    bfloat16 (with and without its 4096 window), through ``TritonBackend.precompile``, i.e. with the launch's
    own specialization, for H100 (sm_90) and A100 (sm_80). None spills registers; every attention kernel's
    KV loop is software-pipelined (``cp.async`` copies in flight); a decode program leaves room for at least
    two per SM; the 128-row prefill tile is launched on sm_90 only; every launch also has its split variant, with
    ``combine_splits_kernel``. And batches unlike precompile's (other
    sizes, contexts and split counts) compile nothing more: no request waits on the compiler."""
    env = child_env()  # the parent's import path: the GPU run's pydantic is in /tmp/site
    env.pop("TRITON_INTERPRET", None)
    script = Path(__file__).with_name("compile_kernels.py")
    run = subprocess.run([sys.executable, str(script), "--arch", str(arch)], capture_output=True, text=True, env=env,
                         timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    *reports, after = [json.loads(line) for line in run.stdout.splitlines()]
    assert after == {"compiled_after_precompile": {"paged_attention_kernel": 0, "combine_splits_kernel": 0}}
    launches = {(r["launch"], r["window"]) for r in reports}
    prefill = ["prefill 64", "prefill 128"] if arch == 90 else ["prefill 64"]
    names = ["decode", *prefill] + [f"{name} split" for name in ("decode", *prefill)]
    assert launches == {(n, w) for n in names for w in (False, True)} | {("store", False)}, launches
    assert all(r["stack"] == 0 and r["registers"] <= 255 for r in reports), reports
    attention = [r for r in reports if r["kernel"] == "paged_attention_kernel"]
    assert all(r["async_copies"] > 0 and r["max_wait_group"] >= 1 for r in attention), attention
    assert all(r["blocks_per_sm"] >= 2 for r in attention if r["launch"].startswith("decode")), attention
    assert {r["triton"] for r in reports} == {triton_backend.triton.__version__}  # the version read with


def test_a_child_python_imports_what_its_parent_can(tmp_path, monkeypatch):
    """A package the parent imports from a path added at run time (the GPU run's ``/tmp/site``) imports in the
    subprocesses the tests start (``child_env``), from any working directory: the H100 run's compile test could
    not import pydantic, given only the checkout as ``PYTHONPATH``."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "only_on_the_parents_path.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(site))
    code = "import only_on_the_parents_path as m, pic; print(m.VALUE)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(), cwd=tmp_path)
    assert run.returncode == 0 and run.stdout.strip() == "7", run.stderr[-2000:]


def test_engine_precompiles_its_kernels_at_start(monkeypatch):
    """Building an engine on the Triton backend hands the backend one layer of its KV cache to compile every
    variant before the first request (in the interpreter there is nothing to compile)."""
    calls = []
    original = triton_backend.TritonBackend.precompile

    def record(self, k_cache, v_cache):
        calls.append((k_cache.shape, v_cache.shape, k_cache.dtype))
        return original(self, k_cache, v_cache)

    monkeypatch.setattr(triton_backend.TritonBackend, "precompile", record)
    engine = make_target_engine("stories260K", dtype=torch.float32, attention_backend="triton")
    spec = engine.spec
    ((k_shape, v_shape, dtype),) = calls
    assert k_shape == v_shape and k_shape[1:] == (engine.config.block_size, spec.num_kv_heads, spec.head_dim)
    assert dtype == torch.float32 and k_shape[0] > 1


def test_kernel_over_pre_rotated_k_only_pages():
    """``k_is_rotated`` (benchmarks: paging without rotation): over a cache holding each written slot's K
    rotated at its position, the kernel gives what it gives over NoPE K."""
    case = make_case(seqs=SEQS, num_q_heads=8, num_kv_heads=2, head_dim=16, page=4, shuffled=True, device=DEVICE)
    batch, page = case.batch, case.k_cache.shape[1]
    rotated = case.k_cache.clone()
    for b in range(batch.kv_positions.shape[0]):
        positions = batch.kv_positions[b]
        slots = (positions >= 0).nonzero().flatten()
        rows = batch.block_tables[b][slots // page] * page + slots % page
        at = batch.rope_offsets[b] + positions[slots]
        k = rotated.view(-1, *rotated.shape[2:])[rows]  # [n, Hkv, D]
        cos, sin = batch.rope_cos[at].double(), batch.rope_sin[at].double()
        rotated.view(-1, *rotated.shape[2:])[rows] = apply_rope(k, cos, sin)
    c = case.cast(torch.float32)
    nope = triton_backend.TritonBackend(c.shape(), block_n=16)
    paging = triton_backend.TritonBackend(c.shape(), block_n=16, k_is_rotated=True)
    expected = nope.attend(c.q, c.k_cache, c.v_cache, nope.plan(c.batch), scaling=c.scaling, sliding_window=None)
    k_rot = rotated.float()
    out = paging.attend(c.q, k_rot, c.v_cache, paging.plan(c.batch), scaling=c.scaling, sliding_window=None)
    assert rel_error(out, expected) <= 1e-5
