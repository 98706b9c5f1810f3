"""The core thread: the only thread that runs an ``EngineCore`` (vLLM's EngineCore busy loop, in-process).

It blocks on its command queue while no work can run (an idle engine costs no CPU; a request waiting on the
loader is woken by a ``Wake``), and otherwise alternates: run every command that arrived, then one step.
Outputs reach their clients through the requests' sinks; answers through the commands' futures. Nothing
else touches the core, its pool or its device tier, so nothing needs a lock.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import TypeVar

from pic.engine.commands import Abort, Ask, Close, Command, Compile, Pause, Resume, Step, Submit, Wake
from pic.engine.core import EngineCore
from pic.engine.request import RequestOutput
from pic.engine.streams import wait
from pic.errors import EngineClosedError, LinkedReleasedError
from pic.model.runner import AttentionObserver

log = logging.getLogger("pic")
_T = TypeVar("_T")


class CoreThread:
    """The thread that owns a core, and the one way in: ``send`` a command, ``call`` one and wait for its
    answer. Holds no reference to the ``Engine`` it serves, so dropping the engine can close it."""

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
        """Whether the calling thread is this one (a finalizer running inside a step, say)."""
        return threading.current_thread() is self._thread

    def send(self, command: Command) -> None:
        """Queue ``command``.

        Raises:
            EngineClosedError: the engine was closed.
        """
        if self._closed:
            raise EngineClosedError("the engine was closed; build a new one")
        self._commands.put(command)

    def call(self, make: Callable[[Future], Command]) -> object:
        """Send the command ``make(reply)`` and wait for its answer (re-raising its exception)."""
        reply: Future = Future()
        self.send(make(reply))
        return self.wait(reply)

    def ask(self, read: Callable[[EngineCore], _T]) -> _T:
        """``read(core)``, run between two steps."""
        return self.call(lambda reply: Ask(read, reply))

    def wait(self, future: Future[_T]) -> _T:
        return wait(future, self.alive)

    @contextlib.contextmanager
    def paused(self) -> Iterator[EngineCore]:
        """Stop the core between two steps and lend it to the caller until the block exits."""
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
    """Serve ``commands`` until ``Close``; then fail whatever is still open or still arrives. An idle core sleeps
    until a command comes or a retry of failed writes is due (``EngineCore.next_timer_s``)."""
    while True:
        core.retry_writes()
        command = _wait(commands, core.next_timer_s()) if not core.has_work(paced=False) else _next(commands)
        while command is not None:
            if isinstance(command, Close):
                _close(core, commands)
                return
            _handle(core, command)
            command = _next(commands)
        if core.has_work(paced=False):
            _step(core)


def _wait(commands: queue.SimpleQueue[Command], timeout_s: float | None) -> Command | None:
    """The next command, waiting for it at most ``timeout_s`` (``None``: as long as it takes)."""
    try:
        return commands.get(timeout=timeout_s)
    except queue.Empty:
        return None


def _next(commands: queue.SimpleQueue[Command]) -> Command | None:
    try:
        return commands.get_nowait()
    except queue.Empty:
        return None


def _step(core: EngineCore) -> None:
    try:
        core.step()
    except Exception as exc:  # a forward's failure fails its batch inside step: anything else is a bug
        log.exception("pic: an engine step failed; failing the open requests")
        core.fail_all(exc)


def _handle(core: EngineCore, command: Command) -> None:
    """Run one command; its exception goes to its reply (or, without one, to the log)."""
    reply = getattr(command, "reply", None)
    if isinstance(command, Compile):  # answered by the core once its chunks are stored
        try:
            core.compile(command.job, reply)
        except Exception as exc:
            reply.set_exception(exc)
        return
    try:
        result = _run(core, command)
    except Exception as exc:
        if reply is None:
            log.exception("pic: engine command %s failed", type(command).__name__)
        else:
            reply.set_exception(exc)
        return
    if reply is not None:
        reply.set_result(result)


def _run(core: EngineCore, command: Command) -> object:
    if isinstance(command, Submit):
        for new in command.requests:
            core.add(new)
    elif isinstance(command, Resume):
        if not core.resume(command.request_id, command.params, link_s=command.link_s, sink=command.sink):
            error = LinkedReleasedError("this Linked request was already released; link it again")
            command.sink.put(RequestOutput.failure(command.request_id, error))
    elif isinstance(command, Abort):
        core.abort(command.request_id)
    elif isinstance(command, Step):
        if core.has_work():
            _step(core)
    elif isinstance(command, Ask):
        return command.read(core)
    elif isinstance(command, Pause):
        command.entered.set_result(core)
        command.resume.wait()
    elif not isinstance(command, Wake):
        raise AssertionError(f"unknown engine command {command!r}")
    return None


def _close(core: EngineCore, commands: queue.SimpleQueue[Command]) -> None:
    """Fail the open requests and every command still queued, so no client waits forever."""
    error = EngineClosedError("the engine was closed")
    core.fail_all(error)
    while (command := _next(commands)) is not None:
        _refuse(command, error)


def _refuse(command: Command, error: Exception) -> None:
    if isinstance(command, Submit):
        for new in command.requests:
            new.sink.put(RequestOutput.failure(new.request_id, error))
    elif isinstance(command, Resume):
        command.sink.put(RequestOutput.failure(command.request_id, error))
    elif isinstance(command, Pause):
        command.entered.set_exception(error)
    elif getattr(command, "reply", None) is not None:
        command.reply.set_exception(error)
