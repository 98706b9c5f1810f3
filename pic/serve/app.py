"""The OpenAI-compatible app: compiled chunks as a resource, completions that link them.

Routes: ``GET /health``, ``GET /v1/models``, ``POST /v1/chunks``, ``GET/DELETE /v1/chunks/{id}``,
``POST /v1/completions`` (streaming as server-sent events). The extra body field ``pic`` names the chunks
a completion links before its prompt (see ``schemas.PicOptions``). Handlers validate, hand work to the
engine (``AsyncEngine``: the engine's own thread steps it and hands outputs to the loop) and format; compiles and
store calls wait in worker threads while the engine's thread runs them between two steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pic.api import PIC
from pic.engine import Request as PicRequest
from pic.engine import RequestOutput
from pic.engine.generation import FinishReason, Generation
from pic.errors import PicError
from pic.serve.http import Guard, error_response, exception_error, pic_error_response
from pic.serve.loop import AsyncEngine
from pic.serve.metrics import CONTENT_TYPE, EngineFigures, Metrics, RequestCounter
from pic.serve.schemas import ChatBody, ChunksBody, CompletionBody, Sampling
from pic.text import check_encodable

_FINISH = {FinishReason.EOS: "stop", FinishReason.STOP: "stop"}  # every other reason: "length"


def build_app(engine: PIC, *, model_name: str, api_key: str | None = None, max_body_bytes: int = 8 << 20) -> FastAPI:
    """The app over ``engine``; ``app.state.engine`` is its ``AsyncEngine``, ``app.state.metrics`` its counters."""
    aengine = AsyncEngine(engine)

    def figures() -> EngineFigures:
        steps = engine.stepper()
        return EngineFigures(
            tiers=tuple(engine.store.stats()), kv=engine.kv_stats(), num_steps=steps.num_steps,
            num_batched_seqs=steps.num_batched_seqs,
        )  # fmt: skip

    metrics = Metrics(figures)
    app = FastAPI(title="pic")
    app.state.engine, app.state.metrics = aengine, metrics
    app.add_exception_handler(PicError, lambda _request, exc: pic_error_response(exc))
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes)
    app.add_middleware(RequestCounter, metrics=metrics)  # outermost: 401s and 413s are counted too

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "pic"}]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(await asyncio.to_thread(metrics.render), media_type=CONTENT_TYPE)

    @app.post("/v1/chunks")
    async def compile_chunks(body: ChunksBody) -> dict:
        context = body.context
        if body.system is not None:
            system = [{"role": "system", "content": body.system}] if body.system else []
            context = await asyncio.to_thread(engine.chat_context, system)
        ids = await asyncio.to_thread(
            engine.compile, body.documents, policy=body.policy, context=context, progress=False
        )
        return {"cache_ids": ids}

    @app.get("/v1/chunks/{cache_id}")
    async def chunk_info(cache_id: str) -> dict:
        chunk = await asyncio.to_thread(engine.store.describe, cache_id)  # metadata only; UnknownCacheIdError: 404
        return {"id": cache_id, "tiers": list(chunk.tiers), "num_tokens": chunk.num_tokens, "bytes": chunk.num_bytes}

    @app.delete("/v1/chunks/{cache_id}")
    async def delete_chunk(cache_id: str) -> dict:
        if not await asyncio.to_thread(engine.store.expire, cache_id):
            return error_response(404, f"unknown cache id {cache_id!r}", kind="not_found_error")
        return {"id": cache_id, "deleted": True}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: Request):
        if body.model != model_name:
            return _unknown_model(body.model, model_name)
        check_encodable(body.prompt, "prompt")  # named as the client sent it (the engine calls it the query)
        return await _respond(await _pic_request(engine, body, body.prompt), body, http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, http: Request):
        if body.model != model_name:
            return _unknown_model(body.model, model_name)
        messages = [m.model_dump() for m in body.messages]
        prefix, query = await asyncio.to_thread(engine.chat_segments, messages)  # renders: off the loop
        context = await asyncio.to_thread(engine.chat_context, messages) if body.pic.documents else None
        body.max_tokens = body.max_completion_tokens or body.max_tokens
        request = await _pic_request(engine, body, query, prefix=prefix, context=context)
        return await _respond(request, body, http, chat=True)

    async def _respond(request: PicRequest, body: Sampling, http: Request, *, chat: bool):
        """The response: an event stream, or (until the client leaves: then the request is aborted) a body."""
        if body.stream:
            return await _reply(request, body, chat=chat)
        reply = asyncio.ensure_future(_reply(request, body, chat=chat))
        gone = asyncio.ensure_future(_disconnected(http))
        await asyncio.wait((reply, gone), return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not reply.done():  # the client left: cancelling the reply closes its outputs, which aborts the request
            reply.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reply
            return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
        return reply.result()

    async def _reply(request: PicRequest, body: Sampling, *, chat: bool):
        outputs, streaming = aengine.generate(request, pieces=body.stream), False
        try:  # cancelled before it returns (the client left): closing the outputs aborts the request
            first = await anext(outputs)
            if first.error is not None:  # failed before its first token (or, not streaming, at any point)
                return pic_error_response(first.error)
            meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time())}
            meta["model"] = model_name
            if body.stream:
                streaming = True  # the event stream owns the outputs now
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                events = _events(
                    first, outputs, meta, chat=chat, include_usage=include_usage, on_finish=metrics.generation
                )
                return StreamingResponse(events, media_type="text/event-stream")
            # Not streaming: the one output is the last, with the whole generation (or an abort's error).
            if first.generation is not None:
                metrics.generation(first.generation)
            text = first.generation.text if first.generation is not None else ""
            return _completion(meta, text, first.generation, chat=chat)
        finally:
            if not streaming:
                await outputs.aclose()

    return app


async def _pic_request(
    engine: PIC, body: Sampling, prompt: str, *, prefix: str | None = None, context: str | None = None
) -> PicRequest:
    """The engine request of a completion: inline documents compiled first (cached; after ``context``, a chat's,
    or after the prefix when the policy needs chunks compiled in context), linked after ``cache_ids``."""
    options = body.pic
    ids = list(options.cache_ids)
    if options.documents:
        if context is None and options.prefix and engine.compile_policy(options.policy).needs_context:
            context = options.prefix
        ids += await asyncio.to_thread(
            engine.compile, options.documents, policy=options.policy, context=context, progress=False
        )
    return PicRequest(
        ids,
        prompt,
        prefix=options.prefix if prefix is None else prefix,
        policy=options.policy,
        relevance=options.relevance,
        max_new_tokens=body.max_tokens or engine.spec.max_context,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        stop=body.stop,
    )


async def _disconnected(http: Request) -> None:
    """Return when the client has gone (the body was read already: what arrives next is the disconnect)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


