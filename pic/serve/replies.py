"""Completion bodies and event streams in OpenAI's shapes: what the completion routes send back.

Apart from the app so that its routes stay short; ``openapi.py`` declares these shapes for ``/openapi.json``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from pic.engine import RequestOutput
from pic.engine.generation import FinishReason, Generation
from pic.serve.http import exception_error
from pic.serve.metrics import Unfinished

_FINISH = {FinishReason.EOS: "stop", FinishReason.STOP: "stop"}  # every other reason: "length"


def usage(generation: Generation | None) -> dict:
    """OpenAI's usage, with pic's reused and recomputed prompt tokens (what linking saved) and the order the
    chunks ran in: ``pic_order`` (``"given"`` or ``"relevance"``) and ``pic_chunk_order`` (the request's chunk
    indices, ``cache_ids`` then ``documents``, in prompt order); ``pic_policy``, what chose the recomputed tokens
    (``auto``'s choice: ``full`` for a prompt too short to win), and ``pic_recomputed_chunks``, the chunks
    recomputed whole (the request's chunk indices)."""
    if generation is None:
        return {}
    stats = generation.stats
    order = stats.chunk_order
    return {
        "prompt_tokens": stats.num_prompt_tokens,
        "completion_tokens": stats.num_generated_tokens,
        "total_tokens": stats.num_prompt_tokens + stats.num_generated_tokens,
        "reused_tokens": stats.num_reused_tokens,
        "recomputed_tokens": stats.num_recomputed_tokens,
    } | ({} if order is None else {
        "pic_order": order.order.value, "pic_chunk_order": list(order.indices), "pic_policy": stats.policy,
        "pic_recomputed_chunks": list(stats.recomputed_whole),
    })  # fmt: skip


def _finish_reason(generation: Generation | None) -> str | None:
    return None if generation is None else _FINISH.get(generation.stats.finish_reason, "length")


def completion(
    meta: dict, text: str, generation: Generation | None, *, chat: bool, chunk: bool = False, first: bool = False
) -> dict:
    """A completion body: ``text_completion``, ``chat.completion``, or (``chunk``) one streamed piece of either
    (a chat stream's ``first`` piece carries the role, as OpenAI's does; a piece carries no usage)."""
    choice = {"index": 0, "logprobs": None, "finish_reason": _finish_reason(generation)}
    if not chat:
        choice["text"] = text
        kind = "text_completion"
    elif chunk:
        choice["delta"] = ({"role": "assistant"} if first else {}) | ({"content": text} if text else {})
        kind = "chat.completion.chunk"
    else:
        choice["message"] = {"role": "assistant", "content": text}
        kind = "chat.completion"
    body = {**meta, "object": kind, "choices": [choice]}
    if not chunk:
        body["usage"] = usage(generation)
    return body


async def events(
    first: RequestOutput,
    rest: AsyncIterator[RequestOutput],
    meta: dict,
    *,
    chat: bool,
    include_usage: bool,
    on_finish: Callable[[Generation | Unfinished], None],
) -> AsyncIterator[str]:
    """Server-sent events: one per output with new text or the end, then (``stream_options.include_usage``)
    a usage chunk with no choices, then ``[DONE]``. A request that fails after its first token (the status,
    200, is sent already) ends with one event whose data is OpenAI's error object, and no usage nor ``[DONE]``:
    the ``openai`` client raises on it, where a stream that just ended would hand over the text cut short as
    if it were whole. A client that goes away closes this generator, which closes ``rest``: the request is
    aborted and its blocks freed.

    ``on_finish`` gets the ``Generation`` of a request that finished, before its last event, and an
    ``Unfinished`` with the tokens the outputs read so far carried when the client left first (the engine's
    last output, with the prompt's counts and the timings, then goes unread)."""
    out, generated, sent, ended = first, 0, 0, False
    try:
        while True:
            generated += len(out.token_ids)
            if out.error is not None:
                ended = True
                yield _error_event(out.error)
                return
            if out.finished:
                ended = True
                if out.generation is not None:
                    on_finish(out.generation)
            if out.text or out.finished:
                generation = out.generation if out.finished else None
                chunk = completion(meta, out.text, generation, chat=chat, chunk=True, first=sent == 0)
                yield f"data: {json.dumps(chunk)}\n\n"
                sent += 1
            if out.finished:
                break
            out = await anext(rest)
        if include_usage:
            kind = "chat.completion.chunk" if chat else "text_completion"
            last = {**meta, "object": kind, "choices": [], "usage": usage(out.generation)}
            yield f"data: {json.dumps(last)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        if not ended:  # the client left (this generator was closed or cancelled) before the last output
            on_finish(Unfinished(num_generated_tokens=generated))
        await rest.aclose()


def _error_event(error: Exception) -> str:
    """The event that ends a stream whose request failed: the body a JSON error would have had (the same
    status in its ``code``, the same type and message)."""
    _status, body = exception_error(error)
    return f"data: {json.dumps(body)}\n\n"
