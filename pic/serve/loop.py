"""The server's side of the engine: requests go to the engine's thread as commands, outputs come back on
the event loop through an ``asyncio.Queue`` (``AsyncRequestStream``). No task steps or polls the engine:
its own thread does, and hands each output to the loop thread-safely.

Blocking work runs off the loop on two thread pools of the server's own, never on asyncio's shared default
one: ``cpu`` for what needs only this process (tokenizing, rendering a chat template, submitting), ``store`` for
what may wait on a lower tier (compiles, which write through; describing, deleting and counting chunks). A
store call can hang for its timeout (a paused Redis) or, on a broken file system, longer: such calls fill only
the store pool, so a request that needs no store (a completion without documents) never queues behind them,
however many are stuck.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from pic.engine import Engine, Request, RequestOutput
from pic.engine.commands import ends_wait
from pic.engine.request import LinkOutput

_T = TypeVar("_T")

# Threads for work that waits on no store: tokenizing is short and CPU-bound, so a few suffice. Store calls
# wait on I/O instead: each stuck one holds a thread for its timeout, so there are many (their breakers then
# refuse at once until a probe succeeds, and the pool drains).
NUM_CPU_THREADS, NUM_STORE_THREADS = 4, 64


class AsyncRequestStream:
    """One request's outputs, for a coroutine on ``loop``: ``put`` (an ``OutputSink``'s, called on the engine's
    thread) hands each over thread-safely; ``last_only`` keeps only the finished output."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *, last_only: bool = False) -> None:
        self._loop, self._last_only = loop, last_only
        self._queue: asyncio.Queue[RequestOutput | LinkOutput] = asyncio.Queue()

    def put(self, item: RequestOutput | LinkOutput) -> None:
        if self._last_only and not ends_wait(item):
            return
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    async def get(self) -> RequestOutput | LinkOutput:
        return await self._queue.get()


class AsyncEngine:
    """Async access to one ``Engine`` for a server's event loop.

    Args:
        engine: the engine (its store and tokenizer are used from the pools' threads).
        num_store_threads: threads for store calls (``NUM_STORE_THREADS``).
    """

    def __init__(self, engine: Engine, *, num_store_threads: int = NUM_STORE_THREADS) -> None:
        self.engine = engine
        self._cpu = ThreadPoolExecutor(NUM_CPU_THREADS, thread_name_prefix="pic-serve-cpu")
        self._store = ThreadPoolExecutor(num_store_threads, thread_name_prefix="pic-serve-store")

    async def cpu(self, fn: Callable[..., _T], /, *args, **kwargs) -> _T:
        """``fn(*args, **kwargs)`` on a thread that never waits on a store tier."""
        return await self._run(self._cpu, fn, args, kwargs)

    async def store(self, fn: Callable[..., _T], /, *args, **kwargs) -> _T:
        """``fn(*args, **kwargs)`` on a thread of the store pool: for calls that may wait on a lower tier."""
        return await self._run(self._store, fn, args, kwargs)

    @staticmethod
    async def _run(pool: ThreadPoolExecutor, fn: Callable[..., _T], args: tuple, kwargs: dict) -> _T:
        return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args, **kwargs))

    async def generate(self, request: Request, *, pieces: bool = True) -> AsyncIterator[RequestOutput]:
        """The request's outputs as the engine produces them (``pieces=False``: only the last one, with the
        whole generation); leaving early (a client gone) aborts it.

        Raises:
            InvalidInputError: an empty query, a bad token id (before anything runs).
        """
        stream = AsyncRequestStream(asyncio.get_running_loop(), last_only=not pieces)
        request_id = await self.cpu(self.engine.submit, request, sink=stream)  # tokenizes: off the loop
        finished = False
        try:
            while not finished:
                out = await stream.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.engine.abort(request_id)
