"""One step's work as the scheduler chose it (``ScheduledBatch``), the executor's plain plan made from it (the forward's
inputs, the rows it samples: ``pic.model.executor.StepPlan``), what came back (``ForwardOutput``) and the results by
work item (``StepOutput``), all in one order, written once here."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pic.compile import ChunkPrefill
from pic.engine.core.sequence import Sequence, Status
from pic.kv.transfer import to_device
from pic.model import SeqInput
from pic.model.executor import SampleRow, StepPlan


@dataclass(frozen=True, eq=False)
class PassPiece:
    """``num_tokens`` of an admitted sequence's recompute pass in this step; ``ends``: its pass ends with them
    (else it goes on in the next: chunked prefill of a long static pass)."""

    seq: Sequence
    num_tokens: int
    ends: bool


@dataclass
class ScheduledBatch:
    """One step's work, in the order its forward runs it. A probe's second pass runs in a batch of its own, right after
    its probe's (``Scheduler.second_passes``); a resumed link's first token is sampled from the hidden state its pass
    left (no forward)."""

    passes: list[PassPiece] = field(default_factory=list)  # recompute passes, or pieces of them
    pieces: list[tuple[ChunkPrefill, SeqInput]] = field(default_factory=list)  # chunk prefills' parts of the forward
    decodes: list[Sequence] = field(default_factory=list)  # running: their last token (``SeqBlocks.next_slot``)
    resumed: list[Sequence] = field(default_factory=list)  # parked sequences whose generation starts
    failed_prefills: list[tuple[ChunkPrefill, Exception]] = field(default_factory=list)  # cannot run: the error

    @property
    def has_prefill_work(self) -> bool:
        return bool(self.passes or self.pieces)

    @property
    def has_forward(self) -> bool:
        return bool(self.decodes) or self.has_prefill_work

    def plan(self, device: torch.device) -> tuple[StepPlan, list[int]]:
        """The executor's plan, and the request id of each row it samples: each resumed link's last query row, the
        last row of each pass that ends here and then generates (not a probe's: its second pass follows), each
        decode's; none for a generation of ``max_new_tokens=0``. It synchronizes when a link parks with its pass
        done."""
        inputs = self.inputs(device) if self.has_forward else []
        rows = [
            (seq, SampleRow(seq.sampling, seq.decoding.generator, hidden=seq.query_hidden[-1])) for seq in self.resumed
        ]
        num_passes, num_pieces = len(self.passes), len(self.pieces)
        for i, piece in enumerate(self.passes):
            if _generates_after(piece):
                rows.append((piece.seq, SampleRow(piece.seq.sampling, piece.seq.decoding.generator, input_index=i)))
        for i, seq in enumerate(self.decodes, start=num_passes + num_pieces):
            rows.append((seq, SampleRow(seq.sampling, seq.decoding.generator, input_index=i, decode=True)))
        rows = [(seq, row) for seq, row in rows if seq.sampling.max_new_tokens > 0]
        parks = any(p.ends and p.seq.sampling is None and not p.seq.link.pass_.is_probe for p in self.passes)
        return StepPlan(inputs, [row for _, row in rows], sync=parks), [seq.request_id for seq, _ in rows]

    def inputs(self, device: torch.device) -> list[SeqInput]:
        """The forward's sequences: the passes' pieces, the chunk prefills' pieces, the decode steps, in this order
        (``outputs`` reads the forward's results back in the same)."""
        passes = [p.seq.link.pass_.seq_input(p.num_tokens) for p in self.passes]
        return passes + [piece for _, piece in self.pieces] + decode_inputs(self.decodes, device)

    def outputs(self, hidden: list[torch.Tensor]) -> StepOutput:
        """The forward's results (one per sequence of ``inputs``, in order) by work item; a chunk prefill's piece
        asks for no rows."""
        assert len(hidden) == len(self.passes) + len(self.pieces) + len(self.decodes), "results do not match"
        num_passes, num_pieces = len(self.passes), len(self.pieces)
        passes = list(zip(self.passes, hidden[:num_passes], strict=True))
        decodes = list(zip(self.decodes, hidden[num_passes + num_pieces :], strict=True))
        return StepOutput(passes, [prefill for prefill, _ in self.pieces], decodes)


def _generates_after(piece: PassPiece) -> bool:
    """Whether the pass ends with this piece and its request then generates (its first token from the last row)."""
    seq = piece.seq
    return piece.ends and seq.status is Status.PREFILLING and seq.sampling is not None and not seq.link.pass_.is_probe


@dataclass(frozen=True)
class ForwardOutput:
    """What the executor gave back for a batch: ``hidden``, one tensor per sequence of ``ScheduledBatch.inputs``
    (none without a forward), ``sampled``, request id -> the token sampled for it (``ScheduledBatch.plan``), or the
    ``error`` the forward or the sampling raised (the batch's work fails, nothing else)."""

    hidden: list[torch.Tensor] = field(default_factory=list)
    sampled: dict[int, int] = field(default_factory=dict)
    error: Exception | None = None


@dataclass
class StepOutput:
    """A forward's results by work item: each pass piece and its final hidden states ``[num_output_rows,
    hidden_size]`` (no rows for a piece that goes on, or for a probe), the chunk prefills that ran a piece, each
    decoding sequence and its final hidden state ``[1, hidden_size]``."""

    passes: list[tuple[PassPiece, torch.Tensor]] = field(default_factory=list)
    pieces: list[ChunkPrefill] = field(default_factory=list)
    decodes: list[tuple[Sequence, torch.Tensor]] = field(default_factory=list)


def decode_inputs(seqs: list[Sequence], device: torch.device) -> list[SeqInput]:
    """The sequences' parts of a decode step: each one's last token, at the slot the scheduler reserved. Tokens,
    positions and slots of the whole step go to the device in one copy without a host sync (``pic.kv.transfer``);
    each sequence gets views of it."""
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
        )  # fmt: skip
        for i, s in enumerate(seqs)
    ]
