"""Which dtype a model runs in (issue 55): ``"auto"`` by the CPU's bfloat16 unit, given each answer the flags' reader
can give; the reason ``pic check`` and ``pic demo`` print; bfloat16 chunks under ids of their own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import pic
from pic.model import dtypes
from pic.model.dtypes import Bf16Unit, choose_dtype, cpu_bf16_unit

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


@pytest.mark.parametrize(
    ("unit", "expected"),
    [(Bf16Unit.AMX, torch.bfloat16), (Bf16Unit.AVX512, torch.bfloat16), (Bf16Unit.NONE, torch.float32)],
)
def test_auto_on_the_cpu_follows_its_bfloat16_unit(unit, expected):
    choice = choose_dtype("auto", CPU, unit=unit)
    assert choice.dtype == expected
    assert choice.reason == (
        f"auto: this CPU has {unit.value}" if unit is not Bf16Unit.NONE else "auto: this CPU has neither AMX-BF16 nor "
        "AVX512-BF16"
    )


def test_the_default_stays_float32_on_the_cpu_and_names_what_auto_would_run():
    assert choose_dtype(None, CPU, unit=Bf16Unit.AVX512).dtype == torch.float32
    assert "dtype='auto' would run bfloat16 (AVX512-BF16)" in choose_dtype(None, CPU, unit=Bf16Unit.AVX512).reason
    assert choose_dtype(None, CPU, unit=Bf16Unit.NONE).reason == dtypes.CPU_DEFAULT_REASON
    assert dtypes.CPU_DEFAULT_REASON.startswith("the CPU's default: ")
    assert choose_dtype(None, CUDA).dtype == choose_dtype("auto", CUDA).dtype == torch.bfloat16


def test_the_cpu_default_is_what_the_grid_in_bfloat16_says():
    """bfloat16 becomes the CPU's default only where every grid cell's answers hold within ``CPU_BF16_MAX_LOSS`` of
    float32's (issue 66's rule), as ``benchmarks/results/dtype_answers.json`` measured them, paired case by case. A
    new run of ``benchmarks/dtype_answers.py`` that holds everywhere fails this test until the default follows it."""
    cells = json.loads((RESULTS / "dtype_answers.json").read_text())["cells"]
    diffs = {(name, row): r["diff"] for name, cell in cells.items() for row, r in cell["rows"].items()}
    assert len(cells) >= 8 and {row for _, row in diffs} >= {"full"}, "the grid's cells in both dtypes"
    holds = min(diffs.values()) >= -dtypes.CPU_BF16_MAX_LOSS
    losing = {key: round(diff, 3) for key, diff in diffs.items() if diff < -dtypes.CPU_BF16_MAX_LOSS}
    assert holds == (dtypes.CPU_DEFAULT == torch.bfloat16), f"cells losing more than the bar in bfloat16: {losing}"
    assert holds or "not within 2 points" in dtypes.CPU_DEFAULT_REASON


def test_names_and_dtypes_asked_for_are_taken_as_they_are():
    for asked in ("float32", "torch.float16", torch.bfloat16):
        assert choose_dtype(asked, CPU, unit=Bf16Unit.NONE).reason == "asked for"
    assert choose_dtype("bfloat16", CPU, unit=Bf16Unit.NONE).dtype == torch.bfloat16
    with pytest.raises(pic.InvalidInputError, match="'float8' is not one of float32, float16, bfloat16, auto"):
        choose_dtype("float8", CPU)


def test_the_flags_reader_answers_from_torch(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True, raising=False)
    assert cpu_bf16_unit() is Bf16Unit.AVX512
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert cpu_bf16_unit() is Bf16Unit.AMX
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    assert cpu_bf16_unit() is Bf16Unit.NONE


@pytest.mark.parametrize("unit", [Bf16Unit.AVX512, Bf16Unit.NONE])
def test_load_auto_runs_the_choice_and_check_says_why(unit, monkeypatch):
    monkeypatch.setattr(dtypes, "cpu_bf16_unit", lambda: unit)
    engine = pic.PIC.from_pretrained(device="cpu", dtype="auto")
    expected = torch.bfloat16 if unit is Bf16Unit.AVX512 else torch.float32
    assert engine.spec.dtype == engine.dtype_choice.dtype == expected
    assert all(p.dtype == expected for p in engine.model.parameters())
    result = pic.check(engine)
    assert result.passed, result.message
    assert f"({engine.dtype_choice.name}, cpu; dtype: {engine.dtype_choice.reason})" in result.message


def test_bfloat16_chunks_have_ids_of_their_own():
    """The same text compiled in float32 and in bfloat16 gets other ids (the model's fingerprint hashes the weights'
    dtype), so a store shared by both never hands one's KV to the other; each chunk's KV is in its model's dtype."""
    wide = pic.PIC.from_pretrained(device="cpu", dtype="float32")
    narrow = pic.PIC.from_pretrained(device="cpu", dtype="bfloat16")
    text = "Tom had a big red ball."
    (wide_id,), (narrow_id,) = wide.compile([text]), narrow.compile([text])
    assert wide.fingerprint != narrow.fingerprint and wide_id != narrow_id
    assert narrow.spec.dtype == torch.bfloat16 and narrow.link([narrow_id], "One day").logits.isfinite().all()
