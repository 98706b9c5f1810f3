"""``pic check`` (issue 12): passes on every oracle-test family, fails with a clear message on a broken runner.

The models are the CPU float32 ones of tests/models.py (``make_engine``), whatever the test target: the
check compares pic with transformers on the engine's own device and dtype, so it needs no GPU to be tested.
"""

from __future__ import annotations

import dataclasses

import pytest

import pic
from pic.cli import main
from pic.engine import PIC
from tests.conftest import make_engine
from tests.models import FAMILIES


def break_attention_scale(engine: pic.PIC, factor: float = 0.7) -> pic.PIC:
    """A realistic fault: attention run with the wrong softmax scale (a misread ``head_dim`` or
    ``query_pre_attn_scalar``). Every value stays finite and the text stays fluent; only the check sees it."""
    with engine.paused() as core:
        backend = core.runner.attention_backend
        attend = backend.attend

        def wrong_scale(q, k, v, plan, *, scaling, sliding_window):
            return attend(q, k, v, plan, scaling=scaling * factor, sliding_window=sliding_window)

        backend.attend = wrong_scale
    return engine


@pytest.mark.parametrize("family", FAMILIES)
def test_check_passes_on_every_family(family):
    engine = make_engine(family)
    result = pic.check(engine)
    assert result.passed, result.message
    assert result.tokens_equal and result.num_tokens == result.num_equal == 8
    assert result.max_abs_logit_diff <= 1e-4 < result.tolerance  # CPU float32: the oracle tests' bound holds
    assert str(result).startswith("PASS: ") and f"{result.max_abs_logit_diff:.3g}" in str(result)
    # The request was released; only the compiled chunks stay (unpinned, evictable).
    stats = engine.kv_stats()
    assert stats.num_private_blocks == 0 and stats.num_shared_block_refs == 0
    assert stats.num_resident_chunks == 3


def test_broken_runner_fails():
    result = pic.check(break_attention_scale(make_engine("stories260K")))
    assert not result.passed
    assert result.max_abs_logit_diff > 100 * result.tolerance  # far outside: 2.85 against 0.019
    assert result.message.startswith("FAIL: ") and f"> tolerance {result.tolerance:.3g}" in result.message


def test_differing_tokens_fail_unless_after_a_near_tie():
    """Logits within the tolerance do not suffice: a token that differs before any near-tie fails the check."""
    result = pic.CheckResult(
        model="m",
        max_abs_logit_diff=1e-6,
        tolerance=1e-3,
        tokens_equal=False,
        num_tokens=8,
        num_equal=3,
        num_decisive=8,
    )
    assert not result.passed and "DIFFER at step 3 of 8" in result.message
    near_tie = dataclasses.replace(result, num_decisive=3)  # transformers' step 3 was a near-tie
    assert near_tie.passed and "at or after a near-tie" in near_tie.message


def test_bad_token_count_is_refused():
    with pytest.raises(pic.InvalidInputError, match="num_new_tokens=0"):
        pic.check(make_engine("stories260K"), num_new_tokens=0)


def test_cli_passes_on_the_embedded_model(capsys):
    assert main(["check"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("PASS: Full Recompute vs transformers on LlamaForCausalLM (float32, cpu; dtype: ")
    assert captured.err == ""


def test_cli_fails_on_a_broken_runner(capsys, monkeypatch):
    monkeypatch.setattr(PIC, "from_pretrained", lambda *a, **k: break_attention_scale(make_engine("stories260K")))
    assert main(["check", "--max-new-tokens", "4"]) == 1
    captured = capsys.readouterr()
    assert captured.out.startswith("FAIL: ") and "max |logit diff|" in captured.out and "> tolerance" in captured.out
    assert "the model fails the check" in captured.err and "Traceback" not in captured.err
