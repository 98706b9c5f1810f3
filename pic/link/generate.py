"""The decode loop: sample, append a slot, run one token, repeat; text pieces for streaming."""

from __future__ import annotations

import enum
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass

import torch

from pic.kv import RequestKV
from pic.link.sampling import SamplingParams, sample
from pic.model import ModelRunner


class FinishReason(str, enum.Enum):
    EOS = "eos"  # the model produced an end-of-sequence token
    STOP = "stop"  # the text reached a stop string
    LENGTH = "length"  # max_new_tokens were generated
    CONTEXT = "context"  # the model's context is full


@dataclass(frozen=True)
class GenerationStats:
    """Counts and timings of one linked request.

    ``link_s`` is the time ``link`` took (resolve, lay out, recompute); ``ttft_s`` adds the first
    token's sampling; ``decode_s`` is the rest of the generation.
    """

    num_prompt_tokens: int
    num_recomputed_tokens: int
    num_reused_tokens: int
    num_generated_tokens: int
    link_s: float
    ttft_s: float
    decode_s: float
    finish_reason: FinishReason


@dataclass(frozen=True)
class Generation:
    """The result of ``Linked.generate``: text (special tokens and stop string excluded), the
    generated token ids (an EOS token included, as transformers does), time to first token, stats."""

    text: str
    token_ids: list[int]
    ttft_s: float
    stats: GenerationStats


@dataclass(frozen=True)
class DecodeContext:
    """What the decode loop needs from the engine and the linked request."""

    runner: ModelRunner
    tokenizer: object
    req: RequestKV
    first_logits: torch.Tensor  # [vocab_size] float32, predicting the first new token
    num_prompt_tokens: int
    num_recomputed: int
    link_s: float
    eos_token_ids: frozenset[int]
    max_context: int


def _tokens(ctx: DecodeContext, params: SamplingParams) -> Iterator[int]:
    """Sampled tokens; each one is fed back before the next is sampled."""
    device = ctx.runner.spec.device
    generator = None
    if params.seed is not None:
        generator = torch.Generator(device=device).manual_seed(params.seed)
    logits, position = ctx.first_logits, ctx.num_prompt_tokens
    for step in range(params.max_new_tokens):
        token = sample(logits, params, generator)
        yield token
        # Stop once prompt + generated tokens fill the model's context.
        if step + 1 == params.max_new_tokens or token in ctx.eos_token_ids or position + 1 >= ctx.max_context:
            return
        slot = torch.tensor([ctx.req.append_slot()], device=device)
        ids = torch.tensor([token], device=device)
        logits = ctx.runner.forward(
            ctx.req,
            token_ids=ids,
            positions=torch.tensor([position], device=device),
            slots=slot,
            logits_rows=torch.zeros(1, dtype=torch.long, device=device),
        )[0]
        position += 1


def decode(ctx: DecodeContext, params: SamplingParams) -> Generator[str, None, Generation]:
    """Generate; yields text pieces as they become final, returns the ``Generation``.

    Text is held back while it ends in an incomplete UTF-8 sequence or could still become a stop
    string, so every yielded piece is final and their concatenation is ``Generation.text``.
    """
    start = first_at = time.perf_counter()
    token_ids: list[int] = []
    text, num_emitted = "", 0
    finish = FinishReason.LENGTH
    hold = max((len(s) for s in params.stop), default=1) - 1
    for token in _tokens(ctx, params):
        if not token_ids:
            first_at = time.perf_counter()
        token_ids.append(token)
        if token in ctx.eos_token_ids:
            finish = FinishReason.EOS
            break
        text = ctx.tokenizer.decode(token_ids, skip_special_tokens=True)
        cut = _first_stop(text, params.stop, since=max(0, num_emitted - hold))
        if cut is not None:
            text, finish = text[:cut], FinishReason.STOP
            break
        final = min(len(text) - hold, len(text.rstrip("\ufffd")))
        if final > num_emitted:
            yield text[num_emitted:final]
            num_emitted = final
    else:
        if len(token_ids) < params.max_new_tokens:  # _tokens stopped early without an EOS
            finish = FinishReason.CONTEXT
    if len(text) > num_emitted:
        yield text[num_emitted:]
    ttft_s = ctx.link_s + (first_at - start)
    stats = GenerationStats(
        num_prompt_tokens=ctx.num_prompt_tokens,
        num_recomputed_tokens=ctx.num_recomputed,
        num_reused_tokens=ctx.num_prompt_tokens - ctx.num_recomputed,
        num_generated_tokens=len(token_ids),
        link_s=ctx.link_s,
        ttft_s=ttft_s,
        decode_s=time.perf_counter() - first_at,
        finish_reason=finish,
    )
    return Generation(text=text, token_ids=token_ids, ttft_s=ttft_s, stats=stats)


def _first_stop(text: str, stops: tuple[str, ...], *, since: int) -> int | None:
    found = [i for i in (text.find(s, since) for s in stops) if i >= 0]
    return min(found) if found else None
