"""``pic check``: does Full Recompute over this model reproduce the model's own transformers forward?

pic runs a model's layers with its own attention, RoPE tables and KV layout, not transformers' forward; a
model whose config pic misreads (an unknown rope scaling, a new norm, another attention scale) would still
generate fluent text, only not the model's. Full Recompute recomputes every token of the linked prompt, so
it must equal transformers exactly, up to rounding: this check links a few built-in chunks under ``"full"``
and holds pic's logits and greedy tokens to the model's own ``forward`` and ``generate`` over the same ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pic.config import DecodeWeights

if TYPE_CHECKING:
    from pic.engine import PIC

# Short plain-text chunks of different lengths, a prefix and a query: enough to exercise several chunks,
# each with its own BOS, at positions other than the ones they were compiled at.
DOCS = (
    "Tom had a big red ball. He liked to kick it in the park with his dog.",
    "Lily loved to sing. Every morning she sang a happy song for her mom and dad, and they smiled.",
    "The cat sat on the warm mat and looked at the birds.",
)
PREFIX = "Here are three short stories."
QUERY = "One day, Tom and Lily went to"

# Logit tolerance per dtype, relative to the largest |logit| of transformers' own run (at least 1).
# float32: pic and transformers do the same arithmetic in other kernels and summation orders; the tests measure
# differences far below it on the CPU and hold CUDA to 1e-3 (tests/device.py), and a real fault is off by orders of
# magnitude more. Half precision: both sides round to 8 (bfloat16) or 11 (float16) bits at other places (pic rotates K
# in float32, transformers in the model dtype), so each may sit transformers' own rounding error away from the exact
# logits; 0.05 of the largest logit covers twice that error on the models tested.
_RELATIVE_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6, torch.bfloat16: 0.05, torch.float16: 0.02}


@dataclass(frozen=True)
class CheckResult:
    """The outcome of ``check``.

    Attributes:
        model: the model's architecture (``ModelSpec.architecture``), dtype and device, and why that dtype
            (``PIC.dtype_choice``).
        max_abs_logit_diff: the largest ``|pic - transformers|`` over the query positions' logits.
        tolerance: the bound it was held to.
        tokens_equal: pic's greedy tokens are exactly transformers' ``generate`` tokens.
        num_tokens: greedy tokens compared (transformers' count; fewer than asked when it ended at EOS).
        num_equal: the leading tokens on which both agree.
        num_decisive: the steps before transformers' first near-tie, a step whose two best logits are closer
            than ``2 * tolerance``, where an error within the tolerance may flip the choice. Tokens must be
            equal up to there (in float32 on the CPU: all of them, as a rule). With int8 decode weights
            (``PICConfig.decode_weights``) only the first token, the exact link's, is decisive.
        int8_decode: the engine decodes with int8 weights: tokens after the first are approximate.
    """

    model: str
    max_abs_logit_diff: float
    tolerance: float
    tokens_equal: bool
    num_tokens: int
    num_equal: int
    num_decisive: int
    int8_decode: bool = False

    @property
    def passed(self) -> bool:
        return self.max_abs_logit_diff <= self.tolerance and self.num_equal >= min(self.num_decisive, self.num_tokens)

    @property
    def message(self) -> str:
        """One line: the verdict, the model, the largest logit difference against the tolerance, the tokens."""
        verdict = "PASS" if self.passed else "FAIL"
        relation = "<=" if self.max_abs_logit_diff <= self.tolerance else ">"
        if self.tokens_equal:
            tokens = f"greedy tokens {self.num_tokens}/{self.num_tokens} equal"
        elif self.num_equal >= self.num_decisive:
            tokens = f"greedy tokens first differ at step {self.num_equal} of {self.num_tokens}, at or after a near-tie"
        else:
            tokens = f"greedy tokens DIFFER at step {self.num_equal} of {self.num_tokens}"
        if self.int8_decode:
            tokens += " (int8 decode weights: only the first token is exact)"
        return (
            f"{verdict}: Full Recompute vs transformers on {self.model}: max |logit diff| "
            f"{self.max_abs_logit_diff:.3g} {relation} tolerance {self.tolerance:.3g}; {tokens}"
        )

    def __str__(self) -> str:
        return self.message


def check(engine: PIC, *, num_new_tokens: int = 8, tolerance: float | None = None) -> CheckResult:
    """Link the built-in chunks under Full Recompute and compare with the model's own transformers run.

    Compares the logits at every query position with ``model(input_ids).logits`` over ``Linked.input_ids``,
    then ``num_new_tokens`` greedy tokens with ``model.generate`` from the same ids (both stop at the
    engine's EOS ids). The chunks are compiled into the KV pool only: the check writes nothing into the CPU, disk
    or Redis tiers (a server checks its model at every start). The linked request is released.

    Args:
        num_new_tokens: greedy tokens to compare (at least 1).
        tolerance: the largest allowed ``|pic - transformers|`` logit difference; default: the dtype's
            relative tolerance (float32 1e-3, bfloat16 0.05, float16 0.02) times the largest |logit|
            of transformers' run (at least 1).
    """
    if num_new_tokens < 1:
        from pic.errors import InvalidInputError

        raise InvalidInputError(f"num_new_tokens={num_new_tokens}: must be at least 1")
    spec = engine.spec
    ids = engine.compile_report(list(DOCS), lower_tiers=False).ids  # the pool only: nothing into the user's tiers
    linked = engine.link(ids, QUERY, prefix=PREFIX, policy="full")
    with linked:
        logits = linked.logits
        ids = linked.input_ids.to(spec.device)[None]
        generated = linked.generate(max_new_tokens=num_new_tokens).token_ids
    ref_logits, ref_tokens, margins = transformers_run(engine, ids, logits.shape[0], num_new_tokens)
    if tolerance is None:
        scale = max(1.0, ref_logits.abs().max().item())
        tolerance = _RELATIVE_TOLERANCE.get(spec.dtype, 0.05) * scale
    diff = (logits.float() - ref_logits).abs().max().item()
    common = min(len(generated), len(ref_tokens))
    decisive = next((i for i, m in enumerate(margins) if m < 2 * tolerance), len(margins))
    int8_decode = engine.config.decode_weights == DecodeWeights.INT8
    if int8_decode:
        decisive = min(decisive, 1)
    return CheckResult(
        model=f"{spec.architecture} ({engine.dtype_choice.name}, {spec.device}; dtype: {engine.dtype_choice.reason})",
        max_abs_logit_diff=diff,
        tolerance=tolerance,
        tokens_equal=generated == ref_tokens,
        num_tokens=len(ref_tokens),
        num_equal=next((i for i, (a, b) in enumerate(zip(generated, ref_tokens, strict=False)) if a != b), common),
        num_decisive=decisive,
        int8_decode=int8_decode,
    )


def transformers_run(
    engine: PIC, ids: torch.Tensor, num_query: int, num_new_tokens: int
) -> tuple[torch.Tensor, list[int], list[float]]:
    """transformers' own run over ``ids`` ``[1, T]``: its logits at the last ``num_query`` positions (in its
    dtype, as float32), its greedy tokens (stopping at the engine's EOS) and each step's top-2 logit margin."""
    model = engine.model
    eos = sorted(engine.eos_token_ids)
    with torch.no_grad():
        logits = model(ids).logits[0, -num_query:].float()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=num_new_tokens,
            do_sample=False,
            eos_token_id=eos or None,
            pad_token_id=eos[0] if eos else 0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    top2 = torch.stack(out.logits)[:, 0].float().topk(2, dim=-1).values
    return logits, out.sequences[0, ids.shape[1] :].tolist(), (top2[:, 0] - top2[:, 1]).tolist()
