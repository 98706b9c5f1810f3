"""The KV tensors the block pool's block ids index: one preallocated K and V for every layer."""

from __future__ import annotations

import torch

from pic.kv.transfer import long_tensor, to_device


def blocks_for(num_slots: int, block_size: int) -> int:
    """Blocks that hold ``num_slots`` slots (rounded up)."""
    return -(-num_slots // block_size)


class KVCache:
    """Paged NoPE K and V of every layer.

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
        self.k = torch.empty(shape, dtype=dtype, device=device)  # never-written slots are never read
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.k_rows = self.k.flatten(1, 2)
        self.v_rows = self.v.flatten(1, 2)
        self.block_size = block_size

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.k[:, 0].numel() * self.k.element_size()

    def rows(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """``[num_tokens]`` int64 rows of the *last* ``num_tokens`` slots of ``block_ids`` (a front-padded
        chunk's tokens in its canonical blocks)."""
        bs = self.block_size
        assert 0 < num_tokens <= len(block_ids) * bs < num_tokens + bs, (num_tokens, len(block_ids))
        slots = torch.arange(len(block_ids) * bs - num_tokens, len(block_ids) * bs, device=self.device)
        return long_tensor(block_ids, self.device)[slots // bs] * bs + slots % bs

    def write(self, block_ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Put a chunk's KV (``[num_layers, L, num_kv_heads, head_dim]`` each) into its canonical blocks,
        front-padded: the tokens fill the last ``L`` slots.

        From the CPU the copy is asynchronous (``to_device``): the caller must not write into ``k`` and ``v``
        until the stream has run it (the store's chunks are never written; freeing them is safe). The
        blocks are written by the same stream as every later kernel that reads them."""
        rows = self.rows(block_ids, k.shape[1])
        self.k_rows[:, rows] = to_device(k, self.device)
        self.v_rows[:, rows] = to_device(v, self.device)

    def read(self, block_ids: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A chunk's KV out of its canonical blocks: ``[num_layers, num_tokens, num_kv_heads, head_dim]``
        each, copies on the cache's device (queued on the stream: a later write to the blocks cannot change them)."""
        rows = self.rows(block_ids, num_tokens)
        return self.k_rows[:, rows], self.v_rows[:, rows]

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks (every layer) ``src[i] -> dst[i]``: copy-on-write."""
        if src:
            s, d = long_tensor(src, self.device), long_tensor(dst, self.device)
            self.k[:, d] = self.k[:, s]
            self.v[:, d] = self.v[:, s]
