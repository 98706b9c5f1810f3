"""A compiled chunk: its tokens and its per-layer NoPE K and V."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pic.config import CompileOptions


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
