"""A decoding sequence's rotated K and its V, kept from one step to the next (the torch backend's decode).

The pool holds NoPE K so that a chunk's blocks serve every placement; attention rotates K at each slot's
position. A decoding sequence's slots keep their positions from step to step, so rotating all of them at every
step and layer repeats the same work: at 4K slots it was the largest cost of a decode step after the matrix
products. And its slots lie in blocks scattered over the pool (the chunks' shared blocks), so attention gathered
every slot's V at every step and layer too, then read K and V with the slot-major strides of the pool, which
SDPA reads more slowly than a head-major tensor (the figures: docs/cpu.md#what-changed).

``KeptKV`` keeps, per layer, the sequence's K gathered and rotated once and its V gathered once, head-major
(``[Hkv, capacity, D]``, as SDPA reads them), and each step adds only the slots written since. It is bit for bit
what the gather-and-rotate path computes (the same operations on the same rows), and costs one more copy of the
sequence's K and V (model dtype, with up to an eighth more room to grow) for as long as the request lives: it is
kept in the request's ``RequestKV.scratch``, freed with it.

It is valid while the sequence's slots before the new ones are the ones it kept, in the same order, holding
the same KV: ``advance`` checks the slots, and the backend drops it whenever the sequence runs a recompute pass
(which may rewrite KV in place).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from pic.attention.rope import rotate

# Room a layer's buffers grow by, past the slots they hold: an eighth, at least this many slots (a regrowth copies
# the whole buffer, so it happens every ``max(64, S / 8)`` steps).
_MIN_GROWTH = 64


class KeptKV:
    """Rotated K and V of one sequence, per layer, ``[Hkv, num_slots, D]`` over its written slots in slot order.

    Args:
        dtype: the kept copy's dtype; ``None``: the cache's (exact). int8 decode weights keep float16
            (``TorchBackend``'s ``decode_kv_dtype``): SDPA reads half the bytes.
    """

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        self.dtype = dtype
        self.slots: torch.Tensor | None = None  # [S] int64 rows of the flattened cache, this step's
        # k_cache.data_ptr() -> (k buffer, v buffer, rows filled): a layer's rows filled are slots that lead this
        # step's (advance checks it), so a layer that fell behind (a forward that failed midway) catches up.
        self._layers: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self._rot = torch.empty(0)  # [S, 2D] this step's rotary at the slots (``rotary_pair``)

    def advance(self, slots: torch.Tensor, k_rot: torch.Tensor) -> None:
        """Begin a step over ``slots`` ``[S]`` int64 (cache rows, slot order) with their rotary ``k_rot`` ``[S, 2D]``
        (``rotary_pair``). The slots it kept before must lead ``slots`` unchanged, or it starts over."""
        done = 0 if self.slots is None else self.slots.shape[0]
        if not done or done > slots.shape[0] or not torch.equal(slots[:done], self.slots):
            self._layers.clear()
        self.slots, self._rot = slots, k_rot

    def kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's rotated K and V of the layer whose NoPE K and V are ``k_cache, v_cache``
        ``[num_blocks, block_size, Hkv, D]``: ``[Hkv, S, D]`` each, views of the kept buffers (the slots they lack
        gathered, K rotated, into them: the new slot, or every slot for a layer not kept)."""
        assert self.slots is not None, "advance() first"
        total = self.slots.shape[0]
        k_buf, v_buf, filled = self._layers.get(k_cache.data_ptr(), (None, None, 0))
        if k_buf is None or k_buf.shape[1] < total:
            k_buf = _grown(k_buf, filled, total, k_cache, self.dtype)
            v_buf = _grown(v_buf, filled, total, v_cache, self.dtype)
        new = self.slots[filled:]
        k_new = k_cache.flatten(0, 1).index_select(0, new)  # [new, Hkv, D] NoPE
        k_rows, v_rows = k_buf[:, filled:total].transpose(0, 1), v_buf[:, filled:total].transpose(0, 1)
        if k_buf.dtype == k_cache.dtype:  # into the buffers, no copy after
            rotate(k_new, self._rot[filled:], out=k_rows)
            torch.index_select(v_cache.flatten(0, 1), 0, new, out=v_rows)
        else:  # kept in another dtype (int8 decode weights keep float16): cast as copied
            k_rows.copy_(rotate(k_new, self._rot[filled:]))
            v_rows.copy_(v_cache.flatten(0, 1).index_select(0, new))
        self._layers[k_cache.data_ptr()] = (k_buf, v_buf, total)
        return k_buf[:, :total], v_buf[:, :total]


def attend_kept(
    kept: Sequence[KeptKV],
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    scaling: float,
) -> torch.Tensor:
    """Decode over each sequence's kept K and V: one SDPA call per sequence on views of its buffers (padding the
    sequences to the longest would copy every sequence's K and V at every layer), so a sequence in a batch gets bit
    for bit what it gets alone.

    Args:
        kept: per decoding sequence, its ``KeptKV``, advanced to this step.
        q: ``[b, 1, Hq, D]``, the sequences' rotated queries.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``, this layer's NoPE K and V.
        mask: ``[b, 1, S]`` bool over the sequences' slots in slot order (a sliding window's), or ``None``.

    Returns:
        ``[b, 1, Hq, D]`` in ``q``'s dtype.
    """
    if len(kept) == 1:  # a lone sequence: its output as it is, no copy
        return _attend_one(kept[0], q[0, 0], k_cache, v_cache, None if mask is None else mask[0], scaling=scaling)[None]
    out = torch.empty_like(q)
    for i, state in enumerate(kept):
        seq_mask = None if mask is None else mask[i]
        out[i, 0] = _attend_one(state, q[i, 0], k_cache, v_cache, seq_mask, scaling=scaling)[0]
    return out


def _attend_one(
    state: KeptKV, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor | None, *, scaling
) -> torch.Tensor:
    """One sequence's ``q`` ``[Hq, D]`` over its kept K and V (``mask`` ``[1, S]`` or ``None``): ``[1, Hq, D]``."""
    num_q_heads, dim = q.shape
    k, v = state.kv(k_cache, v_cache)  # [Hkv, S, D] each
    grouped = q.reshape(1, k.shape[0], num_q_heads // k.shape[0], dim)  # [1, Hkv, Hq / Hkv, D]: heads as rows
    seq_mask = None if mask is None else mask[None, None, :, : k.shape[1]]  # [1, 1, 1, S]
    attended = F.scaled_dot_product_attention(grouped.to(k.dtype), k[None], v[None], attn_mask=seq_mask, scale=scaling)
    return attended.reshape(1, num_q_heads, dim).to(q.dtype)  # CUDA's SDPA lays it out [1, G, Hkv, D]


def _grown(
    buffer: torch.Tensor | None, filled: int, total: int, cache: torch.Tensor, dtype: torch.dtype | None
) -> torch.Tensor:
    """A ``[Hkv, capacity, D]`` buffer (``dtype``, or the cache's) for ``total`` slots holding ``buffer``'s first
    ``filled``."""
    _, _, num_kv_heads, head_dim = cache.shape
    grown = cache.new_empty(num_kv_heads, total + max(_MIN_GROWTH, total // 8), head_dim, dtype=dtype or cache.dtype)
    if filled:
        grown[:, :filled] = buffer[:, :filled]
    return grown
