"""A request's state inside the engine, from arrival to its last token: ``Sequence``.

Its status changes only through ``Queues.move`` (``pic.engine.core.queues``), which applies one transition of the
state machine (``pic.engine.core.status``) to its status and its queue together. Its other parts each have one
owner: ``fetch`` is ``ChunkSources``'s (``Fetch``), ``blocks`` the ``KVManager``'s (``SeqBlocks``), ``decoding``
the ``Decoder``'s (``Decoding``), all defined here, below their owners, which import this module (nothing imports
back); ``link`` is the ``Linker``'s (``LinkState``, defined in ``pic.link.linker`` and imported here).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from pic.compile import ChunkPrefill
from pic.engine.core.detokenizer import Detokenizer
from pic.engine.core.status import Status, Transition
from pic.engine.generation import FinishReason
from pic.engine.request import NewRequest, OutputSink
from pic.engine.sampling import SamplingParams
from pic.errors import SequenceStateError
from pic.kv import ChunkInfo, ChunkKV, RequestKV
from pic.link.linker import LinkState
from pic.link.policies import Policy


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
        self.status = Status.WAITING  # (changed by ``enter``, which ``Queues.move`` calls)
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

    # -- its life ---------------------------------------------------------------------------------------------

    def enter(self, status: Status, transition: Transition) -> None:
        """Take ``status`` by ``transition`` (``Queues.move`` only: it checked the transition against the state
        machine and moves the queues with it); the time it first reached that status is kept."""
        self.status = status
        self.times.reach(status, time.perf_counter())
        self.num_preemptions += transition is Transition.PREEMPT

    def expect(self, *statuses: Status) -> None:
        """Raises: SequenceStateError: its status is none of ``statuses`` (a queue holds it where it cannot be)."""
        if self.status not in statuses:
            wanted = " or ".join(s.value for s in statuses)
            raise SequenceStateError(f"request {self.request_id} is {self.status.value} where only {wanted} can be")

    def generate(
        self, params: SamplingParams, decoding: Decoding, *, sink: OutputSink | None = None, link_s: float | None = None
    ) -> None:
        """Generate with ``params`` (``decoding``: the ``Decoder``'s state for it); a parked one, resumed, puts its
        outputs in ``sink`` from now on (``link_s``: its ``PIC.link`` call's wall time)."""
        self.sampling, self.decoding, self.sink = params, decoding, sink or self.sink
        self.times.link_s = link_s

    def park(self, query_hidden: torch.Tensor) -> None:
        """Linked: keep the query's final hidden states ``[num_query, hidden_size]`` (``Linked.logits``)."""
        self.query_hidden = query_hidden

    def end(self, why: FinishReason | Exception) -> None:
        """It ended: ``why`` is the reason, or the error it failed with."""
        if isinstance(why, Exception):
            self.error = why
        else:
            self.finish_reason = why

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
