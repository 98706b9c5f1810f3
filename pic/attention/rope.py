"""Rotary embeddings applied inside attention, and the engine's cos/sin table.

The KV pool stores K *before* RoPE ("NoPE K"), so a cached chunk's K is the same wherever the chunk is
linked; attention rotates Q and K at each token's logical position, with the cos/sin tables the
model's own rotary module produced (every rope type transformers supports: default, linear, llama3,
yarn, dynamic, longrope ...). The arithmetic is transformers' ``apply_rotary_pos_emb`` (rotate-half layout).
"""

from __future__ import annotations

import torch
from torch import nn

# Rope types whose frequencies depend on the length of the sequence being run (transformers'
# ``dynamic_rope_update``): no table of fixed angles per position exists for them.
_DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` by per-token angles.

    Args:
        x: ``[..., num_tokens, num_heads, head_dim]``, any float dtype.
        cos, sin: ``[..., num_tokens, head_dim]``, same dtype as ``x``.

    Returns:
        ``x``'s shape and dtype.
    """
    return rotate(x, rotary_pair(cos, sin))


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``[s1, s2] -> [-s1, s2]`` over the last dim: ``rotate``'s sine, so that transformers' ``rotate_half(x) * sin``
    (``rotate_half([x1, x2]) = [-x2, x1]``) is ``[x2, x1] * signed_sin(sin)``: negation is exact, the same products
    bit for bit."""
    s1, s2 = sin.chunk(2, dim=-1)
    return torch.cat((-s1, s2), dim=-1)


def rotary_pair(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` cos and sin -> ``[..., 2 * D]``, ``[cos, signed_sin(sin)]``: what ``rotate`` multiplies by (a plan
    builds it once for every layer)."""
    return torch.cat((cos, signed_sin(sin)), dim=-1)


def rotate(x: torch.Tensor, pair: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin``, bit for bit, in four operations instead of five:
    ``[x2, x1] * signed_sin`` in place of ``rotate_half``'s negation, then ``+ x * cos`` in place.

    Three would do (``[x, x2, x1] * [cos, signed_sin]``, then the two halves summed: also bit for bit), but on the
    CPU the sum over a dimension of two ran slower than these four, in float32 and more so in bfloat16
    (docs/gpu.md#fewer-operations-a-layer-graphs-k-rotated-once-built-without-a-gpu); ``torch.addcmul`` fuses a
    multiply-add and so rounds once where transformers rounds twice.

    Args:
        x: ``[..., num_heads, head_dim]``.
        pair: ``[..., 2 * head_dim]`` (``rotary_pair``: ``[cos, signed_sin]``), broadcast over the heads.
        out: ``x``'s shape, any strides: written in place (a kept buffer's rows; no copy after), and returned.
    """
    dim = x.shape[-1]
    cos, sin_signed = pair[..., :dim].unsqueeze(-2), pair[..., dim:].unsqueeze(-2)
    x1, x2 = x.chunk(2, dim=-1)
    out = torch.cat((x2, x1), dim=-1, out=out).mul_(sin_signed)  # rotate_half(x) * sin
    return out.add_(x * cos)


class RopeTable:
    """cos and sin at logical positions, from the model's own rotary module (its rope type and
    attention scaling apply).

    For every rope type whose angle at a position is fixed, the table is built once, in float32, for
    every position up to the context, and a lookup is an index (cast to the model dtype, as
    transformers casts). Dynamic types (``"dynamic"`` NTK scaling, ``"longrope"``) rescale their
    frequencies by the length of the sequence being run, so there the module is called for each
    sequence with its query and slot positions together, exactly as transformers calls it for a
    prompt of that length (``is_dynamic``). Past the original context their K angles are those of the
    current length, not of the length when the token was written (transformers keeps the latter in its
    cache); below it the two agree.

    Args:
        rotary: the model's rotary module (``model.model.rotary_emb``).
        max_positions: positions ``0 .. max_positions - 1`` are looked up.
        dtype, device: the model's.
    """

    def __init__(self, rotary: nn.Module, *, max_positions: int, dtype: torch.dtype, device: torch.device) -> None:
        self.rotary, self.dtype, self.device = rotary, dtype, device
        self.is_dynamic = any(t in str(getattr(rotary, "rope_type", "")) for t in _DYNAMIC_ROPE_TYPES)
        self.cos = self.sin = None  # [max_positions, head_dim] float32, static rope types only
        like = torch.empty(0, dtype=torch.float32, device=device)
        with torch.no_grad():
            cos, sin = rotary(like, torch.arange(max_positions if not self.is_dynamic else 2, device=device)[None])
        if not self.is_dynamic:
            self.cos, self.sin = cos[0], sin[0]
        # Rotate-half tables repeat their frequencies over the two halves (transformers: cat(freqs, freqs));
        # the Triton kernel reads one half.
        self.head_dim = cos.shape[-1]
        half = self.head_dim // 2
        self.halves_equal = bool(
            torch.equal(cos[..., :half], cos[..., half:]) and torch.equal(sin[..., :half], sin[..., half:])
        )

    def tables(self, max_positions: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """float32 tables covering a batch, as attention kernels read them.

        Args:
            max_positions: per sequence, the largest position it attends with (query or slot).

        Returns:
            ``cos, sin`` ``[R, head_dim]`` float32 and ``offsets`` ``[B]`` int64: sequence ``b``'s angle at
            position ``p`` is row ``offsets[b] + p``. Static types: the engine's table, offsets all 0.
            Dynamic types: one table per sequence, built by calling the module over ``0 .. max`` (the
            length transformers scales by for a sequence whose largest position is ``max``).
        """
        if not self.is_dynamic:
            return self.cos, self.sin, torch.zeros(len(max_positions), dtype=torch.long, device=self.device)
        like = torch.empty(0, dtype=torch.float32, device=self.device)
        with torch.no_grad():
            parts = [self.rotary(like, torch.arange(m + 1, device=self.device)[None]) for m in max_positions]
        offsets = torch.tensor([0, *[m + 1 for m in max_positions[:-1]]], device=self.device).cumsum(0)
        return torch.cat([c[0] for c, _ in parts]), torch.cat([s[0] for _, s in parts]), offsets

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[*positions.shape, head_dim]`` in the model dtype at ``positions`` (int64). For a
        dynamic rope type, ``positions`` must be one sequence's (query and slot positions together)."""
        if self.is_dynamic:
            like = torch.empty(0, dtype=self.dtype, device=self.device)
            with torch.no_grad():
                cos, sin = self.rotary(like, positions.reshape(1, -1))
            return cos[0].view(*positions.shape, -1), sin[0].view(*positions.shape, -1)
        return self.cos[positions].to(self.dtype), self.sin[positions].to(self.dtype)
