"""HTTP plumbing of the server: OpenAI-style error bodies, the bearer-key check and the body-size limit.

Both guards are plain ASGI middleware, so they run before routing and parsing: an unauthenticated or
oversized request never reaches a handler (nor a JSON parser).
"""

from __future__ import annotations

import hmac
import json

from fastapi.responses import JSONResponse

from pic.errors import (
    ContextLengthError,
    InvalidInputError,
    KVPoolExhaustedError,
    PicError,
    PolicyError,
    StoreUnavailableError,
    UnknownCacheIdError,
)

# PicError subclasses -> HTTP status (the first match wins; any other PicError is a 400).
_STATUS: tuple[tuple[type[PicError], int], ...] = (
    (UnknownCacheIdError, 404),
    (ContextLengthError, 400),
    (PolicyError, 400),
    (InvalidInputError, 400),
    (KVPoolExhaustedError, 503),
    (StoreUnavailableError, 503),
)


def error_body(status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None) -> dict:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}`` (a JSON response's body, or the
    data of a stream's last event: the ``openai`` client raises on either)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None):
    """OpenAI's error body as a JSON response with ``status``."""
    return JSONResponse(error_body(status, message, kind=kind, param=param), status_code=status)


def exception_error(exc: Exception) -> tuple[int, dict]:
    """The status and error body of a request that failed with ``exc``: a ``PicError``'s status by its class
    (any other one is a 400); any other exception is a bug or a device fault of the server's, not the client's
    doing: a 500. One mapping whether the failure comes before the response (a JSON error) or after its
    first token (a stream's error event), so the client reads the same status either way."""
    if not isinstance(exc, PicError):
        status, message, kind = 500, f"the request failed: {type(exc).__name__}: {exc}", "server_error"
    else:
        status, message = next((code for cls, code in _STATUS if isinstance(exc, cls)), 400), str(exc)
        kind = "not_found_error" if status == 404 else "server_busy" if status == 503 else "invalid_request_error"
    return status, error_body(status, message, kind=kind)


def pic_error_response(exc: Exception) -> JSONResponse:
    """The JSON error response of a request that failed with ``exc`` (see ``exception_error``)."""
    status, body = exception_error(exc)
    return JSONResponse(body, status_code=status)


async def _send_json(send, status: int, message: str, kind: str) -> None:
    body = json.dumps(error_body(status, message, kind=kind)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Guard:
    """ASGI middleware: ``Authorization: Bearer <api_key>`` on every path but ``/health`` (compared in
    constant time), and request bodies of at most ``max_body_bytes`` (413 otherwise, by the declared length
    or by the bytes actually received)."""

    def __init__(self, app, *, api_key: str | None, max_body_bytes: int) -> None:
        self.app, self.max_body_bytes = app, max_body_bytes
        self._key = None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self._key is not None and scope["path"] != "/health":
            if not hmac.compare_digest(headers.get(b"authorization", b""), self._key):
                return await _send_json(send, 401, "missing or wrong API key (Authorization: Bearer KEY)", "auth_error")
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return await _send_json(send, 413, self._too_large(int(declared)), "invalid_request_error")
        received, too_large = 0, False

        async def limited_receive():
            nonlocal received, too_large
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_body_bytes:
                too_large = True
                raise _BodyTooLarge(received)
            return message

        async def checked_send(message) -> None:
            # A framework that catches the error while reading the body answers 400 on its own: say 413.
            if not too_large:
                await send(message)
            elif message["type"] == "http.response.start":
                await _send_json(send, 413, self._too_large(received), "invalid_request_error")

        try:
            await self.app(scope, limited_receive, checked_send)
        except _BodyTooLarge as exc:
            await _send_json(send, 413, self._too_large(exc.num_bytes), "invalid_request_error")

    def _too_large(self, num_bytes: int) -> str:
        return f"request body of {num_bytes} bytes is over the limit of {self.max_body_bytes} bytes"


class _BodyTooLarge(Exception):
    def __init__(self, num_bytes: int) -> None:
        super().__init__(num_bytes)
        self.num_bytes = num_bytes
