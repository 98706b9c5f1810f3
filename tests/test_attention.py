"""The fused-RoPE paged reference attention equals transformers' attention on pre-rotated K."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from pic.attention import AttentionShape, RopeTable, TorchBackend, make_batch
from pic.attention.torch_backend import attention_weights
from tests.attention_cases import make_case

HQ, HKV, D, BS = 8, 2, 16, 4
WIDE = 10**6  # a sliding window wider than any context here: the same attention, through a mask


def hf_attention(q, k, v, *, window: int | None):
    """transformers' eager attention over contiguous, already-rotated q/k: [T, H, D] each."""
    t = q.shape[0]
    i = torch.arange(t)
    allowed = i[None, :] <= i[:, None]
    if window is not None:
        allowed &= i[None, :] > i[:, None] - window
    mask = torch.zeros(t, t).masked_fill(~allowed, float("-inf"))[None, None]
    module = types.SimpleNamespace(num_key_value_groups=HQ // HKV, training=False)
    out, _ = eager_attention_forward(
        module, q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, scaling=D**-0.5
    )
    return out[0]  # [T, HQ, D]


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("rope_type", ["default", "yarn", "dynamic"])
def test_batched_paged_fused_rope_equals_hf(window, rope_type):
    """One plan over four sequences (a full prompt, a recompute subset, two decode tokens), each in its own
    shuffled blocks with front padding and garbage elsewhere, equals transformers on each sequence."""
    torch.manual_seed(0)
    params = {"rope_type": rope_type, "rope_theta": 10000.0}
    if rope_type != "default":
        params |= {"factor": 4.0, "original_max_position_embeddings": 16}
    rotary = LlamaRotaryEmbedding(
        LlamaConfig(hidden_size=HQ * D, num_attention_heads=HQ, max_position_embeddings=64, rope_parameters=params)
    )
    rope = RopeTable(rotary, max_positions=64, dtype=torch.float32, device=torch.device("cpu"))
    assert rope.is_dynamic == (rope_type == "dynamic")
    num_blocks = 40
    k_cache, v_cache = torch.randn(num_blocks, BS, HKV, D), torch.randn(num_blocks, BS, HKV, D)
    k_cache[7], v_cache[7] = float("nan"), float("nan")  # a stale block: never read
    free = [b for b in torch.randperm(num_blocks).tolist() if b != 7]
    cases = [
        (23, torch.arange(23)),
        (19, torch.tensor([0, 7, 8, 18])),
        (30, torch.tensor([29])),
        (5, torch.tensor([4])),
    ]
    tables, kv_positions, queries, expected = [], [], [], []
    for t, query in cases:
        q, k, v = torch.randn(t, HQ, D), torch.randn(t, HKV, D), torch.randn(t, HKV, D)
        cos, sin = rotary(torch.empty(0), torch.arange(t)[None])
        q_rot, k_rot = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        expected.append(hf_attention(q_rot[0].transpose(0, 1), k_rot[0].transpose(0, 1), v, window=window)[query])
        table = torch.tensor([free.pop() for _ in range(-(-(t + 3) // BS) + 1)])  # + an unwritten block
        slots = torch.arange(t) + 3
        rows = table[slots // BS] * BS + slots % BS
        k_cache.view(-1, HKV, D)[rows], v_cache.view(-1, HKV, D)[rows] = k, v
        positions = torch.full((table.shape[0] * BS,), -1)
        positions[slots] = torch.arange(t)
        tables.append(table)
        kv_positions.append(positions)
        queries.append((q[query], query))
    batch = make_batch(
        block_tables=tables,
        kv_positions=kv_positions,
        q_positions=torch.cat([p for _, p in queries]),
        seq_lens=[p.shape[0] for _, p in queries],
        rope=rope,
    )
    assert batch.decode_seqs.tolist() == [2, 3] and batch.prefill_seqs == [0, 1]
    backend = TorchBackend(AttentionShape(HQ, HKV, D, torch.float32, (window,)))
    q = torch.cat([q for q, _ in queries])
    plan = backend.plan(batch)
    assert plan.prefill[0].causal and not plan.prefill[1].causal  # the whole prompt takes SDPA's is_causal
    assert (plan.prefill[0].masks[window] is None) == (window is None)
    out = backend.attend(q, k_cache, v_cache, plan, scaling=D**-0.5, sliding_window=window)
    for b, want in enumerate(expected):
        assert (out[batch.query_rows(b)] - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("shuffled", [False, True])
@pytest.mark.parametrize("window", [None, 6])
def test_attention_weights_are_the_ones_paged_attention_uses(window, shuffled):
    """``attention_weights`` (read by the attention-sink measurement) is the softmax the reference backend
    applies: each row sums to 1, unwritten and masked slots get nothing, and weights times V is the output
    (also for a whole prompt in slot order, which attends with ``is_causal`` and no mask)."""
    case = make_case(seqs=[(21, "all"), (9, "decode"), (17, "subset")], num_q_heads=6, num_kv_heads=2, head_dim=8,
                     page=4, shuffled=shuffled).cast(torch.float32)  # fmt: skip
    batch, backend = case.batch, TorchBackend(case.shape(window))
    plan = backend.plan(batch)
    out = backend.attend(case.q, case.k_cache, case.v_cache, plan, scaling=case.scaling, sliding_window=window)
    for seq in batch.prefill_seqs:
        weights = attention_weights(case.q, case.k_cache, batch, seq, scaling=case.scaling, sliding_window=window)
        assert torch.allclose(weights.sum(-1), torch.ones(()), atol=1e-5)
        assert (weights[..., batch.kv_positions[seq] < 0] == 0).all()
        group = plan.prefill[seq]  # its mask is over the slots it reads: spread it over the table's slots
        assert group.causal == (seq == 0 and not shuffled)
        kv, q = batch.kv_positions[seq], batch.q_positions[batch.query_rows(seq)]
        allowed = (kv[None] >= 0) & (kv[None] <= q[:, None])  # [n, S_table]
        if window is not None:
            allowed &= kv[None] > q[:, None] - window
        if group.masks[window] is not None:
            mask = torch.zeros(weights.shape[1:], dtype=torch.bool).index_copy_(
                -1, group.table_slots[0], group.masks[window][0]
            )
            assert torch.equal(mask, allowed)
        mask = allowed
        assert (weights.masked_fill(mask, 0) == 0).all()  # masked slots: no weight
        v = case.v_cache[batch.block_tables[seq]].flatten(0, 1).nan_to_num()  # [S, Hkv, D]; NaN where never read
        v = v.repeat_interleave(3, dim=1).transpose(0, 1)  # [Hq, S, D]
        assert torch.allclose((weights @ v).transpose(0, 1), out[batch.query_rows(seq)], atol=1e-5)


@pytest.mark.parametrize("shuffled", [False, True])
def test_query_tiles_skip_only_slots_no_row_attends(shuffled, monkeypatch):
    """A recompute pass attends in tiles, each over the slots before its last attended one: small tiles
    (many, skipping most slots when positions are in slot order) give the output of one tile of all. A window wider
    than the context makes a mask (and tiles) even for the prompt in slot order, which without one takes SDPA's
    ``is_causal`` in a single call."""
    import pic.attention.tiles as tiles

    case = make_case(seqs=[(37, "all"), (6, "decode"), (29, "subset")], num_q_heads=4, num_kv_heads=2, head_dim=8,
                     page=4, shuffled=shuffled).cast(torch.float32)  # fmt: skip
    outputs = {}
    for spread, elements in ((10**9, 10**9), (2, 64)):
        monkeypatch.setattr(tiles, "TILE_SLOT_SPREAD", spread)
        monkeypatch.setattr(tiles, "MAX_TILE_ELEMENTS", elements)
        backend = TorchBackend(case.shape(WIDE))
        plan = backend.plan(case.batch)
        assert plan.prefill[0].causal == (not shuffled)
        out = backend.attend(case.q, case.k_cache, case.v_cache, plan, scaling=case.scaling, sliding_window=WIDE)
        outputs[spread] = (out, plan.prefill[0].tiles)
        if not shuffled:  # no window: the causal run is one call, not tiled
            assert len(TorchBackend(case.shape(None)).plan(case.batch).prefill[0].tiles) == 1
    (whole, one), (tiled, many) = outputs[10**9], outputs[2]
    num_slots = case.batch.kv_positions.shape[1]
    assert len(one) == 1 and len(many) > 8
    if not shuffled:  # positions in slot order: the first rows' tiles end long before the last slot
        assert many[0][1] < num_slots // 2
    assert torch.allclose(tiled, whole, atol=1e-6)


@pytest.mark.parametrize("window", [None, 6])
def test_bool_masks_of_large_groups_attend_as_additive_ones(window, monkeypatch):
    """Groups whose masks exceed ``_ADDITIVE_MAX_ENTRIES`` keep their bool masks (no additive copy held for the
    forward) and attend to the same output, in a batch of a pass, a subset pass and a decode."""
    import pic.attention.torch_backend as torch_backend

    case = make_case(seqs=[(37, "all"), (6, "decode"), (29, "subset")], num_q_heads=4, num_kv_heads=2, head_dim=8,
                     page=4, shuffled=True).cast(torch.float32)  # fmt: skip
    outputs = []
    for limit in (10**9, 0):
        monkeypatch.setattr(torch_backend, "_ADDITIVE_MAX_ENTRIES", limit)
        backend = TorchBackend(case.shape(window))
        plan = backend.plan(case.batch)
        assert all(
            bool(g.sdpa_masks) == (limit > 0)
            for g in plan.groups
            if any(plan_mask is not None for plan_mask in g.masks.values())
        )
        outputs.append(backend.attend(case.q, case.k_cache, case.v_cache, plan, scaling=case.scaling,
                                      sliding_window=window))  # fmt: skip
    assert torch.allclose(outputs[0], outputs[1], atol=1e-6)  # the same scores masked: float rounding only


def test_last_slots_are_where_each_causal_mask_row_ends():
    """``last_slots`` (the tiles' key ends, in O(S) memory) equals the last True of each row of the causal
    mask, for slots in any order, unwritten ones among them, and queries before or after every slot."""
    from pic.attention.tiles import last_slots

    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        num_slots = int(torch.randint(1, 60, (1,), generator=gen))
        kv = torch.randperm(num_slots + 10, generator=gen)[:num_slots]
        kv[torch.rand(num_slots, generator=gen) < 0.3] = -1
        q = torch.randint(0, int(kv.max()) + 5, (7,), generator=gen)
        causal = (kv[None] >= 0) & (kv[None] <= q[:, None])  # [n, S], as TorchBackend builds it
        assert torch.equal(last_slots(kv, q), (causal * torch.arange(1, num_slots + 1)).amax(-1))
