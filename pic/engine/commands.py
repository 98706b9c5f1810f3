"""The commands other threads send the engine's owner thread: a closed set of typed messages.

Every change to engine state arrives as one of these, in the order sent, and runs between two steps. A
command that answers carries a ``Future`` (``reply``) that the owner completes, with the result or the
exception; outputs of requests go to their sinks instead (``pic.engine.streams``).
"""

from __future__ import annotations

import enum
import threading
from concurrent.futures import Future
from dataclasses import dataclass

from pic.engine.core import CompileJob
from pic.engine.request import NewRequest
from pic.engine.sampling import SamplingParams
from pic.engine.sequence import OutputSink


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
    """Compile chunks between two steps; ``reply`` gets the ids compiled."""

    job: CompileJob
    reply: Future


@dataclass(frozen=True)
class Step:
    """Run one step now if any request waits or runs (``Engine.step``: paced requests advance)."""

    reply: Future


class Query(enum.Enum):
    """What ``Ask`` asks: a read, or a store operation, answered between two steps."""

    KV_STATS = "kv_stats"
    RESET_PEAK = "reset_peak"
    COUNTERS = "counters"
    LOGITS = "logits"
    STORE_STATS = "store_stats"
    STORE_IDS = "store_ids"
    LOOKUP = "lookup"
    DESCRIBE = "describe"
    CONTAINS = "contains"
    GET = "get"
    PIN = "pin"
    UNPIN = "unpin"
    EXPIRE = "expire"


@dataclass(frozen=True)
class Ask:
    """A ``Query`` with its argument (a cache id, hidden states for ``LOGITS``, or ``None``)."""

    query: Query
    arg: object
    reply: Future


@dataclass(frozen=True)
class Pause:
    """Stop between two steps: ``entered`` gets the core, which the caller may read until ``resume`` is set."""

    entered: Future
    resume: threading.Event


@dataclass(frozen=True)
class Close:
    """Fail every request still open, refuse later commands, and end the owner thread."""


Command = Submit | Resume | Abort | Compile | Step | Ask | Pause | Close
