"""One request's view of the pool: its block table and the logical position of every slot."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pic.attention.ape import ContextScaling
from pic.kv.block_pool import BlockPool
from pic.kv.cache import KVCache
from pic.kv.transfer import long_tensor


class RequestKV:
    """The blocks a request maps, in slot order, and what each slot holds.

    Slots are numbered ``0 .. num_blocks * block_size - 1`` within the request; ``physical(slots)``
    maps them to rows of the cache's flattened K/V. ``kv_positions[s]`` is the logical position of
    the token in slot ``s``, or ``-1`` for padding and slots not yet written (masked in attention).

    The request owns one reference to every block of its table (a shared chunk block or a private
    one) and, while it is being linked, ``held`` references to the canonical blocks of its chunks,
    which a dynamic policy reads during the recompute pass; ``release_held`` drops those after it.

    Args:
        block_ids: the block table, one reference each already taken for this request.
        num_slots: slots in use (written or padding); decoding appends after them.
        held: references the request also owns, to chunk blocks it does not map.
    """

    def __init__(
        self, pool: BlockPool, cache: KVCache, block_ids: list[int], *, num_slots: int, held: Sequence[int] = ()
    ) -> None:
        assert len(block_ids) * cache.block_size >= num_slots, (len(block_ids), num_slots)
        self.pool, self.cache = pool, cache
        self.blocks: list[int] = list(block_ids)
        device = cache.device
        self.block_table = long_tensor(self.blocks, device)  # [num_blocks], no host sync
        self.kv_positions = torch.full((len(self.blocks) * cache.block_size,), -1, dtype=torch.long, device=device)
        self.num_slots = num_slots
        self._held = list(held)
        self._released = False
        # What an attention backend derives from this KV and keeps between forwards (AttentionBatch.scratch).
        self.scratch: dict = {}
        # APE (pic.attention.ape): the request's context scaling and its chunk slots, [num_blocks * block_size] bool.
        self.context: tuple[ContextScaling, torch.Tensor] | None = None

    def physical(self, slots: torch.Tensor) -> torch.Tensor:
        """Request slots ``[n]`` int64 -> rows of the cache's ``[num_blocks * block_size, ...]`` views."""
        bs = self.cache.block_size
        return self.block_table[slots // bs] * bs + slots % bs

    def append_slot(self) -> int:
        """Reserve the next slot (one more private block when the last is full); returns its index.

        Raises:
            KVPoolExhaustedError: no block is free or evictable.
        """
        bs = self.cache.block_size
        if self.num_slots == len(self.blocks) * bs:
            (block,) = self.pool.allocate(1)
            self.blocks.append(block)
            device = self.block_table.device
            self.block_table = torch.cat((self.block_table, long_tensor([block], device)))
            self.kv_positions = torch.cat((self.kv_positions, torch.full((bs,), -1, dtype=torch.long, device=device)))
            if self.context is not None:
                grown = torch.cat((self.context[1], torch.zeros(bs, dtype=torch.bool, device=device)))
                self.context = (self.context[0], grown)
        self.num_slots += 1
        return self.num_slots - 1

    def copy_on_write(self, indices: Sequence[int], fresh: Sequence[int]) -> None:
        """Give the request private copies of the blocks at table ``indices``: each block's KV (every layer)
        is copied into the matching ``fresh`` block (one reference each, taken for this request), which takes
        its place in the table; the request's reference to the old block is dropped."""
        if not indices:
            return
        old = [self.blocks[i] for i in indices]
        self.cache.copy_blocks(old, list(fresh))
        for i, block in zip(indices, fresh, strict=True):
            self.blocks[i] = block
        self.block_table = long_tensor(self.blocks, self.block_table.device)
        self.scratch.clear()  # whatever a backend derived from the old blocks
        self.pool.free(old)

    def release_held(self) -> None:
        """Drop the references to chunk blocks the request does not map (after the recompute pass)."""
        held, self._held = self._held, []
        self.pool.free(held)

    def release(self) -> None:
        """Drop every reference the request owns (idempotent): private blocks become free, shared
        chunk blocks lose one reference and stay resident."""
        if not self._released:
            self._released = True
            self.scratch.clear()
            self.release_held()
            self.pool.free(self.blocks)
