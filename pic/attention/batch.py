"""What one forward's attention is over, whatever backend runs it: built once per forward.

A forward runs ``N`` query tokens of ``B`` sequences, concatenated: sequence ``b``'s tokens are rows
``cu_seqlens_q[b]:cu_seqlens_q[b + 1]``. Each sequence attends over its own paged KV: its block
table and the logical position of every slot (``-1`` for front padding, slots not yet written, and
the padding of the batch's tables). The batch holds those padded tables, the float32 rotary table it
reads (with a row offset per sequence) and which sequences decode (one query token) or run a
recompute pass. A backend's ``plan`` turns it into what its kernels read (FlashInfer's plan/run); the
batch itself carries nothing backend-specific.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from pic.attention.ape import ContextScaling
from pic.attention.rope import RopeTable


@dataclass(frozen=True)
class AttentionBatch:
    """Attention metadata for one forward over ``B`` sequences.

    Attributes:
        cu_seqlens_q: ``[B + 1]`` int64 (CPU), query rows of each sequence in the batch.
        q_positions: ``[N]`` int64, logical positions of the query tokens.
        block_tables: ``[B, max_blocks]`` int64, each sequence's physical blocks in slot order,
            padded with block 0 (whose slots ``kv_positions`` marks ``-1``).
        kv_positions: ``[B, max_blocks * block_size]`` int64, the logical position of every slot;
            ``-1`` marks slots never attended to (padding, unwritten, past the sequence's table).
        rope_cos, rope_sin: ``[R, head_dim]`` float32 rotary tables (``RopeTable.tables``).
        rope_offsets: ``[B]`` int64, the row of each sequence's position 0 in the rotary tables.
        decode_seqs: ``[num_decode]`` int64, sequences with one query token, in batch order.
        prefill_seqs: the other sequences (recompute passes), in batch order.
        scratch: per sequence, a dict in which a backend may keep what it derives from the sequence's KV from
            one forward to the next (it lives as long as the request's KV: ``RequestKV.scratch``); empty: none.
        context_scaling: per sequence, APE's attention over its chunks (``pic.attention.ape``), ``None`` for
            plain attention; empty when no sequence has one.
        kv_context: ``[B, max_blocks * block_size]`` bool, the chunk slots of the sequences with a context
            scaling (``None`` when none has one).
    """

    cu_seqlens_q: torch.Tensor
    q_positions: torch.Tensor
    block_tables: torch.Tensor
    kv_positions: torch.Tensor
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    rope_offsets: torch.Tensor
    decode_seqs: torch.Tensor
    prefill_seqs: list[int]
    scratch: tuple[dict, ...] = ()
    context_scaling: tuple[ContextScaling | None, ...] = ()
    kv_context: torch.Tensor | None = None

    def query_rows(self, seq: int) -> slice:
        """Rows of sequence ``seq``'s query tokens in the batch."""
        return slice(int(self.cu_seqlens_q[seq]), int(self.cu_seqlens_q[seq + 1]))


def make_batch(
    *,
    block_tables: list[torch.Tensor],
    kv_positions: list[torch.Tensor],
    q_positions: torch.Tensor,
    seq_lens: list[int],
    rope: RopeTable,
    scratch: Sequence[dict] = (),
    context: Sequence[tuple[ContextScaling, torch.Tensor] | None] = (),
    decoding: Sequence[bool] | None = None,
) -> AttentionBatch:
    """Describe one forward. Host data goes to the device with non-blocking copies: no host sync, except
    for a dynamic rope type (its tables need each sequence's largest position).

    Args:
        block_tables: per sequence, ``[num_blocks_b]`` int64 physical blocks.
        kv_positions: per sequence, ``[num_blocks_b * block_size]`` int64 slot positions (``-1``: none).
        q_positions: ``[N]`` int64, the query tokens of every sequence, concatenated.
        seq_lens: query tokens per sequence (``sum == N``); a sequence with none (every token dropped from a
            pass) takes no part in attention.
        rope: the engine's rotary table.
        scratch: per sequence, its ``RequestKV.scratch`` (``AttentionBatch.scratch``), or none.
        context: per sequence, ``None`` or its APE context scaling and ``[num_blocks_b * block_size]`` bool chunk
            slots (``RequestKV.context``).
        decoding: per sequence, whether it decodes (its one token follows every slot it wrote); ``None``: the
            sequences with one query token. A pass left with one token (the others dropped, or a piece of one) is
            not decoding: its token may precede written slots, which a decode attends without a mask.
    """
    cu = torch.tensor([0, *seq_lens]).cumsum(0)
    tables = pad_sequence(block_tables, batch_first=True, padding_value=0)
    kv = pad_sequence(kv_positions, batch_first=True, padding_value=-1)
    if rope.is_dynamic:  # one table per sequence, to the largest position it attends with (a host sync)
        q_max = [int(q.max()) for q in q_positions.split(seq_lens)]
        max_positions = [max(a, int(k.max())) for a, k in zip(q_max, kv_positions, strict=True)]
    else:
        max_positions = [0] * len(seq_lens)
    cos, sin, offsets = rope.tables(max_positions)
    lens = torch.tensor(seq_lens)
    decodes = lens == 1 if decoding is None else torch.tensor(list(decoding), dtype=torch.bool) & (lens == 1)
    device = q_positions.device
    return AttentionBatch(
        cu_seqlens_q=cu,
        q_positions=q_positions,
        block_tables=tables,
        kv_positions=kv,
        rope_cos=cos,
        rope_sin=sin,
        rope_offsets=offsets,
        decode_seqs=decodes.nonzero().squeeze(1).to(device, non_blocking=True),
        prefill_seqs=((lens > 0) & ~decodes).nonzero().squeeze(1).tolist(),
        scratch=tuple(scratch),
        **_context(context, kv.shape[1], device),
    )


def _context(
    context: Sequence[tuple[ContextScaling, torch.Tensor] | None], num_slots: int, device: torch.device
) -> dict[str, object]:
    """``AttentionBatch``'s APE fields: empty unless a sequence has a context scaling."""
    if not any(c is not None for c in context):
        return {}
    kv_context = torch.zeros(len(context), num_slots, dtype=torch.bool, device=device)
    for b, item in enumerate(context):
        if item is not None:
            kv_context[b, : item[1].shape[0]] = item[1]
    return {"context_scaling": tuple(None if c is None else c[0] for c in context), "kv_context": kv_context}
