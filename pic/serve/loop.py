"""The server's side of the engine: requests go to the engine's thread as commands, outputs come back on
the event loop through an ``asyncio.Queue`` (``AsyncRequestStream``). No task steps or polls the engine:
its own thread does, and hands each output to the loop thread-safely."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from pic.engine import Engine, Request, RequestOutput
from pic.engine.streams import AsyncRequestStream


class AsyncEngine:
    """Async access to one ``Engine`` for a server's event loop."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def generate(self, request: Request, *, pieces: bool = True) -> AsyncIterator[RequestOutput]:
        """The request's outputs as the engine produces them (``pieces=False``: only the last one, with the
        whole generation); leaving early (a client gone) aborts it.

        Raises:
            InvalidInputError: an empty query, a bad token id (before anything runs).
        """
        stream = AsyncRequestStream(asyncio.get_running_loop(), last_only=not pieces)
        request_id = await asyncio.to_thread(self.engine.submit, request, sink=stream)  # tokenizes: off the loop
        finished = False
        try:
            while not finished:
                out = await stream.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.engine.abort(request_id)
