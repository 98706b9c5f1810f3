"""Rotary embeddings applied inside attention.

The KV pool stores K *before* RoPE ("NoPE K"), so a cached chunk's K is the same wherever the chunk is
linked; attention rotates Q and K at each token's logical position, with the cos/sin tables the
model's own rotary module produced (every rope type transformers supports: default, linear, dynamic,
llama3, yarn, ...). The arithmetic is transformers' ``apply_rotary_pos_emb`` (rotate-half layout).
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dim (transformers' rotate-half convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` by per-token angles.

    Args:
        x: ``[num_tokens, num_heads, head_dim]``, any float dtype.
        cos, sin: ``[num_tokens, head_dim]``, same dtype as ``x``.

    Returns:
        ``[num_tokens, num_heads, head_dim]``, dtype of ``x``.
    """
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + rotate_half(x) * sin
