from __future__ import annotations

import pytest
import torch

import pic
from pic.kv import KVPool, RequestKV


def pool(num_blocks: int = 4, block_size: int = 4) -> KVPool:
    return KVPool(
        num_layers=2,
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=1,
        head_dim=2,
        dtype=torch.float32,
        device="cpu",
    )


def test_allocate_and_free():
    p = pool()
    a = p.allocate(3)
    assert len(set(a)) == 3 and p.num_free_blocks == 1 and p.can_allocate(1) and not p.can_allocate(2)
    with pytest.raises(pic.KVPoolExhaustedError, match="need 2 blocks of 4 tokens, 1 of 4 free"):
        p.allocate(2)
    assert p.num_free_blocks == 1
    p.free(a)
    assert p.num_free_blocks == 4


def test_request_slots_map_to_its_blocks():
    p = pool()
    req = RequestKV(p, 5)  # two blocks
    assert len(req.blocks) == 2 and req.kv_positions.tolist() == [-1] * 8
    rows = req.physical(torch.arange(8))
    assert rows.tolist() == [b * 4 + i for b in req.blocks for i in range(4)]
    p.k_rows[1, rows[5]] = 7.0  # the flat row view and the block view share memory
    assert p.k[1, req.blocks[1], 1, 0].tolist() == [7.0, 7.0]
    assert [req.append_slot() for _ in range(4)] == [5, 6, 7, 8]  # slot 8 opens a third block
    assert len(req.blocks) == 3 and req.kv_positions.shape == (12,) and req.block_table.tolist() == req.blocks
    req.release()
    req.release()
    assert p.num_free_blocks == 4
