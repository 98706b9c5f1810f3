"""Which slots each query row of a group reads: the written slots, masks by position and window, and query tiles.

Shared by the torch backend's plan (``pic.attention.torch_backend``): none of it reads K or V, only slot
positions (``-1``: unwritten) and query positions.
"""

from __future__ import annotations

import torch

# Query rows per tile, so the [rows, num_slots] mask and scores stay bounded on long prompts.
MAX_TILE_ELEMENTS = 1 << 24
# A recompute pass's tile ends where its last row's keys end; rows whose key ends lie further apart than
# this many slots go to separate tiles (each tile attends only its keys' prefix: causal work is skipped).
TILE_SLOT_SPREAD = 256


def written_slots(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv`` ``[b, S_table]``: slot positions (``-1``: unwritten). Returns the written slots' table indices
    in slot order, ``[b, S]`` (``S``: the most any sequence wrote; a shorter sequence repeats its first
    written slot), and their positions ``[b, S]`` (``-1`` for the repeats)."""
    written = kv >= 0
    counts = written.sum(1)  # [b]
    num = int(counts.max())
    order = torch.argsort((~written).to(torch.int8), dim=1, stable=True)[:, :num]  # written slots first
    valid = torch.arange(num, device=kv.device) < counts[:, None]  # [b, S]
    table_slots = torch.where(valid, order, order[:, :1])
    return table_slots, kv.gather(1, table_slots).masked_fill(~valid, -1)


def causal_masks(
    kv: torch.Tensor, q: torch.Tensor, windows: set[int | None], *, causal: bool
) -> dict[int | None, torch.Tensor | None]:
    """Per window, ``[b, n, S]`` bool, True where a query (positions ``q`` ``[b, n]``) may attend a slot
    (positions ``kv`` ``[b, S]``, ``-1``: none): exact causality by position, within the window. ``None`` for
    no window in a ``causal`` run (``TorchGroup.causal``), which needs no mask."""
    masks: dict[int | None, torch.Tensor | None] = {None: None} if causal and None in windows else {}
    if windows - masks.keys():
        allowed = (kv[:, None, :] >= 0) & (kv[:, None, :] <= q[:, :, None])  # [b, n, S]
        for w in windows - masks.keys():
            masks[w] = allowed if w is None else allowed & (kv[:, None, :] > q[:, :, None] - w)
    return masks


def is_causal_run(kv: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether a pass's query positions ``q`` ``[n]`` are its slots' positions ``kv`` ``[S]``, strictly
    increasing: then query row ``i`` may attend exactly slots ``0..i`` (``is_causal``)."""
    return kv.shape == q.shape and bool((kv == q).all()) and bool((q[1:] > q[:-1]).all())


def query_tiles(kv: torch.Tensor, q: torch.Tensor, num_heads: int) -> tuple[tuple[slice, int], ...]:
    """Tiles of a recompute pass's query rows: consecutive rows whose last attended slots lie within
    ``TILE_SLOT_SPREAD`` of the tile's first row's, at most ``MAX_TILE_ELEMENTS`` scores each. A tile
    attends the slots up to the last one any of its rows attends: a chunk head under MEPIC or LegoLink
    attends only the prompt before it, and a full recompute skips most of the causal upper triangle.

    Args:
        kv: ``[S]`` int64, the positions of the slots read (``-1``: none).
        q: ``[n]`` int64, the query rows' positions.
    """
    ends = last_slots(kv, q).tolist()  # [n]: 1 + the last slot each row attends (0: none)
    tiles, start, first, end = [], 0, ends[0], ends[0]
    for row in range(1, len(ends)):
        grown = max(end, ends[row])
        if ends[row] - first > TILE_SLOT_SPREAD or (row - start + 1) * grown * num_heads > MAX_TILE_ELEMENTS:
            tiles.append((slice(start, row), max(end, 1)))
            start, first, grown = row, ends[row], ends[row]
        end = grown
    tiles.append((slice(start, len(ends)), max(end, 1)))
    return tuple(tiles)


def last_slots(kv: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``[n]``: 1 + the last slot (of ``kv`` ``[S]``, slot positions, ``-1``: none) whose position is at or
    before each query position ``q`` ``[n]``, 0 where none is: the end of each row's causal mask, found in
    O(S + n) memory (the slot of each position, then a running maximum over positions), not from ``[n, S]``."""
    written = kv >= 0
    size = int(max(kv.max(), q.max())) + 1
    slot_of = torch.full((size,), -1, dtype=torch.int64, device=kv.device)  # position -> its last slot
    slot_ids = torch.arange(kv.shape[0], device=kv.device)
    slot_of.scatter_reduce_(0, kv[written], slot_ids[written], reduce="amax")
    return slot_of.cummax(0).values[q] + 1
