"""The canonical layout: chunks front-padded to whole blocks, positions without gaps."""

from __future__ import annotations

import pytest
import torch

from pic.config import CompileOptions
from pic.kv import ChunkKV
from pic.link import SegmentKind, lay_out


def chunk(n: int, first: int = 10) -> ChunkKV:
    empty = torch.empty(0)
    return ChunkKV(f"c{n}", torch.arange(first, first + n), empty, empty, CompileOptions())


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("prefix_len", [0, 3])
def test_layout(block_size, prefix_len):
    chunks = [chunk(5), chunk(8, 100), chunk(1, 200)]
    layout = lay_out(prefix=list(range(prefix_len)), chunks=chunks, query=[7, 8, 9], block_size=block_size)
    kinds = [s.kind for s in layout.segments]
    assert kinds == [SegmentKind.PREFIX] * bool(prefix_len) + [SegmentKind.CHUNK] * 3 + [SegmentKind.QUERY]
    expected = [*range(prefix_len), *range(10, 15), *range(100, 108), 200, 7, 8, 9]
    assert layout.token_ids.tolist() == expected
    assert layout.positions.tolist() == list(range(len(expected)))  # padding takes no positions
    assert bool((layout.slots.diff() > 0).all())
    for seg in layout.segments:
        assert layout.slots[seg.tokens].tolist() == list(range(seg.slot_start, seg.slot_start + seg.num_tokens))
        if seg.kind is SegmentKind.QUERY:  # starts a block; generation appends after it
            assert seg.slot_start % block_size == 0 and seg.num_padding == 0
        else:  # front-padded to whole blocks: same block-relative slots in every request
            assert (seg.slot_start + seg.num_tokens) % block_size == 0
            assert (seg.slot_start - seg.num_padding) % block_size == 0 and seg.num_padding < block_size
    assert layout.cached.tolist() == [False] * prefix_len + [True] * 14 + [False] * 3
    assert layout.num_slots == layout.slots[-1].item() + 1
    assert [s.cache_id for s in layout.chunks] == ["c5", "c8", "c1"]
