"""A decoding sequence's rotated K, kept from one step to the next (the reference backend's decode).

The pool holds NoPE K so that a chunk's blocks serve every placement; attention rotates K at each slot's
position. A decoding sequence's slots keep their positions from step to step, so rotating all of them at every
step and layer repeats the same work: at 4K slots it was the largest cost of a decode step after the matrix
products. ``RotatedK`` keeps, per layer, the sequence's K gathered and rotated once, and each step rotates only
the slots written since. It is bit for bit what the gather-and-rotate path computes (the same operations on the
same rows), and costs one more copy of the sequence's K (model dtype) for as long as the request lives: it is
kept in the request's ``RequestKV.scratch``, freed with it.

It is valid while the sequence's slots before the new ones are the ones it rotated, in the same order, holding
the same KV: ``advance`` checks the slots, and the backend drops it whenever the sequence runs a recompute pass
(which may rewrite KV in place).
"""

from __future__ import annotations

import torch

from pic.attention.rope import rotate


class RotatedK:
    """Rotated K of one sequence, per layer, ``[num_slots, Hkv, D]`` over its written slots in slot order."""

    def __init__(self) -> None:
        self.slots: torch.Tensor | None = None  # [S] int64 rows of the flattened cache, this step's
        # k_cache.data_ptr() -> (buffer, rows filled): a layer's rows filled are slots that lead this step's
        # (advance checks it), so a layer that fell behind (a forward that failed midway) catches up.
        self._layers: dict[int, tuple[torch.Tensor, int]] = {}
        self._cos = self._sin = torch.empty(0)  # [S, D] this step's rotary at the slots

    def advance(self, slots: torch.Tensor, k_cos: torch.Tensor, k_sin: torch.Tensor) -> None:
        """Begin a step over ``slots`` ``[S]`` int64 (cache rows, slot order) with their rotary ``k_cos, k_sin``
        ``[S, D]`` (``k_sin``: ``signed_sin``). The slots it rotated before must lead ``slots`` unchanged, or it
        starts over."""
        done = 0 if self.slots is None else self.slots.shape[0]
        if not done or done > slots.shape[0] or not torch.equal(slots[:done], self.slots):
            self._layers.clear()
        self.slots, self._cos, self._sin = slots, k_cos, k_sin

    def keys(self, k_cache: torch.Tensor) -> torch.Tensor:
        """This step's rotated K of the layer whose NoPE K is ``k_cache`` ``[num_blocks, block_size, Hkv, D]``:
        ``[S, Hkv, D]``, a view of the kept buffer (the slots it lacks gathered and rotated into it: the new
        slot, or every slot for a layer not kept)."""
        assert self.slots is not None, "advance() first"
        total = self.slots.shape[0]
        buffer, filled = self._layers.get(k_cache.data_ptr(), (None, 0))
        if buffer is None or buffer.shape[0] < total:
            grown = k_cache.new_empty(max(2 * total, 64), *k_cache.shape[2:])
            if filled:
                grown[:filled] = buffer[:filled]
            buffer = grown
        rows = k_cache.flatten(0, 1).index_select(0, self.slots[filled:])  # [new, Hkv, D] NoPE
        buffer[filled:total] = rotate(rows, self._cos[filled:], self._sin[filled:])
        self._layers[k_cache.data_ptr()] = (buffer, total)
        return buffer[:total]
