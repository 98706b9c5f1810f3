"""The core thread: the only thread that runs an ``EngineCore`` (vLLM's EngineCore busy loop, in-process).

It blocks on its command queue while no work can run (an idle engine costs no CPU; a request waiting on the
loader is woken by a ``Wake``), and otherwise alternates: run every command that arrived, then one step.
Outputs reach their clients through the requests' sinks; answers through the commands' futures. Nothing
else touches the core, its pool or its device tier, so nothing needs a lock.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import TypeVar

from pic.engine.commands import Ask, Close, Command, Pause, Wake, wait
from pic.engine.core.core import EngineCore
from pic.errors import EngineClosedError
from pic.model.inputs import AttentionObserver

_T = TypeVar("_T")


class CoreThread:
    """The thread that owns a core, and the one way in (``pic.engine.commands.Channel``). Holds no reference to the
    ``Engine`` it serves, so dropping the engine can close it."""

    def __init__(self, core: EngineCore) -> None:
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        core.wake = lambda: self._commands.put(Wake())
        self._thread = threading.Thread(target=run, args=(core, self._commands), name="pic-engine", daemon=True)
        self._closed = False
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def is_current(self) -> bool:
        return threading.current_thread() is self._thread

    def send(self, command: Command) -> None:
        """Queue ``command`` (``EngineClosedError`` once the engine is closed)."""
        if self._closed:
            raise EngineClosedError("the engine was closed; build a new one")
        self._commands.put(command)

    def call(self, make: Callable[[Future], Command]) -> object:
        reply: Future = Future()
        self.send(make(reply))
        return self.wait(reply)

    def ask(self, read: Callable[[EngineCore], _T]) -> _T:
        return self.call(lambda reply: Ask(read, reply))

    def wait(self, future: Future[_T]) -> _T:
        return wait(future, self.alive)

    @contextlib.contextmanager
    def paused(self) -> Iterator[EngineCore]:
        entered, resume = Future(), threading.Event()
        self.send(Pause(entered, resume))
        try:
            yield self.wait(entered)
        finally:
            resume.set()

    @contextlib.contextmanager
    def observing(self, observer: AttentionObserver) -> Iterator[None]:
        """``ModelRunner.observe_attention`` on the core's runner while the block runs."""
        with self.paused() as core:
            observing = core.runner.observe_attention(observer)
            observing.__enter__()
        try:
            yield
        finally:
            with self.paused():
                observing.__exit__(None, None, None)

    def close(self) -> None:
        """Close the engine: open requests fail with ``EngineClosedError``; waits for the thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._commands.put(Close())
        if not self.is_current:
            self._thread.join(timeout=60)


def run(core: EngineCore, commands: queue.SimpleQueue[Command]) -> None:
    """Serve ``commands`` until one closes the core; then refuse whatever is still queued. An idle core sleeps
    until a command comes or a retry of failed writes is due (``EngineCore.next_timer_s``)."""
    while not core.closed:
        core.retry_writes()
        idle = not core.scheduler.has_work(paced=False)
        command = _next(commands, wait=idle, timeout_s=core.next_timer_s() if idle else None)
        while command is not None and not core.closed:
            try:
                command.run(core)
            except Exception as exc:  # its exception is its answer
                command.refuse(exc)
            command = _next(commands) if not core.closed else None
        if not core.closed:
            core.step_once(paced=False)
    error = EngineClosedError("the engine was closed")
    while (command := _next(commands)) is not None:  # no client waits forever
        command.refuse(error)


def _next(commands: queue.SimpleQueue, *, wait: bool = False, timeout_s: float | None = None) -> Command | None:
    """The next command, waiting for it (``wait``) at most ``timeout_s`` (``None``: as long as it takes)."""
    try:
        return commands.get(block=wait, timeout=timeout_s)
    except queue.Empty:
        return None
