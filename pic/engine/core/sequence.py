"""A request's state inside the engine, from arrival to its last token: ``Sequence``, and its life as one state
machine: its statuses and the transitions between them, written once in ``TRANSITIONS``::

    WAITING --ADMIT--> PREFILLING --RUN--> RUNNING --PREEMPT--> WAITING
                           |                  ^
                          PARK              START
                           v                  |
                        PARKED --RESUME--> RESUMING --PREEMPT--> WAITING

    any status but FINISHED --FINISH--> FINISHED

A parked link whose generation starts is RESUMING until the scheduler gives it a place among the running (its
first token comes from the hidden state its pass left: no blocks, no forward); from then on it runs, and is
preempted, as any running sequence. A running sequence that finds no block for its next token may take a resuming
one's blocks too (its generation has started: the engine owns it; it waits for a fresh pass, as any preempted one).

Its status changes only through ``Queues.move`` (``pic.engine.core.queues``), which applies one transition of the
table to its status and its queue together. Its other parts each have one owner: ``fetch`` is ``ChunkSources``'s
(``Fetch``), ``blocks`` the ``KVManager``'s (``SeqBlocks``), ``decoding`` the ``Decoder``'s (``Decoding``), all
defined here, below their owners, which import this module (nothing imports back); ``link`` is the ``Linker``'s
(``LinkState``, defined in ``pic.link.linker`` and imported here).
"""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from pic.compile import ChunkPrefill
from pic.engine.core.detokenizer import Detokenizer
from pic.engine.generation import FinishReason
from pic.engine.request import NewRequest, OutputSink
from pic.engine.sampling import SamplingParams
from pic.errors import SequenceStateError
from pic.kv import ChunkInfo, ChunkKV, RequestKV
from pic.link.linker import LinkState
from pic.link.policies import Policy


