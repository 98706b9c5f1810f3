"""A compiled chunk: what it is (``ChunkInfo``), and its tokens with their per-layer NoPE K and V (``ChunkKV``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from pic.config import CompileOptions


@dataclass(frozen=True)
class ChunkInfo:
    """A compiled chunk without its KV: what the KV pool keeps beside a resident chunk's blocks.

    Attributes:
        cache_id: content address (model fingerprint, token ids, compile options).
        token_ids: ``[L]`` int64 on CPU, the tokens the chunk contributes to a linked prompt.
        options: the compile options it was prefilled with.
    """

    cache_id: str
    token_ids: torch.Tensor
    options: CompileOptions

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]


@dataclass(frozen=True)
class ChunkKV:
    """What ``compile`` produces and ``link`` consumes, independent of blocks and positions.

    Attributes:
        cache_id: content address (model fingerprint, token ids, compile options).
        token_ids: ``[L]`` int64 on CPU, the tokens the chunk contributes to a linked prompt (its
            own BOS included when compiled with one; LegoLink-0's dropped extra BOS tokens not).
        k: ``[num_layers, L, num_kv_heads, head_dim]`` K before RoPE, model dtype.
        v: ``[num_layers, L, num_kv_heads, head_dim]``.
        options: the compile options it was prefilled with.
    """

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
        """This chunk with K and V on ``device`` (itself when already there).

        Args:
            pin: on the CPU, use page-locked memory, so later copies to a GPU can be asynchronous
                (ignored without CUDA, where there is no page-locked memory to ask for).
            non_blocking: asynchronous copy to a GPU. From page-locked memory the copy may still be
                running when this returns: this chunk's K and V must not be written until the stream has
                run it (store chunks never are; freeing them is safe, see ``pic.kv.transfer``).

        A copy to the CPU is always synchronous (``copy_`` without ``non_blocking`` waits for the stream):
        the data can be read, and the GPU source freed or overwritten, as soon as this returns.
        """
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
