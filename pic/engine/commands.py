"""The commands other threads send the engine's core thread: a closed set of typed messages.

Every change to engine state arrives as one of these, in the order sent, and runs between two steps. A
command that answers carries a ``Future`` (``reply``) that the core thread completes, with the result or the
exception; outputs of requests go to their sinks instead (``pic.engine.streams``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from pic.engine.request import CompileJob, NewRequest, OutputSink
from pic.engine.sampling import SamplingParams


@dataclass(frozen=True)
class Submit:
    """New requests, queued together: they can share their first forward."""

    requests: tuple[NewRequest, ...]


@dataclass(frozen=True)
class Resume:
    """Start generating from a parked request (``Linked.generate``); ``link_s``: the link's wall time.
    Outputs go to ``sink`` (an error output if the request is no longer parked)."""

    request_id: int
    params: SamplingParams
    link_s: float
    sink: OutputSink


@dataclass(frozen=True)
class Abort:
    """Stop a request and free its blocks (release, abort, a closed stream); ``reply`` completes after."""

    request_id: int
    reply: Future | None = None


@dataclass(frozen=True)
class Compile:
    """Compile chunks as scheduled work; ``reply`` gets the ids compiled once all are stored."""

    job: CompileJob
    reply: Future


@dataclass(frozen=True)
class Step:
    """Run one step now if any work can run (``Stepper.step``: paced requests advance)."""

    reply: Future


@dataclass(frozen=True)
class Ask:
    """Run ``read(core)`` between two steps and answer its result: a read of engine state (pool statistics,
    the device tier of the store, logits)."""

    read: Callable[[object], object]
    reply: Future


@dataclass(frozen=True)
class Pause:
    """Stop between two steps: ``entered`` gets the core, which the caller may read until ``resume`` is set."""

    entered: Future
    resume: threading.Event


@dataclass(frozen=True)
class Wake:
    """Store I/O finished (sent by the loader): look at the work again."""


@dataclass(frozen=True)
class Close:
    """Fail every request still open, refuse later commands, and end the core thread."""


Command = Submit | Resume | Abort | Compile | Step | Ask | Pause | Wake | Close

_T = TypeVar("_T")


class Channel(Protocol):
    """The way into the engine's core thread (``CoreThread``), for the objects its callers hold (``Linked``,
    ``Stepper``, ``StoreView``): they depend on the commands, not on the thread that runs them."""

    def alive(self) -> bool:
        """Whether the core thread runs."""

    @property
    def is_current(self) -> bool:
        """Whether the calling thread is the core thread."""

    def send(self, command: Command) -> None:
        """Queue ``command`` (``EngineClosedError`` once the engine is closed)."""

    def call(self, make: Callable[[Future], Command]) -> object:
        """Send ``make(reply)`` and wait for its answer (re-raising its exception)."""

    def ask(self, read: Callable[[Any], _T]) -> _T:
        """``read(core)``, run on the core thread between two steps."""
