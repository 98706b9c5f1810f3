"""What a generation returns: its text, tokens, timings, and why it ended."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pic.link.order import ChunkOrder


class FinishReason(str, enum.Enum):
    """Why a generation ended."""

    EOS = "eos"  # the model produced an end-of-sequence token
    STOP = "stop"  # the text reached a stop string
    LENGTH = "length"  # max_new_tokens were generated
    CONTEXT = "context"  # the model's context is full
    KV_POOL = "kv_pool"  # the KV pool had no free block for the next token (the tokens so far are kept)
    ABORT = "abort"  # aborted (``Engine.abort``, a stream closed early); the tokens so far are kept


@dataclass(frozen=True)
class GenerationStats:
    """Counts and timings of one linked request.

    ``queue_s`` is the time from its arrival until the engine admitted it; ``link_s`` the time its
    link took (``PIC.link``'s wall time, or from admission to the end of the recompute pass);
    ``ttft_s`` the time to the first token from the arrival (from ``link`` for ``Linked.generate``:
    the link time plus the first token's step); ``decode_s`` the rest of the generation.
    ``num_preemptions`` counts the times the engine freed its blocks to make room and later
    recomputed it (the tokens are the same as without). ``chunk_order`` is the order its chunks ran in
    (``None``: it failed before it was laid out), ``policy`` the spec of the policy that chose its recomputed tokens
    (``auto``'s choice for the layout), and ``recomputed_whole`` the chunks it recomputed whole (the caller's chunk
    indices, in prompt order).
    """

    num_prompt_tokens: int
    num_recomputed_tokens: int
    num_reused_tokens: int
    num_generated_tokens: int
    link_s: float
    ttft_s: float
    decode_s: float
    finish_reason: FinishReason
    queue_s: float = 0.0
    num_preemptions: int = 0
    chunk_order: ChunkOrder | None = None
    policy: str | None = None
    recomputed_whole: tuple[int, ...] = ()


@dataclass(frozen=True)
class Generation:
    """The result of ``Linked.generate`` / ``PIC.generate_many``: text (special tokens and stop string
    excluded), the generated token ids (an EOS token included, as transformers does), time to first
    token, stats."""

    text: str
    token_ids: list[int]
    ttft_s: float
    stats: GenerationStats
