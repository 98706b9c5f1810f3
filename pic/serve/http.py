"""HTTP plumbing of the server: OpenAI-style error bodies, the bearer-key check (or, without a key, the Host,
Origin and content-type checks), the body-size limit, the body-read timeout, JSON bodies sent without their
content-type, and access-log lines with long paths cut.

The guards are plain ASGI middleware, so they run before routing and parsing: an unauthenticated, oversized,
stalled or cross-site request never reaches a handler (nor a JSON parser). The header-read timeout comes before
any ASGI code runs: ``protocol.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from dataclasses import dataclass

from fastapi.responses import JSONResponse

from pic.errors import (
    ContextLengthError,
    EngineStepError,
    InvalidInputError,
    KVPoolExhaustedError,
    PicError,
    PolicyError,
    StoreUnavailableError,
    UnknownCacheIdError,
    shown_id,
)
from pic.serve.hosts import AllowedHosts
from pic.serve.tenants import Tenant, Tenants

# On a server with an API key, a POST body with no content-type, or curl -d's form type, is taken as JSON: every
# body this server reads is JSON, and the header is easy to forget (curl -d sends the form type unless told
# otherwise). Without a key, only JSON's own type is read (``_not_json``): a web page can send either of these
# to any site without asking first, and a keyless server would run what it sent.
_TAKEN_AS_JSON = ("", "application/x-www-form-urlencoded")
_JSON = "application/json"
# The scope key under which the Guard keeps a request's content-type as it came (``sent_content_type``).
_SENT_CONTENT_TYPE = "pic.sent_content_type"

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
    if isinstance(exc, EngineStepError) and isinstance(exc.__cause__, Exception):
        exc = exc.__cause__  # (a bug or a device fault of the server's: answered as the fault)
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


async def _send_json(send, status: int, message: str, kind: str, *, retry_after_s: float | None = None) -> None:
    body = json.dumps(error_body(status, message, kind=kind)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if retry_after_s is not None:
        headers.append((b"retry-after", str(max(1, math.ceil(retry_after_s))).encode()))
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if status == 415:
        headers.append((b"accept", _JSON.encode()))  # RFC 9110 15.5.16: the media types that would have been read
    if status == 408:
        headers.append((b"connection", b"close"))  # the rest of the body may still come: no next request
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def sent_content_type(scope: dict) -> str | None:
    """The content-type a request came with, before the ``Guard`` took its body as JSON (``None``: no header)."""
    sent = scope.get(_SENT_CONTENT_TYPE, _header(scope, b"content-type"))
    return None if sent is None else sent.decode("latin-1")


def read_as_json(content_type: str | None) -> bool:
    """Whether a body sent with ``content_type`` (``None``: no header) was parsed as JSON: JSON's own type, and
    the ones the ``Guard`` takes as JSON."""
    return _media_type(content_type) in (*_TAKEN_AS_JSON, _JSON)


def _media_type(content_type: str | bytes | None) -> str:
    """``"Application/JSON; charset=utf-8"`` -> ``"application/json"`` (``None``: ``""``)."""
    text = content_type.decode("latin-1") if isinstance(content_type, bytes) else content_type or ""
    return text.split(";")[0].strip().lower()


def _header(scope: dict, name: bytes) -> bytes | None:
    return next((value for key, value in scope["headers"] if key == name), None)  # ASGI names: lower case


def _take_as_json(scope: dict) -> None:
    """A POST without a content-type, or with curl -d's ``application/x-www-form-urlencoded``, gets
    ``application/json`` in ``scope`` (the app parses only JSON-typed bodies as JSON; the others were "not a
    JSON object" however JSON they were); what it came with is kept for the error of a body that is not JSON."""
    sent = _header(scope, b"content-type")
    if scope["method"] != "POST" or _media_type(sent) not in _TAKEN_AS_JSON:
        return
    scope[_SENT_CONTENT_TYPE] = sent
    headers = [(key, value) for key, value in scope["headers"] if key != b"content-type"]
    scope["headers"] = [*headers, (b"content-type", b"application/json")]  # in place: outer middleware sees it too


class Guard:
    """ASGI middleware: on every path but ``/health``, the caller's tenant (``tenants``: the one whose key
    ``Authorization: Bearer KEY`` carries, found by the key's SHA-256, so no key is compared byte by byte; a wrong or
    missing key is a 401), its request rate (a 429 with ``Retry-After`` beyond it), and the tenant set in the
    request's state (``tenant_of``: the routes take the namespace from there, never from the request); request bodies
    of at most ``max_body_bytes`` (413 otherwise, by the declared length or by the bytes actually received), no wait
    of over ``body_timeout_s`` for the next piece of a body (408, and the connection closed: a client trickling
    nothing holds no handler), and, with keys, a POST body sent without a content-type (or as curl -d's form) taken
    as JSON.

    Without keys (``tenants.keyed`` false), a web page must not be able to use the server: every path but
    ``/health`` needs a ``Host`` naming the server's own address or one of ``allowed_hosts``, and an ``Origin``, when
    sent, of the same (403 otherwise: ``hosts.AllowedHosts``); and a POST must come as ``application/json``, the one
    type a page cannot send to another site without the browser asking the server first (415 otherwise)."""

    def __init__(
        self,
        app,
        *,
        tenants: Tenants,
        max_body_bytes: int,
        body_timeout_s: float = 30.0,
        allowed_hosts: AllowedHosts | None = None,
    ) -> None:
        self.app, self.max_body_bytes, self.body_timeout_s = app, max_body_bytes, body_timeout_s
        self._tenants = tenants
        self._hosts = allowed_hosts or AllowedHosts()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self._refusal(scope)
        if refusal is not None:
            return await _send_json(
                send, refusal.status, refusal.message, refusal.kind, retry_after_s=refusal.retry_after_s
            )
        if self._tenants.keyed:
            _take_as_json(scope)
        received, refused, body_done = 0, None, False

        async def guarded_receive():
            nonlocal received, refused, body_done
            if body_done:  # after the body, receive waits for the disconnect: as long as it takes
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout_s)
            except asyncio.TimeoutError:
                refused = _Refused(408, self._stalled(received))
                raise refused from None
            body_done = not message.get("more_body", False)
            received += len(message.get("body", b""))
            if received > self.max_body_bytes:
                refused = _Refused(413, self._too_large(received))
                raise refused
            return message

        async def checked_send(message) -> None:
            # A framework that catches the error while reading the body answers 400 on its own: say why.
            if refused is None:
                await send(message)
            elif message["type"] == "http.response.start":
                await _send_json(send, refused.status, refused.message, "invalid_request_error")

        try:
            await self.app(scope, guarded_receive, checked_send)
        except _Refused as exc:
            await _send_json(send, exc.status, exc.message, "invalid_request_error")

    def _refusal(self, scope: dict) -> _Refusal | None:
        """What a request gets before the app runs, or ``None`` (its tenant then set in its state): a wrong or
        missing key (401); without keys, a foreign Host or Origin (403) or a POST not sent as JSON (415); a tenant
        over its rate (429); a declared length over the limit (413)."""
        headers, guarded = dict(scope["headers"]), scope["path"] != "/health"
        if guarded:
            tenant = self._tenants.find(_bearer(headers.get(b"authorization")))
            if tenant is None:
                return _Refusal(401, "missing or wrong API key (Authorization: Bearer KEY)", "auth_error")
            if not self._tenants.keyed:
                foreign = self._hosts.refusal(scope)
                if foreign is not None:
                    return _Refusal(403, foreign, "permission_error")
                if scope["method"] == "POST" and _media_type(headers.get(b"content-type")) != _JSON:
                    return _Refusal(415, _not_json(headers.get(b"content-type")), "invalid_request_error")
            wait_s = 0.0 if tenant.rate is None else tenant.rate.take()
            if wait_s > 0:
                return _Refusal(429, _over_rate(tenant, wait_s), "rate_limit_exceeded", retry_after_s=wait_s)
            scope.setdefault("state", {})[_TENANT] = tenant
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return _Refusal(413, self._too_large(int(declared)), "invalid_request_error")
        return None

    def _too_large(self, num_bytes: int) -> str:
        """The 413's words: the limit and the flag that sets it (an operator raises it; a client sends less)."""
        return (
            f"request body of {num_bytes} bytes is over the limit of {self.max_body_bytes} bytes that pic serve's "
            "--max-body-bytes sets: send a smaller body, or start the server with a larger one"
        )

    def _stalled(self, num_bytes: int) -> str:
        return f"the request body stalled: nothing more came for {self.body_timeout_s:g} s after {num_bytes} bytes"


