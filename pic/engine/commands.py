"""The command channel: the one way from the engine's callers (``pic.engine.caller``) to its core
(``pic.engine.core``), which import this module and the messages it carries (``pic.engine.request``), never
each other.

Every change to engine state arrives as one of these commands, in the order sent, and runs between two steps on
the core thread: ``command.run(core)``, each command doing its own part (the core thread does not look at its
type). A command that answers carries a ``Future`` (``reply``) that it completes, with the result or (``refuse``)
the exception; outputs of requests go to their sinks instead (``RequestStream``). ``Core`` is what the commands ask
of the core, all of it: a caller reads the core through typed queries (``ReadKV``, ``ReadSteps``, ``Logits``,
``OnDevice``), never by running code of its own there; ``PIC.paused`` (tests, debugging) is the one way to look
inside. ``Channel`` is what a caller holds of the thread that runs it.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar

from pic.engine.request import CompileJob, LinkOutput, NewRequest, OutputSink, RequestOutput
from pic.errors import EngineClosedError, LinkedReleasedError
from pic.sampling import SamplingParams

log = logging.getLogger("pic")
_T = TypeVar("_T")
# A waiting thread wakes this often to check that the engine's thread is alive (a closed engine answers
# everything it was asked before its thread ends; this only matters if that thread died of a bug).
LIVENESS_S = 1.0


class Core(Protocol):
    """What the commands ask of the engine's core (``pic.engine.core.EngineCore``), on its own thread."""

    closed: bool

    def add(self, new: NewRequest) -> None:
        """Queue a new request."""

    def resume(self, request_id: int, params: SamplingParams, *, link_s: float, sink: OutputSink) -> bool:
        """Start generating from a parked request; whether it was parked."""

    def abort(self, request_id: int) -> None:
        """Stop a request and free its blocks (unknown or finished ids are ignored)."""

    def compile(self, job: CompileJob, reply: Future) -> None:
        """Start compiling ``job``'s chunks; ``reply`` is answered once they are stored."""

    def step_once(self, *, include_paced: bool = True) -> None:
        """Run one step if any work can run (``include_paced=False``: not for requests that wait for ``Step``)."""

    def close(self, error: Exception) -> None:
        """Fail every open request with ``error``; ``closed`` from now on."""

    def kv_stats(self) -> Any:
        """The KV pool's ``KVStats``."""

    def reset_peak(self) -> None:
        """Restart the pool's peak from the blocks in use now."""

    def step_counts(self) -> StepCounts:
        """The forwards run so far and the sequences they carried."""

    def logits(self, hidden: Any) -> Any:
        """``[N, vocab_size]`` float32 logits of final hidden states ``[N, hidden_size]``."""

    def on_device(self, op: DeviceOp, cache_id: str, readable: Mapping[str, bytes] | None) -> object:
        """``op`` of the store's device tier."""

    def observe_attention(self, observer: Any) -> None:
        """Every layer of every forward calls ``observer`` from now on (``None``: none)."""


@dataclass(frozen=True)
class StepCounts:
    """The engine's forwards so far (``num_steps``) and the sequences they carried (``num_batched_seqs``)."""

    num_steps: int
    num_batched_seqs: int


class DeviceOp(enum.Enum):
    """A call of the store's device tier (``pic.store.device.DeviceTier``) that another thread makes (``OnDevice``):
    its methods of these names; ``FORGET`` drops the chunk from the pool and the engine's memory of its tokens."""

    CONTAINS = enum.auto()
    EXTENT = enum.auto()
    PEEK = enum.auto()
    PIN = enum.auto()
    UNPIN = enum.auto()
    IDS = enum.auto()
    STATS = enum.auto()
    FORGET = enum.auto()