def _usage(generation: Generation | None) -> dict:
    if generation is None:
        return {}
    stats = generation.stats
    return {
        "prompt_tokens": stats.num_prompt_tokens,
        "completion_tokens": stats.num_generated_tokens,
        "total_tokens": stats.num_prompt_tokens + stats.num_generated_tokens,
        "reused_tokens": stats.num_reused_tokens,
        "recomputed_tokens": stats.num_recomputed_tokens,
    }


def _finish_reason(generation: Generation | None) -> str | None:
    return None if generation is None else _FINISH.get(generation.stats.finish_reason, "length")


def _completion(
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
        body["usage"] = _usage(generation)
    return body


async def _events(
    first: RequestOutput,
    rest: AsyncIterator[RequestOutput],
    meta: dict,
    *,
    chat: bool,
    include_usage: bool,
    on_finish: Callable[[Generation], None],
) -> AsyncIterator[str]:
    """Server-sent events: one per output with new text or the end, then (``stream_options.include_usage``)
    a usage chunk with no choices, then ``[DONE]``. A request that fails after its first token (the status,
    200, is sent already) ends with one event whose data is OpenAI's error object, and no usage nor ``[DONE]``:
    the ``openai`` client raises on it, where a stream that just ended would hand over the text cut short as
    if it were whole. A client that goes away closes this generator, which closes ``rest``: the request is
    aborted and its blocks freed."""
    try:
        out, sent = first, 0
        while True:
            if out.error is not None:
                yield _error_event(out.error)
                return
            if out.text or out.finished:
                generation = out.generation if out.finished else None
                chunk = _completion(meta, out.text, generation, chat=chat, chunk=True, first=sent == 0)
                yield f"data: {json.dumps(chunk)}\n\n"
                sent += 1
            if out.finished:
                if out.generation is not None:
                    on_finish(out.generation)
                break
            out = await anext(rest)
        if include_usage:
            kind = "chat.completion.chunk" if chat else "text_completion"
            usage = {**meta, "object": kind, "choices": [], "usage": _usage(out.generation)}
            yield f"data: {json.dumps(usage)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        await rest.aclose()


def _error_event(error: Exception) -> str:
    """The event that ends a stream whose request failed: the body a JSON error would have had (the same
    status in its ``code``, the same type and message)."""
    _status, body = exception_error(error)
    return f"data: {json.dumps(body)}\n\n"


def _unknown_model(asked: str, served: str) -> JSONResponse:
    """OpenAI's 404 for a model this server does not serve."""
    return error_response(
        404, f"model {asked!r:.80} is not served here; this server serves {served!r}", kind="model_not_found"
    )


def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (an unknown route, a wrong method) in OpenAI's error shape."""
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(exc.status_code, f"{exc.detail}: {_request.method} {_request.url.path}", kind=kind)


def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    """422 naming each bad field and value; a body that is not JSON at all, and a parameter this server does
    not support, are 400s."""
    errors = exc.errors()
    unsupported = [e for e in errors if e.get("type") == "unsupported_parameter"]
    if unsupported:
        return error_response(400, unsupported[0]["msg"])
    not_json = any(e.get("type") == "json_invalid" or tuple(e["loc"]) == ("body",) for e in errors)
    if not_json:
        return error_response(400, "the request body is not a valid JSON object")
    problems = []
    for err in errors[:_MAX_PROBLEMS]:
        where = ".".join(str(p) for p in err["loc"] if p != "body")
        problems.append(f"{where}={_echo(err.get('input'))}: {err['msg'].removeprefix('Value error, ')}")
    if len(errors) > _MAX_PROBLEMS:
        problems.append(f"and {len(errors) - _MAX_PROBLEMS} more")
    return error_response(422, "; ".join(problems), param=str(errors[0]["loc"][-1]) if errors else None)


# An error names at most this many problems, each value echoed in at most this many characters: a large
# bad body gets a short answer, not a copy of itself.
_MAX_PROBLEMS, _MAX_ECHO = 8, 80


def _echo(value: object) -> str:
    """``repr(value)``, cut to ``_MAX_ECHO`` characters (with the length it had)."""
    text = repr(value)
    return text if len(text) <= _MAX_ECHO else f"{text[:_MAX_ECHO]}... ({len(text)} characters)"
