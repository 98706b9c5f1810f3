"""The per-step attention plan: what every layer shares, built once per forward (FlashInfer style).

A forward runs ``N`` query tokens of ``B`` sequences, concatenated: sequence ``b``'s tokens are rows
``cu_seqlens_q[b]:cu_seqlens_q[b + 1]``. Each sequence attends over its own paged KV: its block
table and the logical position of every slot (``-1`` for front padding, slots not yet written, and
the padding of the batch's tables). The plan holds those padded per-sequence tables, the rotary
cos/sin at every query and slot position, and which sequences decode (one query token: attended as
one padded batch) or run a recompute pass (attended one by one). Layers then only rotate, attend and
write; boolean masks are built lazily, once per group and sliding window.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn.utils.rnn import pad_sequence

from pic.attention.rope import RopeTable


@dataclass
class BatchPlan:
    """Attention metadata for one forward over ``B`` sequences.

    Attributes:
        cu_seqlens_q: ``[B + 1]`` int64 (CPU), query rows of each sequence in the batch.
        q_positions: ``[N]`` int64, logical positions of the query tokens.
        block_tables: ``[B, max_blocks]`` int64, each sequence's physical blocks in slot order,
            padded with block 0 (whose slots ``kv_positions`` marks ``-1``).
        kv_positions: ``[B, max_blocks * block_size]`` int64, the logical position of every slot;
            ``-1`` marks slots never attended to (padding, unwritten, past the sequence's table).
        q_cos, q_sin: ``[N, head_dim]`` rotary tables at ``q_positions`` (model dtype).
        k_cos, k_sin: ``[B, max_blocks * block_size, head_dim]`` rotary tables at the slot positions.
        decode_seqs: ``[num_decode]`` int64, sequences with one query token, in batch order.
        prefill_seqs: the other sequences (recompute passes), in batch order.
    """

    cu_seqlens_q: torch.Tensor
    q_positions: torch.Tensor
    block_tables: torch.Tensor
    kv_positions: torch.Tensor
    q_cos: torch.Tensor
    q_sin: torch.Tensor
    k_cos: torch.Tensor
    k_sin: torch.Tensor
    decode_seqs: torch.Tensor
    prefill_seqs: list[int]
    _masks: dict[tuple[int, int | None], torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return self.block_tables.shape[0]

    def query_rows(self, seq: int) -> slice:
        """Rows of sequence ``seq``'s query tokens in the batch."""
        return slice(int(self.cu_seqlens_q[seq]), int(self.cu_seqlens_q[seq + 1]))

    def mask(self, group: int, sliding_window: int | None) -> torch.Tensor:
        """``[b, n, S]`` bool, True where a query may attend: a written slot at a position not after the
        query's (exact causality by position) and, with a window, within it. ``group`` is a prefill
        sequence (``b = 1``, its ``n`` query tokens) or ``-1`` for the decode sequences (``n = 1``)."""
        key = (group, sliding_window)
        if key not in self._masks:
            q, kv = self.group_positions(group)  # [b, n], [b, S]
            allowed = (kv[:, None, :] >= 0) & (kv[:, None, :] <= q[:, :, None])
            if sliding_window is not None:
                allowed &= kv[:, None, :] > q[:, :, None] - sliding_window
            self._masks[key] = allowed
        return self._masks[key]

    def group_positions(self, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Query ``[b, n]`` and slot ``[b, S]`` positions of a group (see ``mask``)."""
        if group < 0:
            rows = self.cu_seqlens_q[:-1].to(self.q_positions.device)[self.decode_seqs]
            return self.q_positions[rows][:, None], self.kv_positions[self.decode_seqs]
        return self.q_positions[self.query_rows(group)][None], self.kv_positions[group : group + 1]


def make_plan(
    *,
    block_tables: list[torch.Tensor],
    kv_positions: list[torch.Tensor],
    q_positions: torch.Tensor,
    seq_lens: list[int],
    rope: RopeTable,
) -> BatchPlan:
    """Build the plan of one forward.

    Args:
        block_tables: per sequence, ``[num_blocks_b]`` int64 physical blocks.
        kv_positions: per sequence, ``[num_blocks_b * block_size]`` int64 slot positions (``-1``: none).
        q_positions: ``[N]`` int64, the query tokens of every sequence, concatenated.
        seq_lens: query tokens per sequence (``sum == N``; each at least 1).
        rope: the engine's rotary table.
    """
    cu = torch.tensor([0, *seq_lens]).cumsum(0)
    tables = pad_sequence(block_tables, batch_first=True, padding_value=0)
    kv = pad_sequence(kv_positions, batch_first=True, padding_value=-1)
    if rope.is_dynamic:  # the module sees one sequence at a time, queries and slots together
        q_cos, q_sin, k_cos, k_sin = _dynamic_tables(rope, q_positions, kv, cu)
    else:
        q_cos, q_sin = rope(q_positions)
        k_cos, k_sin = rope(kv.clamp(min=0))
    lens = torch.tensor(seq_lens)
    return BatchPlan(
        cu_seqlens_q=cu,
        q_positions=q_positions,
        block_tables=tables,
        kv_positions=kv,
        q_cos=q_cos,
        q_sin=q_sin,
        k_cos=k_cos,
        k_sin=k_sin,
        decode_seqs=(lens == 1).nonzero().squeeze(1).to(q_positions.device),
        prefill_seqs=(lens > 1).nonzero().squeeze(1).tolist(),
    )


def _dynamic_tables(
    rope: RopeTable, q_positions: torch.Tensor, kv: torch.Tensor, cu: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Per-sequence rotary tables for a dynamic rope type: ``q_cos, q_sin [N, D], k_cos, k_sin [B, S, D]``."""
    q_parts, k_parts = [], []
    for b in range(kv.shape[0]):
        q = q_positions[int(cu[b]) : int(cu[b + 1])]
        cos, sin = rope(torch.cat((q, kv[b].clamp(min=0))))
        q_parts.append((cos[: q.shape[0]], sin[: q.shape[0]]))
        k_parts.append((cos[q.shape[0] :], sin[q.shape[0] :]))
    q_cos, q_sin = (torch.cat(t) for t in zip(*q_parts, strict=True))
    k_cos, k_sin = (torch.stack(t) for t in zip(*k_parts, strict=True))
    return q_cos, q_sin, k_cos, k_sin
