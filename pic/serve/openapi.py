"""``/openapi.json`` as the server really answers: each route's statuses with OpenAI's error shape, its
200's body, the event stream of a streaming completion, ``/metrics`` as Prometheus text, and the API key.

FastAPI only knows what the handlers' signatures say (a 200 of anything, and its own 422 shape, which this
server never sends), so each route declares its ``responses`` here and ``install_openapi`` mends what FastAPI
writes on its own. A generated client, or a fuzzer checking responses against the schema (schemathesis, in
the tests), then reads the truth.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from pic.serve.shapes import ErrorBody

_WHY: dict[int, str] = {
    400: "malformed JSON, or a body that is not UTF-8; an unknown field or an unsupported OpenAI parameter; a chat "
    "message's content part other than text; a bad policy; a prompt over the context; text that is not valid Unicode",
    401: "a missing or wrong API key (a server started with an API key or --tenants)",
    403: "a server without an API key: a Host naming none of its addresses, or another site's Origin",
    404: "an unknown cache id, or a model this server does not serve",
    408: "the request body stalled longer than --body-timeout",
    413: "a body over --max-body-bytes",
    415: "a server without an API key: a body not sent as content-type: application/json",
    422: "a field of the wrong JSON type or out of range (the message names it and its value)",
    429: "the caller's tenant is over its request rate (requests_per_s in --tenants): retry after Retry-After seconds",
    500: "a fault of the server's (a bug, a device error), not the request's",
    503: "the KV pool is full, or the store (Redis) is unavailable",
}
# With stream: true, a 200 is server-sent events; the schema describes one event, as OpenAPI 3.2's ``itemSchema``
# does (and readers of 3.1 such as schemathesis read ``schema``).
_STREAM = {
    "text/event-stream": {
        "schema": {
            "type": "object",
            "description": "one server-sent event: a completion chunk's JSON, then `[DONE]`; a request that fails "
            "after its first token ends with one event holding the error body (OpenAI's) instead",
            "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
            "required": ["data"],
        }
    }
}


def responses(ok: type[BaseModel] | None, *errors: int, stream: bool = False, text: bool = False) -> dict:
    """A route's ``responses``: its 200 (``ok``'s JSON; ``text``: Prometheus text; ``stream``: also an event
    stream), and each status in ``errors`` with OpenAI's error body."""
    declared: dict[int | str, dict[str, Any]] = {}
    if text:
        declared[200] = {"description": "Prometheus text", "content": {"text/plain": {"schema": {"type": "string"}}}}
    else:
        declared[200] = {"model": ok, "description": "OK"} | ({"content": _STREAM} if stream else {})
    for status in sorted(errors):
        declared[status] = {"model": ErrorBody, "description": _WHY[status]}
    return declared


def install_openapi(app: FastAPI, *, secured: bool, model_name: str, rate_limited: bool = False) -> None:
    """Mend what FastAPI writes on its own into ``app``'s schema: its 422 shape is dropped (routes declare
    theirs), error bodies are JSON on every route, integer bounds are integers (FastAPI writes ``minimum: 1.0``,
    a float, on a strict integer), with ``secured`` every route but ``/health`` needs the bearer key, and with
    ``rate_limited`` (a tenant with a request rate) every such route may answer 429.
    Request examples name ``model_name``, and a compile's ids link to the chunk routes, so a client (or a
    fuzzer) reaches past the 404s."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        _drop_fastapi_422(schema)
        _errors_as_json(schema)
        _integer_bounds(schema)
        _examples_and_links(schema, model_name)
        if secured:
            schema.setdefault("components", {})["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            for path, operations in schema["paths"].items():
                for operation in operations.values():
                    if path != "/health":
                        operation["security"] = [{"bearer": []}]
        else:
            _keyless_errors(schema)
        if rate_limited:
            _guarded_answer(schema, 429)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _drop_fastapi_422(schema: dict) -> None:
    """FastAPI's 422 (``HTTPValidationError``), added to routes with parameters that declare none: this server's
    422 is OpenAI's error body, and a path parameter that is any string is never one."""
    for operations in schema["paths"].values():
        for operation in operations.values():
            answer = operation.get("responses", {}).get("422", {})
            ref = answer.get("content", {}).get("application/json", {}).get("schema", {}).get("$ref", "")
            if ref.endswith("/HTTPValidationError"):
                del operation["responses"]["422"]
    components = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)


def _guarded_answer(schema: dict, status: int) -> None:
    """``status`` (an error the ``Guard`` answers) on every route but ``/health``."""
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
    for path, operations in schema["paths"].items():
        for operation in operations.values():
            if path != "/health":
                operation.setdefault("responses", {})[str(status)] = {"description": _WHY[status], "content": error}


def _keyless_errors(schema: dict) -> None:
    """A keyless server's own refusals (the ``Guard``'s): a 403 on every route but ``/health`` (a foreign Host or
    Origin) and a 415 on each POST (a body not sent as JSON)."""
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            answers = operation.setdefault("responses", {})
            if path != "/health":
                answers["403"] = {"description": _WHY[403], "content": error}
            if method == "post":
                answers["415"] = {"description": _WHY[415], "content": error}


def _errors_as_json(schema: dict) -> None:
    """Error bodies are JSON on every route: FastAPI files them under the route's own media type (``/metrics``'
    text/plain)."""
    for operations in schema["paths"].values():
        for operation in operations.values():
            for answer in operation.get("responses", {}).values():
                content = answer.get("content", {})
                for media in [m for m in content if m != "application/json"]:
                    if content[media].get("schema", {}).get("$ref", "").endswith("/ErrorBody"):
                        content["application/json"] = content.pop(media)


def _examples_and_links(schema: dict, model_name: str) -> None:
    """A working request body for each POST route, and links from ``POST /v1/chunks``' ids to the routes that
    take one."""
    examples = {
        "/v1/chunks": {"documents": ["Tom had a big red ball.", "Lily loved to sing."]},
        "/v1/completions": {"model": model_name, "prompt": "Once upon a time", "max_tokens": 8},
        "/v1/chat/completions": {
            "model": model_name,
            "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": 8,
        },
    }
    for path, example in examples.items():
        operation = schema["paths"].get(path, {}).get("post")
        if operation is not None:
            operation["requestBody"]["content"]["application/json"]["example"] = example
    chunk = schema["paths"].get("/v1/chunks/{cache_id}", {})
    compile_ok = schema["paths"].get("/v1/chunks", {}).get("post", {}).get("responses", {}).get("200")
    if compile_ok is None:
        return
    compile_ok["links"] = {
        f"{method.capitalize()}Chunk": {
            "operationId": operation["operationId"],
            "parameters": {"cache_id": "$response.body#/cache_ids/0"},
        }
        for method, operation in chunk.items()
    }


def _integer_bounds(node: object) -> None:
    """Integer bounds of integer schemas as JSON integers (``2**64``, not ``1.8446744073709552e+19``)."""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                if isinstance(node.get(key), float) and node[key].is_integer():
                    node[key] = int(node[key])
        for value in node.values():
            _integer_bounds(value)
    elif isinstance(node, list):
        for value in node:
            _integer_bounds(value)
