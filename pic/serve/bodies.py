"""Large JSON request bodies parsed off the event loop.

FastAPI parses a route's JSON body with ``json.loads`` on the event loop: a few megabytes of small numbers take a
good part of a second, and a flood of them held ``GET /health``, and every stream's next token with it (measured in
docs/serve.md). Routes of ``OffLoopRoute`` parse a body over ``OFF_LOOP_BYTES`` on a thread of their
own pool instead (``json.loads`` holds the GIL while it runs, so the loop still waits for the parse under way, but
for one parse at most, not for every queued one). A small body is parsed where it is: a thread's hand-off costs more
than its parse.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from pic.errors import InvalidInputError

OFF_LOOP_BYTES = 64 << 10
"""Bodies longer than this are parsed on a thread (a 64 KiB body parses in well under a millisecond)."""

# One thread: parses hold the GIL, so more threads would not parse faster, only make the loop wait behind more of
# them. A pool of the module's own, not the CPU pool's: a burst of bodies never queues tokenizing behind it.
_PARSER = ThreadPoolExecutor(1, thread_name_prefix="pic-serve-json")


class OffLoopRequest(Request):
    """A ``Request`` whose ``json()`` parses a large body on ``_PARSER``'s thread (the same ``json.loads``, so a
    malformed body raises the same ``JSONDecodeError`` and gets the same 400)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            if len(body) > OFF_LOOP_BYTES:
                self._json = await asyncio.get_running_loop().run_in_executor(_PARSER, parse, body)
            else:
                self._json = parse(body)
        return self._json


def parse(body: bytes) -> Any:
    """A request body's JSON (``json.loads``, as FastAPI parses it).

    Raises:
        InvalidInputError: the body's bytes are not text in the encoding ``json.loads`` found (UTF-8, unless the
            body starts with another's mark), naming where they stop being it (FastAPI answers any other error of a
            parse with a 400 "There was an error parsing the body", raised from this one: ``handlers`` says this).
    """
    try:
        return json.loads(body)
    except UnicodeDecodeError as exc:
        raise InvalidInputError(_not_text(exc)) from None


def _not_text(exc: UnicodeDecodeError) -> str:
    """``the request body is not valid UTF-8 at byte 17 (0xff)``."""
    encoding = exc.encoding.upper().replace("_", "-")
    byte = exc.object[exc.start]
    return f"the request body is not valid {encoding} at byte {exc.start} (0x{byte:02x}): send JSON as UTF-8 text"


class OffLoopRoute(APIRoute):
    """An ``APIRoute`` whose handler reads the request as an ``OffLoopRequest`` (``app.router.route_class``)."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(OffLoopRequest(request.scope, request.receive, request._send))

        return route
