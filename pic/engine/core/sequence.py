"""A request's state inside the engine: ``Sequence``, and its life as one state machine, written once: its statuses
and the transitions between them (``TRANSITIONS``), which ``Queues.move`` applies to its status and its queue
together::

    WAITING --ADMIT--> PREFILLING --RUN--> RUNNING --PREEMPT--> WAITING
                           |                  ^
                          PARK              START
                           v                  |
                        PARKED --RESUME--> RESUMING --PREEMPT--> WAITING

    any status but FINISHED --FINISH--> FINISHED

A parked link whose generation starts is RESUMING until the scheduler gives it a place among the running (its
first token comes from the hidden state its pass left: no blocks, no forward); from then on it runs, and is
preempted, as any running sequence (a resuming one may be preempted too: its generation has started).

A sequence's other parts each have one owner, which imports this module (nothing imports back): ``fetch`` is
``ChunkSources``'s, ``blocks`` the ``KVManager``'s, ``decoding`` the ``Decoder``'s, ``link`` the ``Linker``'s.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from pic.compile import ChunkPrefill
from pic.engine.core.detokenizer import Detokenizer
from pic.engine.generation import FinishReason
from pic.engine.request import NewRequest, OutputSink
from pic.errors import SequenceStateError
from pic.kv import ChunkInfo, ChunkKV, RequestKV
from pic.link.linker import LinkState
from pic.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # queued for admission: new, or preempted (its blocks freed; planned again)
    PREFILLING = "prefilling"  # admitted: its recompute pass runs (in pieces; a probe, then its second pass)
    PARKED = "parked"  # linked (``PIC.link``): its pass ran; it holds its KV until ``Linked.generate`` or release
    RESUMING = "resuming"  # parked, its generation started: waits for a place among the running
    RUNNING = "running"  # decoding: one token per step
    FINISHED = "finished"  # done, failed or aborted: its blocks are freed


class Transition(enum.Enum):
    ADMIT = "admit"  # its blocks were taken; its pass runs from the next forward
    RUN = "run"  # its pass ended and it generates: it decodes from now on
    PARK = "park"  # its pass ended and it was only linked: it holds its KV
    RESUME = "resume"  # ``Linked.generate``: its generation starts
    START = "start"  # a resuming sequence got its place among the running (its first token is sampled now)
    PREEMPT = "preempt"  # its blocks were freed for others: a fresh pass over its prompt and output later
    FINISH = "finish"  # done, failed or aborted


# transition -> (the statuses it may start from, the status it ends in)
TRANSITIONS: dict[Transition, tuple[frozenset[Status], Status]] = {
    Transition.ADMIT: (frozenset({Status.WAITING}), Status.PREFILLING),
    Transition.RUN: (frozenset({Status.PREFILLING}), Status.RUNNING),
    Transition.PARK: (frozenset({Status.PREFILLING}), Status.PARKED),
    Transition.RESUME: (frozenset({Status.PARKED}), Status.RESUMING),
    Transition.START: (frozenset({Status.RESUMING}), Status.RUNNING),
    Transition.PREEMPT: (frozenset({Status.RUNNING, Status.RESUMING}), Status.WAITING),
    Transition.FINISH: (frozenset(Status) - {Status.FINISHED}, Status.FINISHED),
}
# the time a status marks when a sequence first reaches it (``Timings``)
_REACHED = {
    Status.PREFILLING: "scheduled_s",
    Status.PARKED: "linked_s",
    Status.RUNNING: "linked_s",
    Status.RESUMING: "resumed_s",
}


@dataclass
class Fetch:
    """Where a sequence's chunks are (``ChunkSources``'s): ``chunks``, in prompt order, once all are at hand
    (resident ``ChunkInfo`` or loaded ``ChunkKV``); ``pending``: cache id -> the loader's future or the compile;
    ``found``: loaded for it (promoted at admission); ``lost``: no tier holds them (compiled again)."""

    chunks: list[ChunkInfo | ChunkKV] | None = None
    pending: dict[str, Future | ChunkPrefill] = field(default_factory=dict)
    found: dict[str, ChunkKV] = field(default_factory=dict)
    lost: set[str] = field(default_factory=set)


@dataclass
class SeqBlocks:
    """A sequence's blocks (the ``KVManager``'s). ``reserved``: taken at admission for a probe's second pass (copies
    of the shared chunk blocks it may write); those it does not write go back once the policy has chosen."""

    kv: RequestKV | None = None  # its block table and references once admitted (``None``: waiting, or preempted)
    held: dict[str, np.ndarray] = field(default_factory=dict)  # cache id -> chunk blocks kept resident while it waits
    shared: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))  # table entries (increasing)
    # mapping a chunk's canonical block (no copy)
    reserved: list[int] = field(default_factory=list)
    num_shared: int = 0  # of its first admission (its statistics); copies after a probe count private
    num_private: int = 0
    next_slot: int | None = None  # the slot of the token its decode step runs


@dataclass
class Decoding:
    """A sequence's generation state (the ``Decoder``'s): its generator is its own when its sampling is seeded."""

    detokenizer: Detokenizer
    generator: torch.Generator | None


@dataclass
class Timings:
    """When a sequence reached each point of its life (``time.perf_counter``): queued (also its place in the
    arrival order of prefill work), first admitted, first pass done, generation started (a parked one), first
    token; ``link_s``: ``PIC.link``'s wall time, for a parked sequence."""

    arrival_s: float
    scheduled_s: float | None = None
    linked_s: float | None = None
    resumed_s: float | None = None
    first_token_s: float | None = None
    link_s: float | None = None


