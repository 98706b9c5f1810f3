"""Sampling options and the choice of the next token."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TypedDict

import torch
from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pic.config import _Frozen, as_tuple
from pic.errors import InvalidInputError
from pic.kv.transfer import long_tensor

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


def seeded_generator(seed: int, device: torch.device) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed`` (``0 <= seed < 2**64``).

    The CPU's generator (mt19937) keeps only the low 32 bits of a seed, so seeds ``s``, ``s + 2**32``,
    ``s + 2**40`` ... would sample the same tokens; there a seed from ``2**32`` up is hashed to 32 bits
    first, so distinct seeds give the same samples only by chance (about 2**-32), and seeds below
    ``2**32`` keep the samples they always had. CUDA's generator (Philox) takes all 64 bits.
    """
    if device.type == "cpu" and seed >= 2**32:
        seed = int.from_bytes(hashlib.blake2b(seed.to_bytes(8, "little"), digest_size=4).digest(), "little")
    return torch.Generator(device=device).manual_seed(seed)


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Next token from ``logits`` ``[vocab_size]`` float32: a 0-dim int64 tensor on their device, without a
    host sync (``generator``, when given, lives on that device)."""
    if params.temperature == 0.0:
        return logits.argmax()
    logits = logits / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens before it already reach top_p (the first always stays).
        drop_sorted = probs.cumsum(-1) - probs >= params.top_p
        logits = logits.masked_fill(torch.empty_like(drop_sorted).scatter_(0, order, drop_sorted), float("-inf"))
    return _multinomial_one(logits.softmax(-1), generator)


def _multinomial_one(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw from ``probs`` ``[vocab_size]``: what ``torch.multinomial(probs, 1, generator=...)`` draws
    (argmax of ``probs / q``, ``q ~ Exp(1)``, is its algorithm for one sample: same generator state, same
    token), without its validity checks: host syncs in older torch, device-side asserts in newer ones, which
    leave the CUDA context unusable, so one request's NaN logits would stop every request. ``probs`` comes
    from a softmax with at least one finite logit: a valid distribution unless the model gave NaN."""
    q = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / q).argmax()


def sample_tokens(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """Next token of each row of ``logits`` ``[B, vocab_size]`` float32, with that row's options and
    generator: ``[B]`` int64 on the logits' device, without a host sync (greedy rows share one argmax)."""
    tokens = logits.argmax(-1)
    sampled = [i for i, p in enumerate(params) if p.temperature != 0.0]
    if not sampled:
        return tokens
    picks = [sample_token(logits[i], params[i], generators[i]) for i in sampled]
    return tokens.index_put((long_tensor(sampled, logits.device),), torch.stack(picks))


def sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """``sample_tokens`` read back to the host: the one host sync of a decode step."""
    return sample_tokens(logits, params, generators).tolist()
