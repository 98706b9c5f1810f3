"""A request's state inside the engine, from arrival to its last token: ``Sequence``.

Its status changes only through its transitions (``admit``, ``run``, ``park``, ``resume``, ``start``, ``preempt``,
``finish``), each checked against the state machine (``pic.engine.core.status``) before anything changes: one not
allowed raises ``SequenceStateError`` for this request alone. The scheduler's queues call them, and nothing else.
Its other parts each have one owner: ``fetch`` is ``ChunkSources``'s (``Fetch``), ``link`` the ``Linker``'s
(``LinkState``), ``blocks`` the ``KVManager``'s (``SeqBlocks``), ``decoding`` the ``Decoder``'s (``Decoding``); they
are defined here, below their owners, which import this module (nothing imports back).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from pic.compile import ChunkPrefill
from pic.engine.core.detokenizer import Detokenizer
from pic.engine.core.status import Status, Transition, after
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


class Sequence:
    """One request: its prompt pieces, its KV once admitted, its tokens, timings, and how it ended.

    Only the engine's own thread creates, reads or changes a sequence: other threads see what it puts in ``sink``.
    ``new`` is the request as its client sent it (``sampling=None``: park after the recompute pass).
    """

    def __init__(self, new: NewRequest) -> None:
        self.request_id = new.request_id
        prompt = new.prompt
        self.cache_ids, self.prefix_ids, self.query_ids = prompt.cache_ids, prompt.prefix_ids, prompt.query_ids
        self.relevance = prompt.relevance
        self.compile_options = new.compile_options
        self.sampling: SamplingParams | None = new.sampling
        self.sink: OutputSink = new.sink
        self.paced = new.paced
        self._status = Status.WAITING
        self.times = Timings(arrival_s=time.perf_counter())
        self.fetch = Fetch()
        self.link = LinkState(new.policy, order=prompt.order)
        self.blocks = SeqBlocks()
        self.decoding: Decoding | None = None
        self.query_hidden: torch.Tensor | None = None  # [num_query, hidden] final hidden states (parked)
        self.output_ids: list[int] = []
        self.num_preemptions = 0
        self.finish_reason: FinishReason | None = None
        self.error: Exception | None = None

    # -- the state machine ----------------------------------------------------------------------------------

    @property
    def status(self) -> Status:
        return self._status

    def _move(self, transition: Transition) -> None:
        """The one place a status changes: after checking that ``transition`` may start from it.

        Raises:
            SequenceStateError: it may not (the status stays).
        """
        self._status = after(self.request_id, self._status, transition)

    def expect(self, *statuses: Status) -> None:
        """Raises: SequenceStateError: its status is none of ``statuses`` (a queue holds it where it cannot be)."""
        if self._status not in statuses:
            wanted = " or ".join(s.value for s in statuses)
            raise SequenceStateError(f"request {self.request_id} is {self._status.value} where only {wanted} can be")

    def admit(self) -> None:
        """Its blocks were taken: its pass runs from now on."""
        self._move(Transition.ADMIT)
        self.times.scheduled_s = self.times.scheduled_s or time.perf_counter()

    def run(self) -> None:
        """Its recompute pass ran: it decodes from now on."""
        self._move(Transition.RUN)
        self.times.linked_s = self.times.linked_s or time.perf_counter()

    def park(self, query_hidden: torch.Tensor) -> None:
        """Linked (``PIC.link``): hold the KV and the query's final hidden states ``[num_query, hidden_size]``
        until ``Linked.generate`` resumes it."""
        self._move(Transition.PARK)
        self.query_hidden = query_hidden
        self.times.linked_s = self.times.linked_s or time.perf_counter()

    def resume(self, params: SamplingParams, decoding: Decoding, *, sink: OutputSink, link_s: float) -> None:
        """``Linked.generate``: generate with ``params``, its outputs to ``sink`` from now on (``link_s``: the
        ``PIC.link`` call's wall time)."""
        self._move(Transition.RESUME)
        self.generate(params, decoding)
        self.sink, self.times.link_s, self.times.resumed_s = sink, link_s, time.perf_counter()

    def start(self) -> None:
        """A resuming sequence runs: its first token is sampled from the hidden state its pass left."""
        self._move(Transition.START)

    def preempt(self) -> None:
        """Its blocks were freed for others: back to waiting, for a fresh pass over its prompt and output."""
        self._move(Transition.PREEMPT)
        self.num_preemptions += 1

    def finish(self, why: FinishReason | Exception) -> None:
        """Done: ``why`` is the reason it ended, or the error it failed with."""
        self._move(Transition.FINISH)
        if isinstance(why, Exception):
            self.error = why
        else:
            self.finish_reason = why

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
    def order(self) -> float:
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
        return len(self.prefix_ids) + sum(c.num_tokens for c in self.chunks or ()) + len(self.query_ids)

    def decode_position(self) -> int:
        """The logical position of the token a decode step runs (the last one sampled): after the laid-out
        prompt (which holds the tokens generated before a preemption) and the tokens sampled since."""
        layout = self.link.layout
        num_laid_out = layout.num_tokens - self.num_prompt_tokens  # generated tokens in the layout
        return layout.end_position + len(self.output_ids) - num_laid_out - 1

    @property
    def is_finished(self) -> bool:
        return self._status is Status.FINISHED

    def __repr__(self) -> str:
        return f"Sequence({self.request_id}, {self._status.value}, {len(self.output_ids)} tokens)"
