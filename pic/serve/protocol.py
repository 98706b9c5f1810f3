"""uvicorn's HTTP/1.1 protocol with a header-read deadline: a connection must deliver a request's whole
header within ``headers_timeout_s`` of opening (or, on a kept-alive connection, of the next request's first
byte), else it gets a 408 and is closed.

uvicorn has a keep-alive timeout but no header timeout: 100 connections trickling a header one byte a second
were each held open for as long as they kept trickling (slowloris). ASGI middleware cannot help, as no ASGI
code runs before the header is complete, so the deadline lives in the protocol: a subclass of uvicorn's h11
one (``uvicorn.Config(http=timed_protocol(...))``). The body's own timeout is the ``Guard``'s (``http.py``);
this protocol also bounds a body nobody reads (the rest of an upload after an early 401 or 413), which uvicorn
would drain for as long as it trickles, to ``body_timeout_s`` in all.

A request framed twice, with both ``Content-Length`` and ``Transfer-Encoding``, is read by its Transfer-Encoding
(h11's rule) and answered, and its connection closed after the answer (RFC 9112 §6.1): a proxy in front that
read it by its Content-Length disagrees about where it ends, and what one of them takes for the next request on
the connection is one the other never checked (request smuggling). uvicorn kept such a connection open.
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from pic.serve.http import error_body

KEEP_ALIVE_S = 65.0
"""How long an idle kept-alive connection stays open. Longer than any common client's own idle expiry (httpx,
under the ``openai`` client, drops its idle connections after 5 s): were the server's expiry equal to the
client's (uvicorn's default is 5 s too), a client could send its next request just as the server closes the
connection, and get "connection reset by peer" for a request the server never saw."""


def timed_protocol(headers_timeout_s: float = 10.0, body_timeout_s: float = 30.0) -> type[H11Protocol]:
    """uvicorn's h11 protocol with these deadlines (``uvicorn.run(app, http=timed_protocol(...))``)."""
    limits = {"headers_timeout_s": headers_timeout_s, "body_timeout_s": body_timeout_s}
    return type("TimedH11Protocol", (TimedH11Protocol,), limits)


class TimedH11Protocol(H11Protocol):
    """``H11Protocol`` with a deadline on each request's header, and one on draining an unread body.

    ``_phase`` says which deadline is armed: ``"headers"`` (from the connection's opening, or the next
    request's first byte, to its header's end) or ``"drain"`` (from the response's end to the end of the body
    nobody reads); ``None``: no deadline of this class (uvicorn's keep-alive timer covers an idle connection).
    """

    headers_timeout_s: float = 10.0
    body_timeout_s: float = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        self._phase: str | None = None
        super().connection_made(transport)
        self._arm("headers")  # a connection that sends nothing is closed too

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._phase is None and self.conn.their_state is h11.IDLE:
            self._arm("headers")  # the first byte of a kept-alive connection's next request
        super().data_received(data)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not None and self.cycle is not cycle:  # a new request's header came in
            _close_if_framed_twice(self.cycle)
        self._settle()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._settle()

    def _settle(self) -> None:
        """Match the deadline to where the connection is now."""
        if self._phase == "headers" and self.conn.their_state is not h11.IDLE:
            self._disarm()  # the header is in (or the connection failed, and uvicorn answered it)
        elif self._phase == "drain" and not self._draining():
            self._disarm()  # drained: idle now, as after any response
            if not self.transport.is_closing() and self.timeout_keep_alive_task is None:
                self.timeout_keep_alive_task = self.loop.call_later(
                    self.timeout_keep_alive, self.timeout_keep_alive_handler
                )
        if self._phase is None and self._draining():
            self._arm("drain")

    def _draining(self) -> bool:
        """The response went out while the client still sends a body the app did not read."""
        return self.cycle is not None and self.cycle.response_complete and self.conn.their_state is h11.SEND_BODY

    def _arm(self, phase: str) -> None:
        self._disarm()
        if phase == "headers":
            self._deadline = self.loop.call_later(self.headers_timeout_s, self._headers_timed_out)
        else:
            self._deadline = self.loop.call_later(self.body_timeout_s, self._close)
        self._phase = phase

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._phase = None, None

    def _headers_timed_out(self) -> None:
        """No whole header in time: a 408 in OpenAI's error shape (written raw: h11 cannot answer a request it
        has not parsed), then close."""
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            self._disarm()
            return
        message = f"the request header did not arrive within {self.headers_timeout_s:g} s"
        body = json.dumps(error_body(408, message)).encode()
        head = (
            "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        self.transport.write(head.encode() + body)
        self._close()

    def _close(self) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self.transport.close()


def _close_if_framed_twice(cycle) -> None:
    """Make a request that carries both Content-Length and Transfer-Encoding the connection's last: it is answered
    with ``Connection: close`` and the connection closed after (uvicorn does both for a request that asks for it:
    its cycle sees the header before the app's task first runs). ``cycle``: uvicorn's ``RequestResponseCycle``."""
    names = {name for name, _value in cycle.scope["headers"]}
    if b"content-length" in names and b"transfer-encoding" in names:
        cycle.keep_alive = False
        cycle.scope["headers"].append((b"connection", b"close"))
