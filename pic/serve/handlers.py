"""The app's exception handlers: every error the app answers is OpenAI's error body.

A validation error is a 422 naming each bad field by its path (``pic.documents[0]``) and its value (cut short),
or a 400 for malformed JSON (where the parser stopped: line, column, character), a body that is not UTF-8 (at which
byte), a body that is not a JSON object (naming the content-type it came with, when that was not read as JSON), an
unknown field, an unsupported parameter or a message's content part of another type than text (naming its type and
path: ``messages[1].content[0]``); Starlette's own errors (an unknown route, a wrong method:
405 with its ``Allow`` header) and an unexpected exception (a 500) keep their status in the same shape, so a
client parses one error format whatever went wrong.
"""

from __future__ import annotations

import difflib
import json
import reprlib

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match

from pic.errors import PicError
from pic.serve.http import error_response, exception_error, pic_error_response, read_as_json, sent_content_type
from pic.serve.schemas import UNSUPPORTED_PART, ChunksBody, PicOptions

# Pydantic error types that are a 400 (the request is wrong as a whole), not a 422 (a value is).
_BAD_REQUEST = ("unknown_parameter", "unsupported_parameter")


def install_error_handlers(app: FastAPI) -> None:
    """Answer ``PicError``s, validation errors, Starlette's HTTP errors and any other exception in OpenAI's
    error shape."""
    app.add_exception_handler(PicError, lambda _request, exc: pic_error_response(exc))
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _server_error)


def _server_error(_request: Request, exc: Exception) -> JSONResponse:
    """A bug's 500 as JSON (Starlette re-raises the exception after sending it, so it is still logged)."""
    status, body = exception_error(exc)
    return JSONResponse(body, status_code=status)


def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (an unknown route, a wrong method) in OpenAI's error shape; FastAPI's 400 for a
    body whose parse failed by a ``PicError`` of ours (``bodies.parse``: not UTF-8) answers that error's words."""
    if isinstance(exc.__cause__, PicError):
        return pic_error_response(exc.__cause__)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    message = f"{exc.detail}: {_request.method} {_request.url.path}"
    if exc.status_code == 404:
        message += _nearest_routes(_request)
    response = error_response(exc.status_code, message, kind=kind)
    response.headers.update(exc.headers or {})
    if exc.status_code == 405:
        response.headers["allow"] = _allowed(_request)
    return response


def _nearest_routes(request: Request) -> str:
    """``"; did you mean POST /v1/chat/completions?"`` for a path close to the app's routes (a 404's hint)."""
    routes: dict[str, set[str]] = {}
    for route in request.app.router.routes:
        path = getattr(route, "path", None)
        if isinstance(path, str) and getattr(route, "include_in_schema", True):
            routes.setdefault(path, set()).update(getattr(route, "methods", None) or ())
    near = difflib.get_close_matches(request.url.path.rstrip("/") or "/", list(routes), n=2, cutoff=0.6)
    if not near:
        return f"; the routes: {', '.join(sorted(routes))}"
    named = ["/".join(sorted(routes[p] - {"HEAD"}) or ["GET"]) + f" {p}" for p in near]
    return f"; did you mean {' or '.join(named)}?"


def _allowed(request: Request) -> str:
    """The ``Allow`` of a 405: the methods of every route on the path (Starlette names only the first route's,
    so ``/v1/chunks/{id}``'s GET hid its DELETE)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        if isinstance(route, BaseRoute) and route.matches(request.scope)[0] is not Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return ", ".join(sorted(methods))


def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    """422 naming each bad field (by its path, ``pic.documents[0]``) and value; a body that is not JSON at all,
    and a parameter this server does not support, are 400s."""
    errors = exc.errors()
    refused = [e for e in errors if e.get("type") in _BAD_REQUEST]
    if refused:
        return error_response(400, refused[0]["msg"], param=refused[0].get("ctx", {}).get("param"))
    part = next((e for e in errors if e.get("type") == UNSUPPORTED_PART), None)
    if part is not None:  # an image (or other) part in a message: the request asks for what this server lacks
        where = f"{field_path(part['loc'])}[{part['ctx']['index']}]"
        return error_response(400, f"{where} {part['msg']}", param=where)
    malformed = next((e for e in errors if e.get("type") == "json_invalid"), None)
    if malformed is not None:
        return error_response(400, _malformed(malformed, exc.body))
    if any(tuple(e["loc"]) == ("body",) for e in errors):
        return error_response(400, f"the request body is not a valid JSON object{_sent_as(_request)}")
    problems = [_problem(err) for err in errors[:_MAX_PROBLEMS]]
    if len(errors) > _MAX_PROBLEMS:
        problems.append(f"and {len(errors) - _MAX_PROBLEMS} more")
    return error_response(422, "; ".join(problems), param=field_path(errors[0]["loc"]) if errors else None)


def field_path(loc: tuple) -> str:
    """A field's path as a client writes it: ``("body", "pic", "documents", 0)`` -> ``pic.documents[0]``."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part != "body":
            path += f".{part}" if path else str(part)
    return path


