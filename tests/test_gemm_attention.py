"""bfloat16 passes on the CPU attend through bfloat16 products (``pic.attention.gemm``, issue 55): against SDPA and
float64 on random inputs, the tiles it plans, and Full Recompute in bfloat16 against transformers in bfloat16.

Tolerance: the products round the scores to bfloat16 (transformers' eager attention does too; SDPA keeps them in
float32), so on unit-normal q, k, v with 64-dim heads the output's error against float64 is about twice SDPA's:
measured 0.011-0.018 at most against SDPA's 0.005-0.007 (2K rows). Held to 0.03, eight bfloat16 steps of a unit
value; a slot read from the wrong row or a missed mask is off by more than 0.3 here.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from pic.attention import gemm
from pic.attention.gemm import gemm_attention, gemm_tiles, prefers_gemm
from pic.attention.tiles import causal_masks, query_tiles
from tests.conftest import make_target_engine
from tests.models import DOCS, QUERY, target_model

ERROR = 0.03


def _inputs(n: int, num_slots: int, heads: tuple[int, int], *, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    num_q, num_kv = heads
    q = torch.randn(1, n, num_q, 64, generator=gen).transpose(1, 2)  # [1, Hq, n, D], strided as a pass's are
    k, v = (torch.randn(1, num_kv, num_slots, 64, generator=gen) for _ in range(2))
    return q, k, v


def _reference(q, k, v, mask) -> torch.Tensor:
    """float64 SDPA with an explicit ``[n, S]`` mask."""
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True)


@pytest.mark.parametrize("heads", [(8, 2), (9, 3), (4, 4)])
def test_causal_pass_matches_float64(heads, monkeypatch):
    monkeypatch.setattr(gemm, "TILE_SCORES", 1 << 14)  # small tiles: many diagonal blocks in 300 rows
    q, k, v = _inputs(300, 300, heads)
    tiles = gemm_tiles(((slice(0, 300), 300),), None, num_heads=heads[0])
    assert len(tiles) > 4 and tiles[0].rows.start == 0 and tiles[-1].rows.stop == 300
    out = gemm_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), tiles, scaling=64**-0.5)
    truth = _reference(q, k, v, torch.ones(300, 300, dtype=torch.bool).tril())
    sdpa = F.scaled_dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), is_causal=True, enable_gqa=True)
    assert (out.double() - truth).abs().max().item() <= ERROR
    assert (sdpa.double() - truth).abs().max().item() <= ERROR


def test_masked_pass_matches_float64(monkeypatch):
    """A link's pass: its rows (a chunk at 200-330 and a query at 400-420) over slots with a gap, by position."""
    monkeypatch.setattr(gemm, "TILE_SCORES", 1 << 14)
    positions = torch.cat((torch.arange(0, 330), torch.arange(400, 421)))  # [S] slot positions
    rows = torch.cat((torch.arange(200, 330), torch.arange(400, 421)))  # [n] the pass's query positions
    q, k, v = _inputs(rows.shape[0], positions.shape[0], (8, 2), seed=1)
    mask = causal_masks(positions[None], rows[None], {None}, causal=False)[None][0]  # [n, S]
    tiles = gemm_tiles(query_tiles(positions, rows, 8), mask, num_heads=8)
    assert sum(t.rows.stop - t.rows.start for t in tiles) == rows.shape[0]
    for tile in tiles:  # every row attends the slots before ``open``; ``hidden`` is the rest of the mask
        assert bool(mask[tile.rows, : tile.open].all())
        assert torch.equal(tile.hidden, ~mask[tile.rows, tile.open : tile.end])
        assert not bool(mask[tile.rows, tile.end :].any())
    out = gemm_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), tiles, scaling=64**-0.5)
    assert (out.double() - _reference(q, k, v, mask)).abs().max().item() <= ERROR
    unmasked = tuple(replace(tile, open=tile.end) for tile in tiles)  # the mask left out: the check can fail
    wrong = gemm_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), unmasked, scaling=64**-0.5)
    assert (wrong.double() - _reference(q, k, v, mask)).abs().max().item() > 10 * ERROR


def test_only_bfloat16_passes_of_many_rows_on_the_cpu():
    cpu = torch.device("cpu")
    assert prefers_gemm(torch.bfloat16, cpu, gemm.MIN_ROWS)
    assert not prefers_gemm(torch.bfloat16, cpu, gemm.MIN_ROWS - 1)  # a decode step, a probe's query
    assert not prefers_gemm(torch.float32, cpu, 4096)  # float32's fused SDPA is as fast as its products
    assert not prefers_gemm(torch.bfloat16, torch.device("meta"), 4096)


@pytest.mark.parametrize("family", ["stories260K", "llama", "qwen2"])
def test_bfloat16_full_recompute_near_transformers_bfloat16(family, monkeypatch):
    """Full Recompute in bfloat16 (attending through the products) against transformers in bfloat16 and float32: pic's
    distance to transformers' float32 logits is at most twice transformers' own bfloat16 distance, plus 0.05
    (``tests/device.py``'s bfloat16 rule: measured 0.09-0.31 for pic, 0.09-0.34 for transformers)."""
    calls = []
    monkeypatch.setattr(gemm, "gemm_attention", lambda *a, **k: calls.append(1) or gemm_attention(*a, **k))
    monkeypatch.setattr("pic.attention.torch_backend.gemm_attention", gemm.gemm_attention)
    engine = make_target_engine(family, dtype=torch.bfloat16)
    linked = engine.link(engine.compile(list(DOCS)), QUERY, policy="full")
    assert calls, "the bfloat16 pass did not attend through the products"
    ids = linked.input_ids[None]
    num_query = linked.logits.shape[0]
    with torch.no_grad():
        truth = target_model(family, dtype=torch.float32)(ids).logits[0, -num_query:].float()
        own = target_model(family, dtype=torch.bfloat16)(ids).logits[0, -num_query:].float()
    hf_error = (own - truth).abs().max().item()
    assert (linked.logits - truth).abs().max().item() <= 0.05 + 2.0 * hf_error
    assert linked.generate(max_new_tokens=8).stats.num_generated_tokens >= 1
