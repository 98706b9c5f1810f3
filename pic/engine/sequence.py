"""A request's state inside the engine, from arrival to its last token: ``Sequence``, whose own fields change only
through its own methods (``wait``, ``generate``, ``admitted``, ``run``, ``park``, ``append``, ``preempt``,
``finish``), and whose parts each have one owner (fetch, link, blocks, decoding)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

import torch

from pic.engine.chunk_sources import Fetch
from pic.engine.decoding import Decoding
from pic.engine.generation import FinishReason
from pic.engine.kv_manager import SeqBlocks
from pic.engine.request import NewRequest, OutputSink
from pic.engine.sampling import SamplingParams
from pic.kv import ChunkInfo, ChunkKV
from pic.kv.transfer import to_device
from pic.link.linker import LinkState
from pic.link.policies import Policy
from pic.model import SeqInput


class Status(enum.Enum):
    """Where a sequence is in its life: WAITING -> RUNNING -> FINISHED, with PARKED between a link and its
    generation and back to WAITING on preemption; any status can end in FINISHED (done, failed, aborted)."""

    WAITING = "waiting"  # queued for a recompute pass (new, preempted, or a parked one whose generation starts)
    RUNNING = "running"  # its recompute pass ran; decoding: one token per step
    PARKED = "parked"  # linked, not generating: ``PIC.link`` holds its KV until ``Linked.generate``
    FINISHED = "finished"


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

    Only the engine's own thread (``EngineCore``) creates, reads or changes a sequence: other threads see what
    it puts in ``sink``. Each part has one writer: the request's fields, status, tokens and ``times`` change
    only through the methods below; ``fetch`` is ``ChunkSources``'s, ``link`` the ``Linker``'s, ``blocks`` the
    ``KVManager``'s, ``decoding`` the ``Decoder``'s (made by it, handed over by ``generate``).

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
        self.status = Status.WAITING
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

    # -- status: the only places it changes ----------------------------------------------------------------

    def wait(self) -> None:
        """Queue for admission: new, or a parked sequence whose generation starts."""
        assert self.status in (Status.WAITING, Status.PARKED), self
        self.status = Status.WAITING

    def generate(
        self, params: SamplingParams, decoding: Decoding, *, sink: OutputSink | None = None, link_s: float | None = None
    ) -> None:
        """Generate with ``params`` (a parked sequence: from now on, its outputs to ``sink``; ``link_s``: the
        ``PIC.link`` call's wall time)."""
        self.sampling, self.decoding = params, decoding
        if sink is not None:
            self.sink, self.times.link_s, self.times.resumed_s = sink, link_s, time.perf_counter()

    def admitted(self) -> None:
        """Its blocks were taken: its pass runs from now on."""
        self.times.scheduled_s = self.times.scheduled_s or time.perf_counter()

    def run(self) -> None:
        """Its recompute pass ran (or a parked one's generation started): it decodes from now on."""
        assert self.status is Status.WAITING, self
        self.status = Status.RUNNING
        self.times.linked_s = self.times.linked_s or time.perf_counter()

    def park(self, query_hidden: torch.Tensor) -> None:
        """Linked (``PIC.link``): hold the KV and the query's final hidden states ``[num_query, hidden_size]``
        until ``Linked.generate`` resumes it."""
        assert self.status is Status.WAITING, self
        self.status, self.query_hidden = Status.PARKED, query_hidden
        self.times.linked_s = self.times.linked_s or time.perf_counter()

    def append(self, token: int) -> None:
        """A token was sampled."""
        self.times.first_token_s = self.times.first_token_s or time.perf_counter()
        self.output_ids.append(token)

    def preempt(self) -> None:
        """Its blocks were freed for others: back to waiting, for a fresh pass over its prompt and output."""
        assert self.status is Status.RUNNING, self
        self.status = Status.WAITING
        self.num_preemptions += 1

    def finish(self, why: FinishReason | Exception) -> None:
        """Done: ``why`` is the reason it ended, or the error it failed with."""
        if isinstance(why, Exception):
            self.error = why
        else:
            self.finish_reason = why
        self.status = Status.FINISHED

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
        return self.status is Status.FINISHED

    def __repr__(self) -> str:
        return f"Sequence({self.request_id}, {self.status.value}, {len(self.output_ids)} tokens)"


def decode_inputs(seqs: list[Sequence], device: torch.device) -> list[SeqInput]:
    """The sequences' parts of a decode step: each one's last token, at the slot the scheduler reserved.

    Tokens, positions and slots of the whole step go to the device in one copy without a host sync
    (``pic.kv.transfer``); each sequence gets views of it.
    """
    if not seqs:
        return []
    host = [[s.output_ids[-1] for s in seqs], [s.decode_position() for s in seqs], [s.blocks.next_slot for s in seqs]]
    tokens, positions, slots = to_device(torch.tensor(host, dtype=torch.long), device)  # [3, B] -> rows
    first_row = torch.zeros(1, dtype=torch.long, device=device)  # output_rows of every sequence (read only)
    return [
        SeqInput(
            kv=s.blocks.kv,
            token_ids=tokens[i : i + 1],
            positions=positions[i : i + 1],
            slots=slots[i : i + 1],
            output_rows=first_row,
            decode=True,
        )
        for i, s in enumerate(seqs)
    ]
