"""The paged KV pool: one preallocated tensor per K and V, handed out in fixed-size blocks.

Requests own lists of block ids (block tables), so a prompt's KV needs no contiguous memory and
chunk KV can be copied in (or, later, shared) a block at a time. Blocks live in a FIFO free queue:
allocation and release are O(1) per block.
"""

from __future__ import annotations

from collections import deque

import torch

from pic.errors import KVPoolExhaustedError


class KVPool:
    """Block allocator over the KV tensors of every layer.

    Attributes:
        k, v: ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]`` in the model dtype;
            K is stored before RoPE.
        k_rows, v_rows: the same memory as ``[num_layers, num_blocks * block_size, num_kv_heads,
            head_dim]``: row ``block * block_size + offset`` is one slot.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.k_rows = self.k.flatten(1, 2)
        self.v_rows = self.v.flatten(1, 2)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` free blocks.

        Raises:
            KVPoolExhaustedError: fewer are free; nothing is taken.
        """
        if not self.can_allocate(num_blocks):
            raise KVPoolExhaustedError(
                f"KV pool exhausted: need {num_blocks} blocks of {self.block_size} tokens, "
                f"{len(self._free)} of {self.num_blocks} free (raise PICConfig.kv_pool_tokens, or "
                f"generate from / release pending Linked requests)"
            )
        return [self._free.popleft() for _ in range(num_blocks)]

    def free(self, blocks: list[int]) -> None:
        """Return blocks to the pool."""
        assert len(self._free) + len(blocks) <= self.num_blocks, "block freed twice"
        self._free.extend(blocks)