class Command:
    """A message to the core thread: ``run`` does its work there; ``refuse`` answers it with an error instead (its
    work raised, or the engine closed before it ran)."""

    reply: ClassVar[Future | None] = None  # (a dataclass field in the commands that answer)

    def run(self, core: Core) -> None:
        raise NotImplementedError

    def refuse(self, error: Exception) -> None:
        if self.reply is None:
            log.error("pic: engine command %s failed: %s", type(self).__name__, error)
        elif not self.reply.done():
            self.reply.set_exception(error)


@dataclass(frozen=True)
class Submit(Command):
    """New requests, queued together: they can share their first forward."""

    requests: tuple[NewRequest, ...]

    def run(self, core: Core) -> None:
        for new in self.requests:
            core.add(new)

    def refuse(self, error: Exception) -> None:
        for new in self.requests:
            new.sink.put(RequestOutput.failure(new.request_id, error))


@dataclass(frozen=True)
class Resume(Command):
    """Start generating from a parked request (``Linked.generate``); ``link_s``: the link's wall time.
    Outputs go to ``sink`` (an error output if the request is no longer parked)."""

    request_id: int
    params: SamplingParams
    link_s: float
    sink: OutputSink

    def run(self, core: Core) -> None:
        if not core.resume(self.request_id, self.params, link_s=self.link_s, sink=self.sink):
            self.refuse(LinkedReleasedError("this Linked request was already released; link it again"))

    def refuse(self, error: Exception) -> None:
        self.sink.put(RequestOutput.failure(self.request_id, error))


@dataclass(frozen=True)
class Abort(Command):
    """Stop a request and free its blocks (release, abort, a closed stream); ``reply`` completes after."""

    request_id: int
    reply: Future | None = None

    def run(self, core: Core) -> None:
        core.abort(self.request_id)
        if self.reply is not None:
            self.reply.set_result(None)


@dataclass(frozen=True)
class Compile(Command):
    """Compile chunks as scheduled work; ``reply`` gets the ids compiled once all are stored (``Stored``)."""

    job: CompileJob
    reply: Future

    def run(self, core: Core) -> None:
        core.compile(self.job, self.reply)  # answered by the core once its chunks are stored


@dataclass(frozen=True)
class Step(Command):
    """Run one step now if any work can run (``Stepper.step``: paced requests advance)."""

    reply: Future

    def run(self, core: Core) -> None:
        core.step_once()
        self.reply.set_result(None)


@dataclass(frozen=True)
class ReadKV(Command):
    """The KV pool's statistics (``PIC.kv_stats``); ``reset``: restart its peak first (``PIC.reset_peak``)."""

    reply: Future
    reset: bool = False

    def run(self, core: Core) -> None:
        if self.reset:
            core.reset_peak()
        self.reply.set_result(core.kv_stats())


@dataclass(frozen=True)
class ReadSteps(Command):
    """The engine's ``StepCounts`` (``Stepper.num_steps``, ``/metrics``)."""

    reply: Future

    def run(self, core: Core) -> None:
        self.reply.set_result(core.step_counts())


@dataclass(frozen=True)
class Logits(Command):
    """A parked link's next-token logits from its query's final hidden states (``Linked.logits``)."""

    hidden: Any  # [num_query_tokens, hidden_size]
    reply: Future

    def run(self, core: Core) -> None:
        self.reply.set_result(core.logits(self.hidden))


@dataclass(frozen=True)
class OnDevice(Command):
    """One call of the store's device tier for another thread (``StoreView``): ``op`` of ``cache_id`` (no id for
    ``IDS`` and ``STATS``), reading the namespaces ``readable`` names (``EXTENT``, ``PEEK``)."""

    op: DeviceOp
    reply: Future
    cache_id: str = ""
    readable: Mapping[str, bytes] | None = None

    def run(self, core: Core) -> None:
        self.reply.set_result(core.on_device(self.op, self.cache_id, self.readable))


@dataclass(frozen=True)
class ObserveAttention(Command):
    """Install an attention observer on the core's runner (``None``: remove it; ``PIC.observe_attention``)."""

    observer: Any
    reply: Future

    def run(self, core: Core) -> None:
        core.observe_attention(self.observer)
        self.reply.set_result(None)


