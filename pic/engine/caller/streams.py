"""Sinks that carry a request's outputs from the engine's thread to the thread or event loop waiting on them."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Callable

from pic.engine.commands import LIVENESS_S
from pic.engine.request import LinkOutput, RequestOutput
from pic.errors import EngineClosedError

Item = RequestOutput | LinkOutput


class RequestStream:
    """One request's outputs, for a thread that waits on them (``link``, ``generate``, ``stream``).

    ``last_only`` keeps only what ends a wait (a ``LinkOutput``, a finished output): a caller that wants
    the generation, not its pieces, is then woken once, not once per token.
    """

    def __init__(self, alive: Callable[[], bool], *, last_only: bool = False) -> None:
        self._queue: queue.SimpleQueue[Item] = queue.SimpleQueue()
        self._alive, self._last_only = alive, last_only

    def put(self, item: Item) -> None:
        if _wanted(item, last_only=self._last_only):
            self._queue.put(item)

    def get(self) -> Item:
        """The next output, waiting for it.

        Raises:
            EngineClosedError: the engine's thread ended without sending it.
        """
        while True:
            try:
                return self._queue.get(timeout=LIVENESS_S)
            except queue.Empty:
                if not self._alive():
                    raise EngineClosedError("the engine's thread ended before the request did") from None


class AsyncRequestStream:
    """One request's outputs, for a coroutine on ``loop`` (the server): ``put`` hands each over thread-safely
    (``last_only``: as ``RequestStream``'s)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *, last_only: bool = False) -> None:
        self._loop, self._last_only = loop, last_only
        self._queue: asyncio.Queue[Item] = asyncio.Queue()

    def put(self, item: Item) -> None:
        if not _wanted(item, last_only=self._last_only):
            return
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    async def get(self) -> Item:
        return await self._queue.get()


def _wanted(item: Item, *, last_only: bool) -> bool:
    """Whether a stream hands ``item`` over: everything, or (``last_only``) only what ends a wait."""
    return not (last_only and isinstance(item, RequestOutput) and not item.finished)