class Status(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"  # queued for admission: new, or preempted (its blocks freed; planned again)
    PREFILLING = "prefilling"  # admitted: its recompute pass runs (in pieces; a probe, then its second pass)
    PARKED = "parked"  # linked (``PIC.link``): its pass ran; it holds its KV until ``Linked.generate`` or release
    RESUMING = "resuming"  # parked, its generation started: waits for a place among the running
    RUNNING = "running"  # decoding: one token per step
    FINISHED = "finished"  # done, failed or aborted: its blocks are freed


class Transition(enum.Enum):
    """What happens to a sequence (its name in messages)."""

    ADMIT = "admit"  # its blocks were taken; its pass runs from the next forward
    RUN = "run"  # its pass ended and it generates: it decodes from now on
    PARK = "park"  # its pass ended and it was only linked: it holds its KV
    RESUME = "resume"  # ``Linked.generate``: its generation starts
    START = "start"  # a resuming sequence got its place among the running (its first token is sampled now)
    PREEMPT = "preempt"  # its blocks were freed for others: a fresh pass over its prompt and output later
    FINISH = "finish"  # done, failed or aborted


_LIVE = frozenset(Status) - {Status.FINISHED}

# transition -> (the statuses it may start from, the status it ends in)
TRANSITIONS: dict[Transition, tuple[frozenset[Status], Status]] = {
    Transition.ADMIT: (frozenset({Status.WAITING}), Status.PREFILLING),
    Transition.RUN: (frozenset({Status.PREFILLING}), Status.RUNNING),
    Transition.PARK: (frozenset({Status.PREFILLING}), Status.PARKED),
    Transition.RESUME: (frozenset({Status.PARKED}), Status.RESUMING),
    Transition.START: (frozenset({Status.RESUMING}), Status.RUNNING),
    Transition.PREEMPT: (frozenset({Status.RUNNING, Status.RESUMING}), Status.WAITING),
    Transition.FINISH: (_LIVE, Status.FINISHED),
}


def after(request_id: int, status: Status, transition: Transition) -> Status:
    """The status ``transition`` leads to from ``status``.

    Raises:
        SequenceStateError: ``transition`` may not start from ``status`` (naming the request, both and what it
            may start from).
    """
    sources, target = TRANSITIONS[transition]
    if status not in sources:
        allowed = ", ".join(sorted(s.value for s in sources)) or "nothing"
        raise SequenceStateError(
            f"request {request_id} cannot {transition.value} while {status.value} (only from: {allowed})"
        )
    return target


def expect(seq: Sequence, *statuses: Status) -> None:
    """Raises: SequenceStateError: ``seq``'s status is none of ``statuses`` (a queue holds it where it cannot be)."""
    if seq.status not in statuses:
        wanted = " or ".join(s.value for s in statuses)
        raise SequenceStateError(f"request {seq.request_id} is {seq.status.value} where only {wanted} can be")


@dataclass
class Fetch:
    """Where a sequence's chunks are (written by ``ChunkSources`` only).

    Attributes:
        chunks: its chunks, in prompt order, once all are at hand: resident ``ChunkInfo`` or loaded ``ChunkKV``.
        pending: chunks being fetched: cache id -> the loader's future (a lower tier) or the compile (from its
            tokens).
        found: chunks loaded from a lower tier for it (promoted into the pool at admission).
        lost: chunks no tier holds: compiled again from their tokens.
    """

    chunks: list[ChunkInfo | ChunkKV] | None = None
    pending: dict[str, Future | ChunkPrefill] = field(default_factory=dict)
    found: dict[str, ChunkKV] = field(default_factory=dict)
    lost: set[str] = field(default_factory=set)


@dataclass
class SeqBlocks:
    """A sequence's blocks (written by ``KVManager`` only).

    Attributes:
        kv: its block table and references once admitted (``None``: waiting, or preempted).
        held: cache id -> the chunk blocks it keeps resident while it waits (preempted, or compiled for it).
        shared: table entries mapping a chunk's canonical block (no copy).
        reserved: blocks taken at admission for a probe's second pass (copies of the shared chunk blocks it may
            write); those it does not write go back to the pool once the policy has chosen.
        num_shared, num_private: of its first admission (its statistics), copies after a probe counted private.
        next_slot: the slot of the token its decode step runs.
    """

    kv: RequestKV | None = None
    held: dict[str, list[int]] = field(default_factory=dict)
    shared: set[int] = field(default_factory=set)
    reserved: list[int] = field(default_factory=list)
    num_shared: int = 0
    num_private: int = 0
    next_slot: int | None = None


@dataclass
class Decoding:
    """A sequence's generation state (made and changed by ``Decoder`` only).

    Attributes:
        detokenizer: its incremental detokenizer (and stop strings).
        generator: its own generator when its sampling is seeded, else ``None`` (the device's default).
    """

    detokenizer: Detokenizer
    generator: torch.Generator | None


@dataclass
class Timings:
    """When a sequence reached each point of its life (``time.perf_counter``; written by ``Sequence`` only).

    Attributes:
        arrival_s: queued; also its place in the arrival order of prefill work.
        scheduled_s: first admitted. linked_s: first recompute pass done. resumed_s: generation started (a
        parked sequence: ``Linked.generate``). first_token_s: its first token sampled. link_s: ``PIC.link``'s
        wall time, for a parked sequence.
    """

    arrival_s: float
    scheduled_s: float | None = None
    linked_s: float | None = None
    resumed_s: float | None = None
    first_token_s: float | None = None
    link_s: float | None = None

    def reach(self, status: Status, now: float) -> None:
        """The sequence reached ``status`` at ``now``: kept the first time only (``Queues.move``)."""
        name = _REACHED.get(status)
        if name is not None and getattr(self, name) is None:
            setattr(self, name, now)


# the time a status marks when a sequence first reaches it
_REACHED = {
    Status.PREFILLING: "scheduled_s",
    Status.PARKED: "linked_s",
    Status.RUNNING: "linked_s",
    Status.RESUMING: "resumed_s",
}


class Sequence:
    """One request: its prompt pieces, its KV once admitted, its tokens, timings, and how it ended.

    Only the engine's own thread creates, reads or changes a sequence: other threads see what it puts in ``sink``.
    ``request`` is the request as its client prepared it (``sampling=None``: park after the recompute pass).
    """

    def __init__(self, request: NewRequest) -> None:
        self.request, self.request_id = request, request.request_id
        self.sampling: SamplingParams | None = request.sampling  # (``Linked.generate`` sets it for a parked one)
        self.sink: OutputSink = request.sink
        self.status = Status.WAITING  # (changed by ``Queues.move`` only)
        self.times = Timings(arrival_s=time.perf_counter())
        self.fetch = Fetch()
        self.link = LinkState(request.policy, order=request.order)
        self.blocks = SeqBlocks()
        self.decoding: Decoding | None = None
        self.query_hidden: torch.Tensor | None = None  # [num_query, hidden] final hidden states (parked)
        self.output_ids: list[int] = []
        self.num_preemptions = 0
        self.finish_reason: FinishReason | None = None
        self.error: Exception | None = None

    # -- its generation ---------------------------------------------------------------------------------------

    def generate(self, params: SamplingParams, decoding: Decoding) -> None:
        """Generate with ``params`` (``decoding``: the ``Decoder``'s state for it)."""
        self.sampling, self.decoding = params, decoding

    def append(self, token: int) -> None:
        """A token was sampled."""
        self.times.first_token_s = self.times.first_token_s or time.perf_counter()
        self.output_ids.append(token)

    # -- reads ------------------------------------------------------------------------------------------

    @property
    def arrival(self) -> float:
        """Its place in the arrival order of prefill work."""
        return self.times.arrival_s

    @property
    def policy(self) -> Policy:
        """The policy it links with (the one chosen for its layout, once laid out)."""
        return self.link.policy

    @property
    def chunks(self) -> list[ChunkInfo | ChunkKV] | None:
        """Its chunks, resolved before its first admission (``ChunkSources.resolve``)."""
        return self.fetch.chunks

    @property
    def num_prompt_tokens(self) -> int:
        request = self.request
        return len(request.prefix_ids) + sum(c.num_tokens for c in self.chunks or ()) + len(request.query_ids)

    def decode_position(self) -> int:
        """The logical position of the token a decode step runs (the last one sampled): after the laid-out
        prompt (which holds the tokens generated before a preemption) and the tokens sampled since."""
        layout = self.link.layout
        num_laid_out = layout.num_tokens - self.num_prompt_tokens  # generated tokens in the layout
        return layout.end_position + len(self.output_ids) - num_laid_out - 1

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def __repr__(self) -> str:
        return f"Sequence({self.request_id}, {self.status.value}, {len(self.output_ids)} tokens)"
