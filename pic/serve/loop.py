"""The server's engine driver: one asyncio task steps the batched engine; handlers only queue and await.

Handlers never touch engine state: they hand requests in through ``Engine.submit`` (thread-safe: the
engine's inbox) and await their outputs on an ``asyncio.Queue``. One task steps the engine in a worker
thread, one step at a time, while anything is queued or running, and moves each watched request's
outputs (its ``outbox``) to its queue. A step run by another thread (a ``compile`` handed to the engine by
``PIC.compile`` in a worker thread) fills the same outboxes, so nothing is lost whoever steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from pic.api import PIC
from pic.engine import Request, RequestOutput
from pic.engine.sequence import Sequence

logger = logging.getLogger(__name__)


class AsyncEngine:
    """Async access to one ``PIC``'s engine for a server's event loop."""

    def __init__(self, engine: PIC) -> None:
        self.pic = engine
        self.core = engine.engine()
        self._queues: dict[int, tuple[Sequence, asyncio.Queue[RequestOutput]]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._drive())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """The request's outputs as the engine produces them; leaving early (a client gone) aborts it."""
        seq = self.core.submit(request, watched=True)
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[seq.request_id] = (seq, queue)
        self._wake.set()
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.core.abort(seq.request_id)
                self._wake.set()  # the abort is work: step it, so the blocks are freed now

    async def _drive(self) -> None:
        while True:
            if not self.core.has_unfinished():
                self._wake.clear()
                if not self.core.has_unfinished():
                    await self._wake.wait()
                continue
            try:
                stepped = await asyncio.to_thread(self.core.driver.try_run, self.core.step)
            except Exception:  # a forward's failure fails its batch inside step; anything else is a bug
                logger.exception("pic serve: an engine step failed")
                stepped = False
            self._dispatch()
            if not stepped:  # another thread owns the engine (a compile): let it step
                await asyncio.sleep(0.001)

    def _dispatch(self) -> None:
        for request_id, (seq, queue) in list(self._queues.items()):
            while seq.outbox:
                out = seq.outbox.popleft()
                queue.put_nowait(out)
                if out.finished:
                    del self._queues[request_id]
