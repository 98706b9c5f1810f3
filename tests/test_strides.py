"""The attention backends given the strides CUDA hands them, on the CPU.

On CUDA, SDPA's flash and memory-efficient kernels return their output laid out ``[b, n, h, d]`` in memory (a
transposed view of ``[b, h, n, d]``), and a layer's queries may be a slice of a fused projection or a transpose.
The CPU's SDPA returns a contiguous output for contiguous inputs, so CPU tests never met those strides, and the
first H100 run failed in the reference decode path (``reference.py``, ``out.view``) and in the kept-KV path
(``kept_kv.py``, ``attended.view``). Here SDPA's output is given CUDA's layout (the same values, ``sdpa_as_on_cuda``)
and the queries ``.t()``- and slice-made strides; each output must equal the contiguous run's bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pic.attention import AttentionShape, TorchBackend, make_batch
from tests.attention_cases import make_case, rope_table

SEQS = [(30, "decode"), (5, "decode"), (23, "all"), (19, "subset")]
_SDPA = F.scaled_dot_product_attention


def _cuda_layout(*args, **kwargs) -> torch.Tensor:
    """SDPA's output ``[b, h, n, d]`` laid out as CUDA's flash and memory-efficient kernels lay it out: ``[b, n, h, d]``
    in memory (``stride(1) == d``, ``stride(2) == h * d``), the same values."""
    out = _SDPA(*args, **kwargs)
    return out.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.fixture
def sdpa_as_on_cuda(monkeypatch):
    monkeypatch.setattr(F, "scaled_dot_product_attention", _cuda_layout)


def _attend(backend, case, q, plan, window):
    return backend.attend(q, case.k_cache, case.v_cache, plan, scaling=case.scaling, sliding_window=window)


def strided_like(q: torch.Tensor, how: str) -> torch.Tensor:
    """``q`` ``[N, H, D]`` (same values) with the strides ``how`` names: ``"t"``, a transpose of ``[N, D, H]`` memory
    (``.t()``-made); ``"slice"``, the first third of a fused ``[N, 3 * H * D]`` projection; ``"contiguous"``."""
    if how == "t":
        return q.transpose(1, 2).contiguous().transpose(1, 2)
    if how == "slice":
        fused = torch.cat((q.flatten(1), torch.zeros_like(q.flatten(1)).repeat(1, 2)), dim=1)
        return fused[:, : q[0].numel()].view(q.shape)
    return q


@pytest.mark.parametrize("window", [None, 6])
def test_reference_decodes_and_passes_take_cuda_strides(window, sdpa_as_on_cuda):
    """Two decoding sequences (the gathered group: one SDPA call with each KV head's query heads as rows) and two
    recompute passes, over SDPA outputs in CUDA's layout and queries of every stride."""
    case = make_case(seqs=SEQS, num_q_heads=8, num_kv_heads=2, head_dim=16, page=4).cast(torch.float32)
    backend = TorchBackend(case.shape(window))
    plan = backend.plan(case.batch)
    assert plan.decode is not None and not plan.decode.kept  # the gathered decode group, not KeptKV
    with pytest.MonkeyPatch.context() as m:
        m.setattr(F, "scaled_dot_product_attention", _SDPA)
        expected = _attend(backend, case, case.q, plan, window)
    for how in ("contiguous", "t", "slice"):
        assert torch.equal(_attend(backend, case, strided_like(case.q, how), plan, window), expected), how


@pytest.mark.parametrize("window", [None, 6])
def test_kept_kv_decode_takes_cuda_strides(window, sdpa_as_on_cuda):
    """One decoding sequence with its KV kept between steps (``KeptKV``: SDPA over views of its buffers)."""
    hq, hkv, dim, page = 8, 2, 16, 4
    rope = rope_table(dim, 64, "default", "cpu")
    backend = TorchBackend(AttentionShape(hq, hkv, dim, torch.float32, (window,)))
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(12, page, hkv, dim, generator=gen) for _ in range(2))
    table, positions = torch.tensor([3, 9, 1, 7, 5, 11]), torch.full((24,), -1)
    positions[1:20] = torch.arange(19)
    q = torch.randn(1, hq, dim, generator=gen)
    outputs = {}
    for name, scratch in (("kept", [{}]), ("gathered", [])):
        batch = make_batch(block_tables=[table], kv_positions=[positions], q_positions=torch.tensor([18]),
                           seq_lens=[1], rope=rope, scratch=scratch)  # fmt: skip
        plan = backend.plan(batch)
        assert bool(plan.decode.kept) == (name == "kept")
        outputs[name] = [
            backend.attend(strided_like(q, how), k_cache, v_cache, plan, scaling=dim**-0.5, sliding_window=window)
            for how in ("contiguous", "t", "slice")
        ]
    assert all(torch.equal(out, outputs["kept"][0]) for out in outputs["kept"] + outputs["gathered"])
