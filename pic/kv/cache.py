"""KV tensors: the pool's paged K and V (``KVCache``), one request's view of them (``RequestKV``), and a compiled
chunk's own (``ChunkKV``; ``ChunkInfo`` without the tensors). The block ids they use are the ``BlockPool``'s."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pic.attention.ape import ContextScaling
from pic.config import CompileOptions
from pic.kv.transfer import long_tensor, to_device


def blocks_for(num_slots: int, block_size: int) -> int:
    """Blocks that hold ``num_slots`` slots (rounded up)."""
    return -(-num_slots // block_size)


class KVCache:
    """Paged NoPE K and V of every layer: ``k``, ``v``: ``[num_layers, num_blocks, block_size, num_kv_heads,
    head_dim]`` in the model dtype (K before RoPE); ``k_rows``, ``v_rows``: the same memory with one row per slot,
    ``[num_layers, num_blocks * block_size, num_kv_heads, head_dim]`` (row ``block * block_size + offset``)."""

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
        """Put a chunk's KV (``[num_layers, L, num_kv_heads, head_dim]`` each) into its canonical blocks'
        last ``L`` slots. From the CPU the copy is asynchronous (``to_device``): ``k`` and ``v`` must not be
        written until the stream has run it (the store's chunks never are; freeing them is safe)."""
        rows = self.rows(block_ids, k.shape[1])
        self.k_rows[:, rows] = to_device(k, self.device)
        self.v_rows[:, rows] = to_device(v, self.device)

    def read(self, block_ids: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A chunk's KV out of its canonical blocks: ``[num_layers, num_tokens, num_kv_heads, head_dim]``
        each, copies (queued on the stream: a later write to the blocks cannot change them)."""
        rows = self.rows(block_ids, num_tokens)
        return self.k_rows[:, rows], self.v_rows[:, rows]

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks (every layer) ``src[i] -> dst[i]``: copy-on-write."""
        if src:
            s, d = long_tensor(src, self.device), long_tensor(dst, self.device)
            self.k[:, d] = self.k[:, s]
            self.v[:, d] = self.v[:, s]


class RequestKV:
    """The blocks a request maps, in slot order, and what each slot holds: ``kv_positions[s]``, the logical position
    of the token in request slot ``s`` (-1: padding, or not yet written: masked in attention); ``physical(slots)``
    maps slots to rows of the cache's flattened K/V. The request owns one reference to every block of its table
    (``blocks``: int64 on the host, in slot order) and, while it is being linked, ``held`` references to its chunks'
    canonical blocks, which a dynamic policy reads in the recompute pass (``release_held`` hands them back after it).
    ``num_slots``: slots in use (written or padding); decoding appends after them. It keeps no pool: the KV manager
    takes and frees its blocks (``pic.engine.core.kv_manager``), and every method here that lets references go
    returns them to free (arrays: the pool counts them in bulk)."""

    def __init__(
        self,
        cache: KVCache,
        block_ids: Sequence[int] | np.ndarray,
        *,
        num_slots: int,
        held: Sequence[int] | np.ndarray = (),
    ) -> None:
        assert len(block_ids) * cache.block_size >= num_slots, (len(block_ids), num_slots)
        self.cache = cache
        self.blocks = np.array(block_ids, dtype=np.int64)  # (a copy: the caller's is not written)
        device = cache.device
        self.block_table = _table(self.blocks, device)  # [num_blocks], no host sync
        self.kv_positions = torch.full((len(self.blocks) * cache.block_size,), -1, dtype=torch.long, device=device)
        self.num_slots = num_slots
        self._held = np.asarray(held, dtype=np.int64)
        self._released = False
        # What an attention backend derives from this KV and keeps between forwards (AttentionBatch.scratch).
        self.scratch: dict = {}
        # APE (pic.attention.ape): the request's context scaling and its chunk slots, [num_blocks * block_size] bool.
        self.context: tuple[ContextScaling, torch.Tensor] | None = None

    @property
    def references(self) -> list[int]:
        """The blocks it holds a reference to, once per reference (its table's and its held chunk blocks)."""
        return [] if self._released else np.concatenate((self.blocks, self._held)).tolist()

    def physical(self, slots: torch.Tensor) -> torch.Tensor:
        """Request slots ``[n]`` int64 -> rows of the cache's ``[num_blocks * block_size, ...]`` views."""
        bs = self.cache.block_size
        return self.block_table[slots // bs] * bs + slots % bs

    @property
    def is_full(self) -> bool:
        """Every slot of its blocks is in use: the next one needs a block more (``add_block``)."""
        return self.num_slots == len(self.blocks) * self.cache.block_size

    def add_block(self, block: int) -> None:
        """Append a private block (taken for this request) to the table."""
        bs, device = self.cache.block_size, self.block_table.device
        self.blocks = np.append(self.blocks, block)
        self.block_table = torch.cat((self.block_table, long_tensor([block], device)))
        self.kv_positions = torch.cat((self.kv_positions, torch.full((bs,), -1, dtype=torch.long, device=device)))
        if self.context is not None:
            grown = torch.cat((self.context[1], torch.zeros(bs, dtype=torch.bool, device=device)))
            self.context = (self.context[0], grown)

    def append_slot(self) -> int:
        """Reserve the next slot (the caller added a block when ``is_full``); returns its index."""
        assert not self.is_full, "append_slot on a full table: add_block first"
        self.num_slots += 1
        return self.num_slots - 1

    def copy_on_write(self, indices: Sequence[int], fresh: Sequence[int]) -> list[int]:
        """Give the request private copies of the blocks at table ``indices``: each block's KV is copied into
        the matching ``fresh`` block (taken for this request), which takes its place in the table; returns the old
        blocks, whose references the request let go (the caller frees them)."""
        if not len(indices):
            return []
        assert len(indices) == len(fresh), (len(indices), len(fresh))
        old = self.blocks[indices].tolist()
        self.cache.copy_blocks(old, list(fresh))
        self.blocks[indices] = fresh
        self.block_table = _table(self.blocks, self.block_table.device)
        self.scratch.clear()  # whatever a backend derived from the old blocks
        return old

    def release_held(self) -> np.ndarray:
        """Let the references to chunk blocks the request does not map go (after the recompute pass); returns them."""
        held, self._held = self._held, self._held[:0]
        return held

    def release(self) -> np.ndarray:
        """Let every reference the request owns go; returns them, once (then none): freed, private blocks become
        free and shared chunk blocks lose one reference and stay resident."""
        if self._released:
            return self.blocks[:0]
        self._released = True
        self.scratch.clear()
        return np.concatenate((self.release_held(), self.blocks))


def _table(blocks: np.ndarray, device: torch.device) -> torch.Tensor:
    """``blocks`` as an int64 tensor on ``device`` (a copy: later writes to ``blocks`` do not reach it), no host
    sync."""
    return to_device(torch.from_numpy(blocks.copy()), device)


@dataclass(frozen=True)
class ChunkInfo:
    """A compiled chunk without its KV (what the KV pool keeps beside a resident chunk's blocks): its content
    address ``cache_id`` (model fingerprint, token ids, compile options), and ``token_ids``, ``[L]`` int64 on CPU,
    the tokens it contributes to a linked prompt (its BOS when compiled with one; not LegoLink-0's extra BOS)."""

    cache_id: str
    token_ids: torch.Tensor
    options: CompileOptions

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]


@dataclass(frozen=True)
class ChunkKV:
    """What ``compile`` produces and ``link`` consumes, independent of blocks and positions: ``ChunkInfo``'s
    fields and ``k`` (before RoPE), ``v``: ``[num_layers, L, num_kv_heads, head_dim]`` in the model dtype."""

    cache_id: str
    token_ids: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    options: CompileOptions

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    @property
    def info(self) -> ChunkInfo:
        return ChunkInfo(cache_id=self.cache_id, token_ids=self.token_ids, options=self.options)

    @property
    def num_bytes(self) -> int:
        """Bytes of K and V together (what a store tier's capacity counts)."""
        return 2 * self.k.numel() * self.k.element_size()

    def to(self, device: torch.device | str, *, pin: bool = False, non_blocking: bool = False) -> ChunkKV:
        """This chunk with K and V on ``device`` (itself when already there). ``pin``: on the CPU, in page-locked
        memory (with CUDA only), so later copies to a GPU can be asynchronous. ``non_blocking``: an asynchronous
        copy to a GPU; from page-locked memory it may still run when this returns, so K and V must not be written
        until the stream has run it (store chunks never are; freeing them is safe, see ``pic.kv.transfer``).
        A copy to the CPU is synchronous: the data can be read, and the GPU source reused, at once."""
        device = torch.device(device)
        pin = pin and torch.cuda.is_available()
        here = self.k.device
        if here.type == device.type and device.index in (None, here.index) and (not pin or self.k.is_pinned()):
            return self
        if device.type == "cpu":
            k, v = (torch.empty(t.shape, dtype=t.dtype, pin_memory=pin).copy_(t) for t in (self.k, self.v))
        else:
            k, v = (t.to(device, non_blocking=non_blocking) for t in (self.k, self.v))
        return dataclasses.replace(self, k=k, v=v)
