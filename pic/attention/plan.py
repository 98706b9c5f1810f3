"""The per-forward attention plan: everything every layer shares, computed once (FlashInfer style).

A forward pass runs ``N`` query tokens of one request against the request's paged KV. The plan holds
the request's block table, the logical position of every slot (``-1`` for front padding and slots not
yet written), the rotary tables at the query and slot positions, and the boolean masks (built lazily,
one per distinct sliding window). Layers then only rotate, attend and write.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# positions [n] int64 -> (cos, sin), each [n, head_dim] in the model dtype.
RopeFn = Callable[[torch.Tensor], "tuple[torch.Tensor, torch.Tensor]"]


@dataclass
class AttentionPlan:
    """Attention metadata for one forward pass over one request.

    Attributes:
        block_table: ``[num_req_blocks]`` int64, the request's physical blocks in slot order.
        q_positions: ``[N]`` int64, logical positions of the query tokens.
        kv_positions: ``[num_req_blocks * block_size]`` int64, logical position of every slot of the
            request; ``-1`` marks padding and unwritten slots, which are never attended to.
        q_cos, q_sin: ``[N, head_dim]`` rotary tables at ``q_positions``.
        k_cos, k_sin: ``[num_req_blocks * block_size, head_dim]`` rotary tables at the slot positions.
        written: ``[num_req_blocks * block_size]`` bool, ``kv_positions >= 0``: the slots attention may
            read at all (the others may hold stale KV of a reused block, NaN included).
    """

    block_table: torch.Tensor
    q_positions: torch.Tensor
    kv_positions: torch.Tensor
    q_cos: torch.Tensor
    q_sin: torch.Tensor
    k_cos: torch.Tensor
    k_sin: torch.Tensor
    written: torch.Tensor
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict, repr=False)

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """``[N, num_slots]`` bool, True where a query may attend: a written slot at a position not
        after the query's (exact causality by position) and, with a window, within it."""
        if sliding_window not in self._masks:
            q = self.q_positions[:, None]
            kv = self.kv_positions[None, :]
            allowed = self.written[None, :] & (kv <= q)
            if sliding_window is not None:
                allowed &= kv > q - sliding_window
            self._masks[sliding_window] = allowed
        return self._masks[sliding_window]


def make_plan(
    *, block_table: torch.Tensor, q_positions: torch.Tensor, kv_positions: torch.Tensor, rope: RopeFn
) -> AttentionPlan:
    """Build the plan; ``rope`` is called once, for the query and slot positions together, so that
    dynamic rope types see the request's largest position exactly as transformers does."""
    num_q = q_positions.shape[0]
    cos, sin = rope(torch.cat((q_positions, kv_positions.clamp(min=0))))
    return AttentionPlan(
        block_table=block_table,
        q_positions=q_positions,
        kv_positions=kv_positions,
        q_cos=cos[:num_q],
        q_sin=sin[:num_q],
        k_cos=cos[num_q:],
        k_sin=sin[num_q:],
        written=kv_positions >= 0,
    )
