"""Sampling options (``SamplingParams``), as requests carry them from the public API, the server and the vLLM
connector to the engine (vLLM's ``sampling_params``); the sampler that reads them is the executor's
(``pic.model.sampler``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypedDict

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pic.config import _Frozen, as_tuple
from pic.errors import InvalidInputError

# Temperatures below this sample greedily (vLLM's threshold): dividing float32 logits by a smaller one
# overflows to inf, and a softmax of infs is NaN (every token id 0). At 1e-5 the distribution is one-hot
# already, up to ties.
GREEDY_TEMPERATURE = 1e-5
# A top_p below this samples greedily: the most likely token of a vocabulary under a million tokens has at
# least this probability, so the nucleus is that token alone (and float32 rounds a top_p under 1e-45 to 0,
# which would drop every token).
GREEDY_TOP_P = 1e-6


class SamplingParams(_Frozen):
    """How to generate: the options of ``Request``, ``Linked.generate`` and ``Linked.stream``, validated
    once where they enter and carried unchanged to the sampler.

    Numbers are validated strictly (``max_new_tokens="10"`` and ``temperature=float("inf")`` are
    ``InvalidInputError``s).

    Attributes:
        max_new_tokens: most tokens to generate.
        temperature: 0 is greedy (argmax); otherwise logits are divided by it before sampling. Under
            ``GREEDY_TEMPERATURE`` (1e-5) it is greedy too (set to 0).
        top_p: nucleus sampling: keep the smallest set of tokens whose probability reaches ``top_p``. Under
            ``GREEDY_TOP_P`` (1e-6) the nucleus is the most likely token: greedy (temperature set to 0).
        top_k: keep the ``top_k`` most likely tokens (0: all).
        seed: seeds a private generator, so equal seeds give equal samples (``0 <= seed < 2**64``).
        stop: strings that end the generation; the text stops before the first one.
    """

    max_new_tokens: int = Field(default=64, ge=0)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)  # OpenAI's range, as pic serve takes it
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    stop: tuple[str, ...] = ()

    @model_validator(mode="before")
    @classmethod
    def _vanishing_is_greedy(cls, data: object) -> object:
        """A vanishing temperature or top_p means greedy; sampling with it would pick token 0 every time."""
        if not isinstance(data, dict):
            return data
        t, p = data.get("temperature"), data.get("top_p")
        tiny_t = isinstance(t, float) and 0.0 < t < GREEDY_TEMPERATURE
        tiny_p = isinstance(p, float) and 0.0 < p < GREEDY_TOP_P
        return {**data, "temperature": 0.0} if tiny_t or tiny_p else data

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_tuple(cls, value: object) -> object:
        if value is None:
            return ()
        if not isinstance(value, (str, list, tuple, set, frozenset)):
            raise PydanticCustomError("stop", "pass a string or a list of strings (stop=['\\n\\n'])", {})
        return (value,) if isinstance(value, str) else as_tuple(value)

    @field_validator("stop")
    @classmethod
    def _stop_nonempty(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if any(not s for s in value):
            raise ValueError("stop strings must be non-empty")
        return value


class SamplingOptions(TypedDict, total=False):
    """``SamplingParams``' fields as keyword arguments (``generate(32, temperature=0.8, seed=1)``)."""

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: str | Sequence[str] | None


def sampling_params(params: SamplingParams | None, options: dict, max_new_tokens: int | None = None) -> SamplingParams:
    """``params``, or one built from keyword ``options`` and ``max_new_tokens`` (not both).

    Raises:
        InvalidInputError: a bad or unknown option, or both ``params`` and options.
    """
    if max_new_tokens is not None:
        options = {"max_new_tokens": max_new_tokens, **options}
    if params is None:
        return SamplingParams(**options)
    if options:
        raise InvalidInputError(f"pass sampling options or a SamplingParams, not both (got {sorted(options)})")
    if not isinstance(params, SamplingParams):
        raise InvalidInputError(f"sampling is {params!r:.80}; expected a pic.SamplingParams")
    return params
