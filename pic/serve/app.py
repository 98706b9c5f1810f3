"""The OpenAI-compatible app: compiled chunks as a resource, completions that link them.

Routes: ``GET /health``, ``GET /v1/models``, ``POST /v1/chunks``, ``GET/DELETE /v1/chunks/{id}``,
``POST /v1/completions`` (streaming as server-sent events). The extra body field ``pic`` names the chunks
a completion links before its prompt (see ``schemas.PicOptions``). Handlers validate, hand work to the
engine (``AsyncEngine``: the engine's own thread steps it and hands outputs to the loop) and format; compiles and
store calls wait in threads of the store pool, tokenizing in those of the CPU pool (``pic.serve.loop``), so that a
stuck store delays only the requests that need it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from pic.engine import PIC
from pic.engine import Request as PicRequest
from pic.errors import InvalidInputError, shown_id
from pic.link.chat import has_chat_template
from pic.serve.bodies import OffLoopRoute
from pic.serve.handlers import install_error_handlers
from pic.serve.hosts import AllowedHosts
from pic.serve.http import Guard, error_response, pic_error_response, tenant_of
from pic.serve.loop import AsyncEngine
from pic.serve.metrics import CONTENT_TYPE, EngineFigures, Metrics, RequestCounter
from pic.serve.openapi import install_openapi, responses
from pic.serve.replies import completion, events
from pic.serve.schemas import ChatBody, ChunksBody, CompletionBody, Sampling
from pic.serve.shapes import CacheIds, ChatCompletion, ChunkEntry, Completion, Deleted, Health, ModelList
from pic.serve.tenants import Tenant, Tenants
from pic.text import check_encodable


# Every route but /health takes its caller's tenant (its namespace, its quota) from what the Guard found.
def _caller(http: Request) -> Tenant:
    return tenant_of(http)


_TENANT = Depends(_caller)

# Statuses every route can answer before its handler runs (the Guard's), with and without the API key.
_GUARDED, _OPEN = (401, 408, 413), (408, 413)
# ... and those of a route that validates a body and runs the engine or the store.
_WORK = (400, *_GUARDED, 422, 500, 503)


def build_app(
    engine: PIC,
    *,
    model_name: str,
    api_key: str | None = None,
    tenants: Tenants | None = None,
    max_body_bytes: int = 8 << 20,
    body_timeout_s: float = 30.0,
    allowed_hosts: AllowedHosts | None = None,
) -> FastAPI:
    """The app over ``engine``; ``app.state.engine`` is its ``AsyncEngine``, ``app.state.metrics`` its counters.

    ``tenants``: who may call it and whose chunks each call's are (``pic.serve.tenants``: every route takes the
    caller's namespace from its key); ``None``: one tenant, the default namespace, with ``api_key`` (or without a
    key). ``body_timeout_s``: the longest wait for the next piece of a request body (then a 408). ``allowed_hosts``:
    without keys, the names besides the server's own address that a request's ``Host`` and ``Origin`` may name
    (``--allowed-host``; see ``pic.serve.hosts``).

    Raises:
        InvalidInputError: both ``api_key`` and ``tenants``.
    """
    if tenants is not None and api_key is not None:
        raise InvalidInputError("give the server tenants or one API key, not both (a key is a tenant of the file)")
    tenants = Tenants.single(api_key) if tenants is None else tenants
    aengine = AsyncEngine(engine)

    def figures() -> EngineFigures:
        steps = engine.stepper()
        return EngineFigures(
            tiers=tuple(engine.store.stats()), kv=engine.kv_stats(), num_steps=steps.num_steps,
            num_batched_seqs=steps.num_batched_seqs,
        )  # fmt: skip

    metrics = Metrics(figures)
    app = FastAPI(title="pic")
    app.router.route_class = OffLoopRoute  # large bodies parsed off the loop (before the routes are added)
    app.state.engine, app.state.metrics = aengine, metrics
    install_error_handlers(app)
    install_openapi(app, secured=tenants.keyed, model_name=model_name, rate_limited=tenants.rate_limited)
    app.add_middleware(
        Guard, tenants=tenants, max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s,
        allowed_hosts=allowed_hosts,
    )  # fmt: skip
    app.add_middleware(RequestCounter, metrics=metrics)  # outermost: 401s and 413s are counted too

    @app.get("/health", response_model=None, responses=responses(Health, *_OPEN))
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models", response_model=None, responses=responses(ModelList, *_GUARDED))
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "pic"}]}

    @app.get("/metrics", response_class=PlainTextResponse, responses=responses(None, *_GUARDED, 500, text=True))
    async def prometheus() -> Response:
        return Response(await aengine.store(metrics.render), media_type=CONTENT_TYPE)  # the tiers' figures

    @app.post("/v1/chunks", response_model=None, responses=responses(CacheIds, *_WORK))
    async def compile_chunks(body: ChunksBody, tenant: Tenant = _TENANT) -> dict:
        context = body.context
        if body.system is not None:
            system = [{"role": "system", "content": body.system}] if body.system else []
            context = await aengine.cpu(engine.chat_context, system)
        report = await aengine.store(
            engine.compile_report, body.documents, policy=body.policy, context=context, progress=False,
            namespace=tenant.access,
        )  # fmt: skip
        return {"cache_ids": report.ids, "tiers": [list(tiers) for tiers in report.tiers]}

    @app.get("/v1/chunks/{cache_id}", response_model=None, responses=responses(ChunkEntry, 404, *_GUARDED, 500, 503))
    async def chunk_info(cache_id: str, tenant: Tenant = _TENANT) -> dict:
        # metadata only; UnknownCacheIdError (another namespace's chunk, as one nobody compiled): 404
        chunk = await aengine.store(engine.store.describe, cache_id, namespace=tenant.access)
        return {"id": cache_id, "tiers": list(chunk.tiers), "num_tokens": chunk.num_tokens, "bytes": chunk.num_bytes}

    @app.delete("/v1/chunks/{cache_id}", response_model=None, responses=responses(Deleted, 404, *_GUARDED, 500, 503))
    async def delete_chunk(cache_id: str, tenant: Tenant = _TENANT) -> dict:
        # a tier that fails: StoreUnavailableError, 503; another namespace's chunk: False, as for one nobody compiled
        if not await aengine.store(engine.store.expire, cache_id, namespace=tenant.access):
            return error_response(404, f"unknown cache id {shown_id(cache_id)}", kind="not_found_error")
        return {"id": cache_id, "deleted": True}

    @app.post("/v1/completions", response_model=None, responses=responses(Completion, 404, *_WORK, stream=True))
    async def completions(body: CompletionBody, http: Request, tenant: Tenant = _TENANT):
        if body.model != model_name:
            return _unknown_model(body.model, model_name)
        check_encodable(body.prompt, "prompt")  # named as the client sent it (the engine calls it the query)
        request = await _pic_request(aengine, body, body.prompt, tenant=tenant)
        return await _respond(request, body, http, chat=False)

    @app.post(
        "/v1/chat/completions", response_model=None, responses=responses(ChatCompletion, 404, *_WORK, stream=True)
    )
    async def chat_completions(body: ChatBody, http: Request, tenant: Tenant = _TENANT):
        if body.model != model_name:
            return _unknown_model(body.model, model_name)
        if not has_chat_template(engine.tokenizer):
            return _no_chat_template(model_name)
        messages = [m.model_dump() for m in body.messages]
        prefix, query = await aengine.cpu(engine.chat_segments, messages)  # renders: off the loop
        context = await aengine.cpu(engine.chat_context, messages) if body.pic.documents else None
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        request = await _pic_request(aengine, body, query, prefix=prefix, context=context, tenant=tenant)
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
                stream = events(
                    first, outputs, meta, chat=chat, include_usage=include_usage, on_finish=metrics.generation
                )
                return StreamingResponse(stream, media_type="text/event-stream")
            # Not streaming: the one output is the last, with the whole generation (or an abort's error).
            if first.generation is not None:
                metrics.generation(first.generation)
            text = first.generation.text if first.generation is not None else ""
            return completion(meta, text, first.generation, chat=chat)
        finally:
            if not streaming:
                await outputs.aclose()

    return app


async def _pic_request(
    aengine: AsyncEngine,
    body: Sampling,
    prompt: str,
    *,
    tenant: Tenant,
    prefix: str | None = None,
    context: str | None = None,
) -> PicRequest:
    """The engine request of a completion in the caller's namespaces (``tenant``'s): inline documents compiled first
    into its own (cached; after ``context``, a chat's, or after the prefix when the policy needs chunks compiled in
    context), linked after ``cache_ids``."""
    engine, options = aengine.engine, body.pic
    ids = list(options.cache_ids)
    if options.documents:
        if context is None and options.prefix and engine.compile_policy(options.policy).needs_context:
            context = options.prefix
        ids += await aengine.store(
            engine.compile, options.documents, policy=options.policy, context=context, progress=False, interactive=True,
            namespace=tenant.access,
        )  # fmt: skip
    return PicRequest(
        ids,
        prompt,
        prefix=options.prefix if prefix is None else prefix,
        policy=options.policy,
        relevance=options.relevance,
        order=options.order,
        max_new_tokens=engine.spec.max_context if body.max_tokens is None else body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        stop=body.stop,
        namespace=tenant.access,
    )


async def _disconnected(http: Request) -> None:
    """Return when the client has gone (the body was read already: what arrives next is the disconnect)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


def _no_chat_template(served: str) -> JSONResponse:
    """The 400 of a chat on a model without a chat template, saying what a server's user can do about it (the
    library's error names ``PIC.link``, which a client of the server cannot call)."""
    return error_response(
        400, f"model {served!r} has no chat template, so it cannot render chat messages: start pic serve with "
        "--chat-template FILE (a Jinja chat template), or send the prompt as text to /v1/completions",
        param="messages",
    )  # fmt: skip


def _unknown_model(asked: str, served: str) -> JSONResponse:
    """OpenAI's 404 for a model this server does not serve."""
    return error_response(
        404, f"model {asked!r:.80} is not served here; this server serves {served!r}", kind="model_not_found"
    )