def _problem(err: dict) -> str:
    """One bad field, in words: its path, then what is wrong (the value echoed, cut short; a missing field's
    "value" is the body around it, which pydantic hands over, and is not echoed)."""
    where, value = field_path(err["loc"]), err.get("input")
    if err.get("type") == "missing":
        return f"{where}: a required field is missing"
    if err.get("type") == "list_type" and isinstance(value, str):
        one = _message(value) if where == "messages" else _echo(value)
        return f"{where} is a string ({_echo(value)}), not a list: pass a list ([{one}] for one)"
    if err.get("type") in _NOT_AN_OBJECT and where.startswith("messages[") and isinstance(value, str):
        return f"{where}={_echo(value)}: a message is an object with a role and content: {_message(value)}"
    if err.get("type") == "extra_forbidden":
        return _unknown_field(err["loc"], where)
    return f"{where}={_echo(value)}: {err['msg'].removeprefix('Value error, ')}"


_NOT_AN_OBJECT = ("model_type", "model_attributes_type", "dict_type")


def _message(text: str) -> str:
    """``text`` as a chat message a client would send: ``{"role": "user", "content": "hi"}``."""
    return json.dumps({"role": "user", "content": text if len(text) <= _MAX_ECHO else text[:_MAX_ECHO] + "..."})


# The objects whose unknown fields are refused (``extra="forbid"``), by where they sit in a body.
_FORBIDDING: dict[tuple, type[BaseModel]] = {("body", "pic"): PicOptions, ("body",): ChunksBody}


def _unknown_field(loc: tuple, where: str) -> str:
    """An unknown field of ``pic`` (or of ``/v1/chunks``' body): the nearest known one, and all of them."""
    model = _FORBIDDING.get(tuple(loc[:-1]))
    if model is None:
        return f"{where}: unknown field"
    fields = list(model.model_fields)
    near = difflib.get_close_matches(str(loc[-1]), fields, n=1)
    owner = f"{field_path(loc[:-1])}'s" if len(loc) > 2 else "the body's"
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return f"{where}: unknown field{hint}; {owner} fields: {', '.join(fields)}"


def _malformed(err: dict, body: object) -> str:
    """A body that does not parse as JSON: the parser's reason and where (line, column and character, as
    Python's ``json`` says it), whatever content-type it came with (it was read as JSON)."""
    pos = err["loc"][-1] if isinstance(err["loc"][-1], int) else None
    reason = err.get("ctx", {}).get("error", "not JSON")
    if pos is None:
        return f"the request body is malformed JSON: {reason}"
    if not isinstance(body, str):
        return f"the request body is malformed JSON: {reason} at character {pos}"
    line, column = body.count("\n", 0, pos) + 1, pos - body.rfind("\n", 0, pos)
    return f"the request body is malformed JSON: {reason} at line {line}, column {column} (char {pos})"


def _sent_as(request: Request) -> str:
    """What a body that is not JSON came as, when it was not read as JSON (``text/plain``); a body without a
    content-type, or with curl -d's form type, was read as JSON, and its content-type is not the problem."""
    sent = sent_content_type(request.scope)
    if read_as_json(sent):
        return ""
    return f" (it came with content-type {sent[:_MAX_ECHO]!r}; send JSON, with content-type: application/json)"


# An error names at most this many problems, each value echoed in at most this many characters: a large
# bad body gets a short answer, not a copy of itself.
_MAX_PROBLEMS, _MAX_ECHO = 8, 80


# Never the whole repr of a large value: a list of a million numbers takes a good part of a second to repr, on the
# event loop.
_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = _MAX_ECHO + 2
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 8
_SHORT.maxlevel = 3


def _echo(value: object) -> str:
    """``repr(value)``, cut to ``_MAX_ECHO`` characters, with the size it had when cut (a string's characters,
    a list's or an object's items); built from the value's first items and characters only."""
    if isinstance(value, str):
        text = repr(value[: _MAX_ECHO + 1])
        if len(value) <= _MAX_ECHO and len(text) <= _MAX_ECHO:
            return text
        return f"{text[:_MAX_ECHO]}... ({len(value)} characters)"
    text = _SHORT.repr(value)
    sized = isinstance(value, (list, tuple, dict))
    if sized and (len(text) > _MAX_ECHO or len(value) > _SHORT.maxlist):
        return f"{text[:_MAX_ECHO]}... ({len(value)} item{'s' * (len(value) != 1)})"
    return text if len(text) <= _MAX_ECHO else f"{text[:_MAX_ECHO]}..."