# The request state's key of the caller's tenant (set by the ``Guard``, read by ``tenant_of``).
_TENANT = "pic_tenant"


def tenant_of(request) -> Tenant:
    """The tenant the ``Guard`` found for ``request`` (a FastAPI dependency of every route but ``/health``)."""
    return request.scope["state"][_TENANT]


def _bearer(header: bytes | None) -> bytes | None:
    """The key of ``Authorization: Bearer KEY`` (``None``: no such header)."""
    if header is None or not header.startswith(b"Bearer "):
        return None
    return header[len(b"Bearer ") :]


def _over_rate(tenant: Tenant, wait_s: float) -> str:
    rate = tenant.rate
    return (
        f"too many requests: at most {rate.per_s:g} a second ({rate.burst} at once) for this key; retry in "
        f"{wait_s:.2f} s (Retry-After)"
    )


@dataclass(frozen=True)
class _Refusal:
    """A request the ``Guard`` answers itself: its status, message, OpenAI error type, and a 429's wait."""

    status: int
    message: str
    kind: str
    retry_after_s: float | None = None


def _not_json(content_type: bytes | None) -> str:
    """The 415 of a POST to a keyless server that did not come as ``application/json``."""
    sent = "no content-type" if content_type is None else f"content-type {content_type.decode('latin-1')!r:.80}"
    return (
        f"the request body came with {sent}; a server without an API key reads only bodies sent as content-type: "
        "application/json (the one type a web page cannot send to another site unasked): send that header "
        "(curl -H 'content-type: application/json' -d '{...}'), or start the server with --api-key"
    )


class _Refused(Exception):
    """A body the Guard refuses while the app reads it: the status (413, 408) and the message to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class CutLongPaths(logging.Filter):
    """A filter for uvicorn's access log (``uvicorn.access``): a request path over ``limit`` characters is logged
    cut, with its length (``shown_id``): a client that sends an unknown 16 KB id in a path, again and again, would
    otherwise write it whole into the log for every request."""

    def __init__(self, limit: int = 96) -> None:
        super().__init__()
        self.limit = limit

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 5 and isinstance(args[2], str) and len(args[2]) > self.limit:
            record.args = (*args[:2], cut_path(args[2], self.limit), *args[3:])
        return True


def cut_path(path: str, limit: int = 96) -> str:
    """``path`` when it has at most ``limit`` characters, else each of its segments over 32 characters cut as
    ``shown_id`` cuts an id, and the whole cut to ``limit`` (``/v1/chunks/'abcd…' (16000 characters)``)."""
    if len(path) <= limit:
        return path
    segments = [s if len(s) <= 32 else shown_id(s) for s in path.split("/")]
    cut = "/".join(segments)
    return cut if len(cut) <= limit else f"{cut[:limit]}… ({len(path)} characters)"
