"""The app's exception handlers: every error the app answers is OpenAI's error body.

A validation error is a 422 naming each bad field and its value (cut short), or a 400 for a body that is not
JSON (naming the content-type it came with, when that was not JSON's), an unknown field or an unsupported
parameter; Starlette's own errors (an unknown route, a wrong method:
405 with its ``Allow`` header) and an unexpected exception (a 500) keep their status in the same shape, so a
client parses one error format whatever went wrong.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match

from pic.errors import PicError
from pic.serve.http import error_response, exception_error, pic_error_response, sent_content_type

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
    """Starlette's own errors (an unknown route, a wrong method) in OpenAI's error shape."""
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    response = error_response(exc.status_code, f"{exc.detail}: {_request.method} {_request.url.path}", kind=kind)
    response.headers.update(exc.headers or {})
    if exc.status_code == 405:
        response.headers["allow"] = _allowed(_request)
    return response


def _allowed(request: Request) -> str:
    """The ``Allow`` of a 405: the methods of every route on the path (Starlette names only the first route's,
    so ``/v1/chunks/{id}``'s GET hid its DELETE)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        if isinstance(route, BaseRoute) and route.matches(request.scope)[0] is not Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return ", ".join(sorted(methods))


def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    """422 naming each bad field and value; a body that is not JSON at all, and a parameter this server does
    not support, are 400s."""
    errors = exc.errors()
    refused = [e for e in errors if e.get("type") in _BAD_REQUEST]
    if refused:
        return error_response(400, refused[0]["msg"], param=refused[0].get("ctx", {}).get("param"))
    not_json = any(e.get("type") == "json_invalid" or tuple(e["loc"]) == ("body",) for e in errors)
    if not_json:
        return error_response(400, f"the request body is not a valid JSON object{_sent_as(_request)}")
    problems = []
    for err in errors[:_MAX_PROBLEMS]:
        where = ".".join(str(p) for p in err["loc"] if p != "body")
        problems.append(f"{where}={_echo(err.get('input'))}: {err['msg'].removeprefix('Value error, ')}")
    if len(errors) > _MAX_PROBLEMS:
        problems.append(f"and {len(errors) - _MAX_PROBLEMS} more")
    return error_response(422, "; ".join(problems), param=str(errors[0]["loc"][-1]) if errors else None)


def _sent_as(request: Request) -> str:
    """What a body that is not JSON came as, when that was not ``application/json`` (text/plain is not parsed
    as JSON; a body without a content-type, or curl -d's form type, was tried as JSON)."""
    sent = sent_content_type(request.scope)
    if sent is not None and sent.split(";")[0].strip().lower() == "application/json":
        return ""
    came = "without a content-type" if sent is None else f"with content-type {sent[:_MAX_ECHO]!r}"
    return f" (it came {came}; send JSON, with content-type: application/json)"


# An error names at most this many problems, each value echoed in at most this many characters: a large
# bad body gets a short answer, not a copy of itself.
_MAX_PROBLEMS, _MAX_ECHO = 8, 80


def _echo(value: object) -> str:
    """``repr(value)``, cut to ``_MAX_ECHO`` characters (with the length it had)."""
    text = repr(value)
    return text if len(text) <= _MAX_ECHO else f"{text[:_MAX_ECHO]}... ({len(text)} characters)"
