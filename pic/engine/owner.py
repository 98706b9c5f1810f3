"""The owner thread: the only thread that runs an ``EngineCore`` (vLLM's EngineCore busy loop, in-process).

It blocks on its command queue while no request waits or runs (an idle engine costs no CPU), and otherwise
alternates: run every command that arrived, then one step. Outputs reach their clients through the
requests' sinks; answers through the commands' futures. Nothing else touches the core, its pool or its
store, so nothing needs a lock.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from pic.engine.commands import Abort, Ask, Close, Command, Compile, Pause, Query, Resume, Step, Submit
from pic.engine.core import EngineCore
from pic.engine.request import RequestOutput
from pic.engine.streams import wait
from pic.errors import EngineClosedError, LinkedReleasedError
from pic.store import TieredStore

log = logging.getLogger("pic")
_T = TypeVar("_T")


class OwnerThread:
    """The thread that owns a core, and the one way in: ``send`` a command, ``call`` one and wait for its
    answer. Holds no reference to the ``Engine`` it serves, so dropping the engine can close it."""

    def __init__(self, core: EngineCore) -> None:
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._thread = threading.Thread(target=run, args=(core, self._commands), name="pic-engine", daemon=True)
        self._closed = False
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def is_owner(self) -> bool:
        """Whether the calling thread is the owner (a finalizer running inside a step, say)."""
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

    def ask(self, query: Query, arg: object = None) -> object:
        return self.call(lambda reply: Ask(query, arg, reply))

    def wait(self, future: Future[_T]) -> _T:
        return wait(future, self.alive)

    def close(self) -> None:
        """Close the engine: open requests fail with ``EngineClosedError``; waits for the thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._commands.put(Close())
        if not self.is_owner:
            self._thread.join(timeout=60)


def run(core: EngineCore, commands: queue.SimpleQueue[Command]) -> None:
    """Serve ``commands`` until ``Close``; then fail whatever is still open or still arrives."""
    while True:
        command = commands.get() if not core.has_unfinished(paced=False) else _next(commands)
        while command is not None:
            if isinstance(command, Close):
                _close(core, commands)
                return
            _handle(core, command)
            command = _next(commands)
        if core.has_unfinished(paced=False):
            _step(core)


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
    elif isinstance(command, Compile):
        return core.compile(command.job)
    elif isinstance(command, Step):
        if core.has_unfinished():
            _step(core)
    elif isinstance(command, Ask):
        return _answer(core, command.query, command.arg)
    elif isinstance(command, Pause):
        command.entered.set_result(core)
        command.resume.wait()
    else:
        raise AssertionError(f"unknown engine command {command!r}")
    return None


# The store operations a client may ask for, each a ``TieredStore`` method of one cache id.
_STORE_CALLS = {
    Query.LOOKUP: TieredStore.lookup,
    Query.DESCRIBE: TieredStore.describe,
    Query.CONTAINS: TieredStore.contains,
    Query.GET: TieredStore.get,
    Query.PIN: TieredStore.pin,
    Query.UNPIN: TieredStore.unpin,
    Query.EXPIRE: TieredStore.expire,
}


def _answer(core: EngineCore, query: Query, arg: object) -> object:
    match query:
        case Query.KV_STATS:
            return core.pool.stats()
        case Query.RESET_PEAK:
            return core.pool.reset_peak()
        case Query.COUNTERS:
            return core.num_steps, core.num_batched_seqs
        case Query.LOGITS:
            return core.logits(arg)
        case Query.STORE_STATS:
            return core.store.stats()
        case Query.STORE_IDS:
            return core.store.ids()
    return _STORE_CALLS[query](core.store, arg)


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
