"""The decode loop: sample, append a slot, run one token, repeat; text pieces for streaming."""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Generator
from dataclasses import dataclass

import torch

from pic.errors import KVPoolExhaustedError
from pic.kv import RequestKV
from pic.link.sampling import SamplingParams, sample
from pic.model import ModelRunner

log = logging.getLogger("pic")


class FinishReason(str, enum.Enum):
    """Why a generation ended."""

    EOS = "eos"  # the model produced an end-of-sequence token
    STOP = "stop"  # the text reached a stop string
    LENGTH = "length"  # max_new_tokens were generated
    CONTEXT = "context"  # the model's context is full
    KV_POOL = "kv_pool"  # the KV pool had no free block for the next token (the tokens so far are kept)


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
    lock: threading.RLock  # the engine's: held for each step that touches the pool


def _tokens(ctx: DecodeContext, params: SamplingParams) -> Generator[int, None, FinishReason | None]:
    """Sampled tokens; each one is fed back before the next is sampled. Returns why it stopped early
    (``CONTEXT``, ``KV_POOL``), or ``None`` when the caller's conditions (length, EOS) ended it."""
    device = ctx.runner.spec.device
    generator = None
    if params.seed is not None:
        generator = torch.Generator(device=device).manual_seed(params.seed)
    logits, position = ctx.first_logits, ctx.num_prompt_tokens
    for step in range(params.max_new_tokens):
        token = sample(logits, params, generator)
        yield token
        if step + 1 == params.max_new_tokens or token in ctx.eos_token_ids:
            return None
        if position + 1 >= ctx.max_context:  # prompt + generated tokens fill the model's context
            return FinishReason.CONTEXT
        with ctx.lock:
            try:
                slot = torch.tensor([ctx.req.append_slot()], device=device)
            except KVPoolExhaustedError as exc:
                log.warning("pic: generation stopped after %d tokens: %s", step + 1, exc)
                return FinishReason.KV_POOL
            logits = ctx.runner.forward(
                ctx.req,
                token_ids=torch.tensor([token], device=device),
                positions=torch.tensor([position], device=device),
                slots=slot,
                logits_rows=torch.zeros(1, dtype=torch.long, device=device),
            )[0]
        position += 1
    return None


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
    tokens = _tokens(ctx, params)
    while True:
        try:
            token = next(tokens)
        except StopIteration as stopped:
            finish = stopped.value or finish
            break
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
