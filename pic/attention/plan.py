"""The per-step attention plan: what every layer shares, built once per forward (FlashInfer style).

A forward runs ``N`` query tokens of ``B`` sequences, concatenated: sequence ``b``'s tokens are rows
``cu_seqlens_q[b]:cu_seqlens_q[b + 1]``. Each sequence attends over its own paged KV: its block
table and the logical position of every slot (``-1`` for front padding, slots not yet written, and
the padding of the batch's tables). The plan holds those padded tables, the float32 rotary table the
batch reads (with a row offset per sequence) and which sequences decode (one query token) or run a
recompute pass. What a backend derives from it (the reference's per-slot cos/sin and masks, the Triton
kernel's int32 tiles) is built on first use by the first layer and memoized for the others.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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
        kv_lens: ``[B]`` int64, slots in each sequence's own table (``num_blocks_b * block_size``).
        rope_cos, rope_sin: ``[R, head_dim]`` float32 rotary tables (``RopeTable.tables``).
        rope_offsets: ``[B]`` int64, the row of each sequence's position 0 in the rotary tables.
        decode_seqs: ``[num_decode]`` int64, sequences with one query token, in batch order.
        prefill_seqs: the other sequences (recompute passes), in batch order.
    """

    cu_seqlens_q: torch.Tensor
    q_positions: torch.Tensor
    block_tables: torch.Tensor
    kv_positions: torch.Tensor
    kv_lens: torch.Tensor
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    rope_offsets: torch.Tensor
    decode_seqs: torch.Tensor
    prefill_seqs: list[int]
    _memo: dict[Any, Any] = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return self.block_tables.shape[0]

    @property
    def block_size(self) -> int:
        return self.kv_positions.shape[1] // max(1, self.block_tables.shape[1])

    def query_rows(self, seq: int) -> slice:
        """Rows of sequence ``seq``'s query tokens in the batch."""
        return slice(int(self.cu_seqlens_q[seq]), int(self.cu_seqlens_q[seq + 1]))

    def memo(self, key: Any, build: Callable[[], Any]) -> Any:
        """``build()`` once per plan under ``key``: per-forward data a backend derives, shared by every layer."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def rotary(self, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """``q_cos, q_sin`` ``[N, D]`` at the query positions and ``k_cos, k_sin`` ``[B, S, D]`` at the slot
        positions, cast to ``dtype`` as transformers casts (the reference backend's tables)."""

        def build() -> tuple[torch.Tensor, ...]:
            seq_of_row = torch.repeat_interleave(torch.diff(self.cu_seqlens_q)).to(self.q_positions.device)
            q_rows = self.rope_offsets[seq_of_row] + self.q_positions
            k_rows = self.rope_offsets[:, None] + self.kv_positions.clamp(min=0)
            return tuple(t[rows].to(dtype) for rows in (q_rows, k_rows) for t in (self.rope_cos, self.rope_sin))

        return self.memo(("rotary", dtype), build)

    def mask(self, group: int, sliding_window: int | None) -> torch.Tensor:
        """``[b, n, S]`` bool, True where a query may attend: a written slot at a position not after the
        query's (exact causality by position) and, with a window, within it. ``group`` is a prefill
        sequence (``b = 1``, its ``n`` query tokens) or ``-1`` for the decode sequences (``n = 1``)."""

        def build() -> torch.Tensor:
            q, kv = self.group_positions(group)  # [b, n], [b, S]
            allowed = (kv[:, None, :] >= 0) & (kv[:, None, :] <= q[:, :, None])
            if sliding_window is not None:
                allowed &= kv[:, None, :] > q[:, :, None] - sliding_window
            return allowed

        return self.memo(("mask", group, sliding_window), build)

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
    """Build the plan of one forward. Host data goes to the device with non-blocking copies: no host
    sync, except for a dynamic rope type (its tables need each sequence's largest position).

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
    if rope.is_dynamic:  # one table per sequence, to the largest position it attends with (a host sync)
        q_max = [int(q.max()) for q in q_positions.split(seq_lens)]
        max_positions = [max(a, int(k.max())) for a, k in zip(q_max, kv_positions, strict=True)]
    else:
        max_positions = [0] * len(seq_lens)
    cos, sin, offsets = rope.tables(max_positions)
    lens = torch.tensor(seq_lens)
    device = q_positions.device
    return BatchPlan(
        cu_seqlens_q=cu,
        q_positions=q_positions,
        block_tables=tables,
        kv_positions=kv,
        kv_lens=torch.tensor([k.shape[0] for k in kv_positions]).to(device, non_blocking=True),
        rope_cos=cos,
        rope_sin=sin,
        rope_offsets=offsets,
        decode_seqs=(lens == 1).nonzero().squeeze(1).to(device, non_blocking=True),
        prefill_seqs=(lens > 1).nonzero().squeeze(1).tolist(),
    )
