"""Sampling options and the choice of the next token."""

from __future__ import annotations

import torch
from pydantic import Field, field_validator

from pic.config import _Frozen, as_tuple


class SamplingParams(_Frozen):
    """Options of ``Linked.generate`` / ``Linked.stream``.

    Numbers are validated strictly (``max_new_tokens="10"`` and ``temperature=float("inf")`` are
    ``InvalidInputError``s).

    Attributes:
        max_new_tokens: most tokens to generate.
        temperature: 0 is greedy (argmax); otherwise logits are divided by it before sampling.
        top_p: nucleus sampling: keep the smallest set of tokens whose probability reaches ``top_p``.
        top_k: keep the ``top_k`` most likely tokens (0: all).
        seed: seeds a private generator, so equal seeds give equal samples (``0 <= seed < 2**64``).
        stop: strings that end the generation; the text stops before the first one.
    """

    max_new_tokens: int = Field(default=64, ge=0)
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    stop: tuple[str, ...] = ()

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_tuple(cls, value: object) -> object:
        if value is None:
            return ()
        return (value,) if isinstance(value, str) else as_tuple(value)

    @field_validator("stop")
    @classmethod
    def _stop_nonempty(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if any(not s for s in value):
            raise ValueError("stop strings must be non-empty")
        return value


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Next token from ``logits`` ``[vocab_size]`` float32."""
    if params.temperature == 0.0:
        return int(logits.argmax())
    logits = logits / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens before it already reach top_p (the first always stays).
        drop_sorted = probs.cumsum(-1) - probs >= params.top_p
        drop = torch.zeros_like(drop_sorted)
        drop[order] = drop_sorted
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """Next token of each row of ``logits`` ``[B, vocab_size]`` float32, with that row's options and
    generator (greedy rows share one argmax)."""
    greedy = logits.argmax(-1).tolist()
    return [greedy[i] if p.temperature == 0.0 else sample(logits[i], p, generators[i]) for i, p in enumerate(params)]
