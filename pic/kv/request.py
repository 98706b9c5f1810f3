"""One request's view of the pool: its block table and the logical position of every slot."""

from __future__ import annotations

import torch

from pic.kv.pool import KVPool


class RequestKV:
    """The blocks a request owns, in slot order, and what each slot holds.

    Slots are numbered ``0 .. num_blocks * block_size - 1`` within the request; ``physical(slots)``
    maps them to rows of the pool's flattened K/V. ``kv_positions[s]`` is the logical position of
    the token in slot ``s``, or ``-1`` for padding and slots not yet written (masked in attention).
    """

    def __init__(self, pool: KVPool, num_slots: int) -> None:
        self.pool = pool
        self.blocks: list[int] = pool.allocate(self._blocks_for(num_slots))
        device = pool.k.device
        self.block_table = torch.tensor(self.blocks, dtype=torch.long, device=device)  # [num_blocks]
        self.kv_positions = torch.full((len(self.blocks) * pool.block_size,), -1, dtype=torch.long, device=device)
        self.num_slots = num_slots  # slots in use (written or padding); decoding appends after them
        self._released = False

    def _blocks_for(self, num_slots: int) -> int:
        return -(-num_slots // self.pool.block_size)

    def physical(self, slots: torch.Tensor) -> torch.Tensor:
        """Request slots ``[n]`` int64 -> rows of the pool's ``[num_blocks * block_size, ...]`` views."""
        bs = self.pool.block_size
        return self.block_table[slots // bs] * bs + slots % bs

    def append_slot(self) -> int:
        """Reserve the next slot (one more block when the last is full); returns its index."""
        if self.num_slots == len(self.blocks) * self.pool.block_size:
            (block,) = self.pool.allocate(1)
            self.blocks.append(block)
            device = self.block_table.device
            self.block_table = torch.cat((self.block_table, torch.tensor([block], device=device)))
            pad = torch.full((self.pool.block_size,), -1, dtype=torch.long, device=device)
            self.kv_positions = torch.cat((self.kv_positions, pad))
        self.num_slots += 1
        return self.num_slots - 1

    def release(self) -> None:
        """Give the blocks back to the pool (idempotent)."""
        if not self._released:
            self._released = True
            self.pool.free(self.blocks)
