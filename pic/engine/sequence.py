"""A request's state inside the engine, from arrival to its last token: ``Sequence``, whose status changes only
through its own methods (``wait``, ``run``, ``park``, ``preempt``, ``finish``)."""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future

import torch

from pic.compile import ChunkPrefill
from pic.engine.detokenizer import Detokenizer
from pic.engine.generation import FinishReason
from pic.engine.request import NewRequest, OutputSink
from pic.engine.sampling import SamplingParams
from pic.kv import ChunkInfo, ChunkKV, RequestKV
from pic.kv.transfer import to_device
from pic.link import Layout
from pic.link.recompute import PassResult, RecomputePass
from pic.model import SeqInput


class Status(enum.Enum):
    """Where a sequence is in its life: WAITING -> RUNNING -> FINISHED, with PARKED between a link and its
    generation and back to WAITING on preemption; any status can end in FINISHED (done, failed, aborted)."""

    WAITING = "waiting"  # queued for a recompute pass (new, preempted, or a parked one whose generation starts)
    RUNNING = "running"  # its recompute pass ran; decoding: one token per step
    PARKED = "parked"  # linked, not generating: ``PIC.link`` holds its KV until ``Linked.generate``
    FINISHED = "finished"


class Sequence:
    """One request: its prompt pieces, its KV once admitted, its tokens, timings, and how it ended.

    Only the engine's own thread (``EngineCore``) creates, reads or changes a sequence: other threads
    see what it puts in ``sink``.

    ``new`` is the request as its client sent it (``sampling=None``: park after the recompute pass).
    """

    interactive = True  # a chunk prefill it waits for goes before bulk compiles (``ChunkPrefill.is_interactive``)

    def __init__(self, new: NewRequest) -> None:
        self.request_id = new.request_id
        prompt = new.prompt
        self.cache_ids, self.prefix_ids, self.query_ids = prompt.cache_ids, prompt.prefix_ids, prompt.query_ids
        self.relevance = prompt.relevance
        self.policy, self.compile_options = new.policy, new.compile_options
        self.sampling: SamplingParams | None = new.sampling
        self.sink: OutputSink = new.sink
        self.paced = new.paced
        self.status = Status.WAITING
        self.arrival_s = time.perf_counter()
        self.order = self.arrival_s  # its place in the first-come-first-served order of prefill work
        self.scheduled_s: float | None = None  # first admitted
        self.linked_s: float | None = None  # first recompute pass done
        self.resumed_s: float | None = None  # generation started (parked sequences: ``Linked.generate``)
        self.first_token_s: float | None = None
        self.link_s: float | None = None  # ``PIC.link``'s wall time, for a parked sequence
        self.chunks: list[ChunkInfo | ChunkKV] | None = None  # resolved before its first admission
        # Chunks being fetched: cache id -> the loader's future (a lower tier) or the compile (from its tokens);
        # and the ones found in a lower tier, promoted into the pool at admission.
        self.pending: dict[str, Future | ChunkPrefill] = {}
        self.found: dict[str, ChunkKV] = {}
        self.lost: set[str] = set()  # chunks no tier holds: compiled again from their tokens
        self.layout: Layout | None = None  # of prompt + generated tokens: a preempted sequence is re-laid out
        self.selected: torch.Tensor | None = None  # [T] bool, the policy's recompute mask for ``layout``
        self.kv: RequestKV | None = None
        self.held: dict[str, list[int]] = {}  # chunk blocks kept while preempted
        self.pass_: RecomputePass | None = None  # the recompute pass under way
        self.num_piece_tokens: int | None = None  # tokens of it the current step runs (chunked prefill)
        # Query-aware policies: the chunk tokens the probe chose (``[n]`` bool over the prompt's tokens before the
        # query), kept so a preempted sequence runs the same second pass, not a new probe; and the probe pass's
        # result until the second pass is done.
        self.probed_chunks: torch.Tensor | None = None
        self.probe_result: PassResult | None = None
        self.shared_blocks: set[int] = set()  # table entries mapping a chunk's canonical block (no copy)
        self.next_slot: int | None = None  # the slot of the token a decode step runs
        self.first_pass: PassResult | None = None
        self.num_shared_blocks = self.num_private_blocks = 0
        self.query_hidden: torch.Tensor | None = None  # [num_query, hidden] final hidden states (parked)
        self.output_ids: list[int] = []
        self.detokenizer: Detokenizer | None = None
        self.generator: torch.Generator | None = None
        self.num_preemptions = 0
        self.finish_reason: FinishReason | None = None
        self.error: Exception | None = None

    # -- status: the only places it changes ----------------------------------------------------------------

    def wait(self) -> None:
        """Queue for admission: new, or a parked sequence whose generation starts."""
        assert self.status in (Status.WAITING, Status.PARKED), self
        self.status = Status.WAITING

    def run(self) -> None:
        """Its recompute pass ran (or a parked one's generation started): it decodes from now on."""
        assert self.status is Status.WAITING, self
        self.status = Status.RUNNING

    def park(self, query_hidden: torch.Tensor) -> None:
        """Linked (``PIC.link``): hold the KV and the query's final hidden states ``[num_query, hidden_size]``
        until ``Linked.generate`` resumes it."""
        assert self.status is Status.WAITING, self
        self.status, self.query_hidden = Status.PARKED, query_hidden

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
    def num_prompt_tokens(self) -> int:
        return len(self.prefix_ids) + sum(c.num_tokens for c in self.chunks or ()) + len(self.query_ids)

    def decode_position(self) -> int:
        """The logical position of the token a decode step runs (the last one sampled): after the laid-out
        prompt (which holds the tokens generated before a preemption) and the tokens sampled since."""
        num_laid_out = self.layout.num_tokens - self.num_prompt_tokens  # generated tokens in the layout
        return self.layout.end_position + len(self.output_ids) - num_laid_out - 1

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
    host = [[s.output_ids[-1] for s in seqs], [s.decode_position() for s in seqs], [s.next_slot for s in seqs]]
    tokens, positions, slots = to_device(torch.tensor(host, dtype=torch.long), device)  # [3, B] -> rows
    first_row = torch.zeros(1, dtype=torch.long, device=device)  # output_rows of every sequence (read only)
    return [
        SeqInput(
            kv=s.kv,
            token_ids=tokens[i : i + 1],
            positions=positions[i : i + 1],
            slots=slots[i : i + 1],
            output_rows=first_row,
            decode=True,
        )
        for i, s in enumerate(seqs)
    ]