class Sequence:
    """One request (``request``, as its client prepared it; ``sampling=None``: park after the pass): its chunks,
    its KV once admitted, its tokens, timings, and how it ended."""

    def __init__(self, request: NewRequest) -> None:
        self.request, self.request_id = request, request.request_id
        self.sampling: SamplingParams | None = request.sampling  # (``Linked.generate`` sets it for a parked one)
        self.sink: OutputSink = request.sink
        self.status = Status.WAITING
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

    def enter(self, status: Status, transition: Transition) -> None:
        """Take ``status`` by ``transition`` (``Queues.move`` only, which checked it); the time it first reached
        that status is kept."""
        self.status = status
        name = _REACHED.get(status)
        if name is not None and getattr(self.times, name) is None:
            setattr(self.times, name, time.perf_counter())
        self.num_preemptions += transition is Transition.PREEMPT

    def generate(
        self, params: SamplingParams, decoding: Decoding, *, sink: OutputSink | None = None, link_s: float | None = None
    ) -> None:
        """Generate with ``params``; a parked one, resumed, puts its outputs in ``sink`` from now on."""
        self.sampling, self.decoding, self.sink = params, decoding, sink or self.sink
        self.times.link_s = link_s

    def park(self, query_hidden: torch.Tensor) -> None:
        """Linked: keep the query's final hidden states ``[num_query, hidden_size]`` (``Linked.logits``)."""
        self.query_hidden = query_hidden

    def end(self, why: FinishReason | Exception) -> None:
        if isinstance(why, Exception):
            self.error = why
        else:
            self.finish_reason = why

    def append(self, token: int) -> None:
        self.times.first_token_s = self.times.first_token_s or time.perf_counter()
        self.output_ids.append(token)

    @property
    def num_prompt_tokens(self) -> int:
        request = self.request
        return len(request.prefix_ids) + sum(c.num_tokens for c in self.fetch.chunks or ()) + len(request.query_ids)

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


class Queues:
    """The scheduler's sequences by status: a sequence is in the queue of its status, and only there."""

    def __init__(self) -> None:
        self.requests: dict[int, Sequence] = {}  # every one not finished (parked ones included)
        self.to_admit: deque[Sequence] = deque()  # WAITING and RESUMING, in arrival order (a preempted one first)
        self.prefilling: list[Sequence] = []  # in admission order
        self.running: list[Sequence] = []  # in admission order (the last one is preempted first)

    def add(self, seq: Sequence) -> None:
        self.requests[seq.request_id] = seq
        self.to_admit.append(seq)

    def move(self, seq: Sequence, transition: Transition) -> None:
        """Apply ``transition``: checked against ``TRANSITIONS`` before anything changes (``SequenceStateError``),
        then out of its queue, its new status, into that status's queue."""
        sources, target = TRANSITIONS[transition]
        if seq.status not in sources:
            allowed = ", ".join(sorted(s.value for s in sources))
            raise SequenceStateError(
                f"request {seq.request_id} cannot {transition.value} while {seq.status.value} (only from: {allowed})"
            )
        for queue in (self.running, self.prefilling, self.to_admit):  # (where it is, even where it should not be)
            if seq in queue:
                queue.remove(seq)
        seq.enter(target, transition)
        if transition is Transition.PREEMPT:
            self.to_admit.appendleft(seq)
        elif target is Status.RESUMING:
            self.to_admit.append(seq)
        elif target is Status.PREFILLING:
            self.prefilling.append(seq)
        elif target is Status.RUNNING:
            self.running.append(seq)
        elif target is Status.FINISHED:
            self.requests.pop(seq.request_id, None)

    def of(self, status: Status) -> list[Sequence]:
        """The waiting queue's sequences of ``status`` (WAITING or RESUMING), in its order."""
        return [s for s in self.to_admit if s.status is status]

    @property
    def num_active(self) -> int:
        """Sequences running or prefilling (what ``max_num_seqs`` caps)."""
        return len(self.running) + len(self.prefilling)