@dataclass(frozen=True)
class Pause(Command):
    """Stop between two steps: ``entered`` gets the core, which the caller may read until ``resume`` is set."""

    entered: Future
    resume: threading.Event

    def run(self, core: Core) -> None:
        self.entered.set_result(core)
        self.resume.wait()

    def refuse(self, error: Exception) -> None:
        self.entered.set_exception(error)


@dataclass(frozen=True)
class OnCoreThread(Command):
    """Run ``fn()`` on the core thread between two steps and answer its result: for profilers, which record the thread
    that starts them (``benchmarks/decode_profile.py``). ``fn`` gets nothing of the core."""

    fn: Callable[[], object]
    reply: Future

    def run(self, core: Core) -> None:
        self.reply.set_result(self.fn())


@dataclass(frozen=True)
class Wake(Command):
    """Store I/O finished (sent by the loader): look at the work again."""

    def run(self, core: Core) -> None:
        pass


@dataclass(frozen=True)
class Close(Command):
    """Fail every request still open, refuse later commands, and end the core thread."""

    def run(self, core: Core) -> None:
        core.close(EngineClosedError("the engine was closed"))


class Channel(Protocol):
    """The way into the engine's core thread (``CoreThread``), for the objects its callers hold (``PIC``,
    ``Linked``, ``Stepper``, ``StoreView``): they depend on the commands, not on the thread that runs them."""

    def alive(self) -> bool:
        """Whether the core thread runs."""

    @property
    def is_current(self) -> bool:
        """Whether the calling thread is the core thread."""

    def send(self, command: Command) -> None:
        """Queue ``command`` (``EngineClosedError`` once the engine is closed)."""

    def call(self, make: Callable[[Future], Command]) -> object:
        """Send ``make(reply)`` and wait for its answer (re-raising its exception)."""

    def paused(self) -> Any:
        """A context manager: the core stopped between two steps, lent to the caller."""

    def observing(self, observer: Any) -> Any:
        """A context manager: within it, every layer of every forward calls ``observer`` (``PIC.observe_attention``)."""

    def close(self) -> None:
        """Close the engine (idempotent)."""


class RequestStream:
    """One request's outputs, for a thread that waits on them (``link``, ``generate``, ``stream``): an ``OutputSink``.

    ``last_only`` keeps only what ends a wait (a ``LinkOutput``, a finished output): a caller that wants
    the generation, not its pieces, is then woken once, not once per token.
    """

    def __init__(self, alive: Callable[[], bool], *, last_only: bool = False) -> None:
        self._queue: queue.SimpleQueue[RequestOutput | LinkOutput] = queue.SimpleQueue()
        self._alive, self._last_only = alive, last_only

    def put(self, item: RequestOutput | LinkOutput) -> None:
        if not self._last_only or ends_wait(item):
            self._queue.put(item)

    def get(self) -> RequestOutput | LinkOutput:
        """The next output, waiting for it (``EngineClosedError``: the engine's thread ended without sending it)."""
        while True:
            try:
                return self._queue.get(timeout=LIVENESS_S)
            except queue.Empty:
                if not self._alive():
                    raise EngineClosedError("the engine's thread ended before the request did") from None


def ends_wait(item: RequestOutput | LinkOutput) -> bool:
    """Whether ``item`` ends a wait for a request's result (a ``LinkOutput``, or a finished output): what a stream
    that keeps the last only (``last_only``) keeps."""
    return not isinstance(item, RequestOutput) or item.finished


def wait(future: Future[_T], alive: Callable[[], bool]) -> _T:
    """``future.result()``, or ``EngineClosedError`` once the engine's thread is gone."""
    while True:
        try:
            return future.result(timeout=LIVENESS_S)
        except TimeoutError:
            if not alive():
                raise EngineClosedError("the engine's thread ended before answering") from None
