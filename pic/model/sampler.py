"""The sampler: the next token of each row of a step's logits, with that row's options and generator, on the device
and with one host sync per step (``sample_rows``). The executor's (``pic.model.executor``); the options are
``pic.SamplingParams`` (read here through ``RowOptions``: the model layer does not import the engine)."""

from __future__ import annotations

import hashlib
from typing import Protocol

import torch

from pic.kv.transfer import long_tensor


class RowOptions(Protocol):
    """What the sampler reads of a row's ``pic.SamplingParams``."""

    temperature: float
    top_p: float
    top_k: int


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


def sample_token(logits: torch.Tensor, params: RowOptions, generator: torch.Generator | None) -> torch.Tensor:
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
    logits: torch.Tensor, params: list[RowOptions], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """Next token of each row of ``logits`` ``[B, vocab_size]`` float32, with that row's options and
    generator: ``[B]`` int64 on the logits' device, without a host sync (greedy rows share one argmax)."""
    tokens = logits.argmax(-1)
    sampled = [i for i, p in enumerate(params) if p.temperature != 0.0]
    if not sampled:
        return tokens
    picks = [sample_token(logits[i], params[i], generators[i]) for i in sampled]
    return tokens.index_put((long_tensor(sampled, logits.device),), torch.stack(picks))


def sample_rows(logits: torch.Tensor, params: list[RowOptions], generators: list[torch.Generator | None]) -> list[int]:
    """``sample_tokens`` read back to the host: the one host sync of a decode step."""
    return sample_tokens(logits, params, generators).tolist()
