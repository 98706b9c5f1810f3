"""A decoding sequence's K and V, kept (K rotated) between steps (``pic.attention.kept_kv``), give bit for bit what the
gather-and-rotate path gives, alone or in a batch, and are dropped or rebuilt whenever the slots they covered may have
changed."""

from __future__ import annotations

import pytest
import torch

from pic.attention import AttentionShape, TorchBackend, make_batch
from pic.attention.torch_backend import _KEPT_KV
from tests.attention_cases import rope_table

HQ, HKV, D, BS, LAYERS = 4, 2, 8, 4, 3


def _step(backend, rope, caches, table, positions, q_positions, scratch, window):
    """One forward of one sequence over every layer; outputs ``[LAYERS, n, HQ, D]``."""
    batch = make_batch(block_tables=[table], kv_positions=[positions], q_positions=q_positions,
                       seq_lens=[q_positions.shape[0]], rope=rope, scratch=scratch)  # fmt: skip
    plan = backend.plan(batch)
    q = torch.randn(q_positions.shape[0], HQ, D, generator=torch.Generator().manual_seed(int(q_positions[-1])))
    return torch.stack([backend.attend(q, k, v, plan, scaling=D**-0.5, sliding_window=window) for k, v in caches])


@pytest.mark.parametrize("window", [None, 6])
def test_kept_kv_is_the_gathered_and_rotated_kv_bit_for_bit(window):
    torch.manual_seed(0)
    rope = rope_table(D, 64, "default", "cpu")
    backend = TorchBackend(AttentionShape(HQ, HKV, D, torch.float32, (window,)))
    caches = [(torch.randn(20, BS, HKV, D), torch.randn(20, BS, HKV, D)) for _ in range(LAYERS)]
    table = torch.tensor([7, 2, 11, 5, 16, 3, 9, 14])
    positions = torch.full((table.shape[0] * BS,), -1)
    scratch: dict = {}
    prompt = torch.arange(10)
    positions[1:11] = prompt  # front padding of one slot
    _step(backend, rope, caches, table, positions, prompt, [scratch], window)  # the recompute pass: nothing kept
    assert _KEPT_KV not in scratch
    for slot in range(11, 25):  # decode: one more slot and position per step
        positions[slot] = slot - 1
        query = positions[slot : slot + 1]
        kept = _step(backend, rope, caches, table, positions, query, [scratch], window)
        assert torch.equal(kept, _step(backend, rope, caches, table, positions, query, [], window))
        assert scratch[_KEPT_KV].slots.shape[0] == slot  # every written slot, kept for the next step
    moved = table.clone()
    moved[1] = 19  # the table changed under it (a slot it covered now reads another block): it starts over
    positions[25] = 24
    query = positions[25:26]
    kept = _step(backend, rope, caches, moved, positions, query, [scratch], window)
    assert torch.equal(kept, _step(backend, rope, caches, moved, positions, query, [], window))
    positions[26] = 25  # a forward that failed after its first layer: the other layers fell behind
    batch = make_batch(block_tables=[moved], kv_positions=[positions], q_positions=positions[26:27], seq_lens=[1],
                       rope=rope, scratch=[scratch])  # fmt: skip
    backend.attend(torch.randn(1, HQ, D), *caches[0], backend.plan(batch), scaling=D**-0.5, sliding_window=window)
    positions[27] = 26
    query = positions[27:28]
    kept = _step(backend, rope, caches, moved, positions, query, [scratch], window)
    assert torch.equal(kept, _step(backend, rope, caches, moved, positions, query, [], window))
    recompute = torch.tensor([3, 26])  # a recompute pass drops it
    _step(backend, rope, caches, moved, positions, recompute, [scratch], window)
    assert _KEPT_KV not in scratch


def test_released_request_kv_drops_its_scratch():
    from pic.kv import KVCache, RequestKV

    cache = KVCache(num_layers=1, num_blocks=4, block_size=BS, num_kv_heads=HKV, head_dim=D,
                    dtype=torch.float32, device=torch.device("cpu"))  # fmt: skip
    kv = RequestKV(cache, [0], num_slots=2)
    kv.scratch["x"] = torch.zeros(3)
    assert kv.release().tolist() == [0] and kv.release().tolist() == []  # (its blocks, to free, once)
    assert kv.scratch == {}


@pytest.mark.parametrize("window", [None, 6])
def test_batched_decode_reads_each_sequences_kept_k(window, monkeypatch):
    """Sequences decoding together each keep their own K and V, and each attends over its own (no padding): bit for bit
    what each gets alone, gathering and rotating, through steps together and then one alone."""
    import pic.attention.torch_backend as torch_backend

    monkeypatch.setattr(torch_backend, "_KEEP_MIN_SLOTS", 8)  # batches of these short sequences keep K and V
    torch.manual_seed(1)
    rope = rope_table(D, 64, "default", "cpu")
    backend = TorchBackend(AttentionShape(HQ, HKV, D, torch.float32, (window,)))
    caches = [(torch.randn(24, BS, HKV, D), torch.randn(24, BS, HKV, D)) for _ in range(LAYERS)]
    tables = [torch.tensor([4, 9, 1, 17, 12, 20]), torch.tensor([6, 0, 15, 22, 3, 8])]
    positions = [torch.full((24,), -1), torch.full((24,), -1)]
    positions[0][:7], positions[1][2:14] = torch.arange(7), torch.arange(12)  # 7 and 12 tokens, the second padded
    scratch = [{}, {}]

    def step(seqs, kept):
        queries = torch.cat([positions[b][positions[b] >= 0].max()[None] for b in seqs])
        batch = make_batch(block_tables=[tables[b] for b in seqs], kv_positions=[positions[b] for b in seqs],
                           q_positions=queries, seq_lens=[1] * len(seqs), rope=rope,
                           scratch=[scratch[b] for b in seqs] if kept else [])  # fmt: skip
        plan = backend.plan(batch)
        q = torch.cat([torch.randn(1, HQ, D, generator=torch.Generator().manual_seed(int(p))) for p in queries])
        return torch.stack([backend.attend(q, k, v, plan, scaling=D**-0.5, sliding_window=window) for k, v in caches])

    for i in range(6):
        for b, end in ((0, 7 + i), (1, 14 + i)):
            positions[b][end] = int(positions[b].max()) + 1
        alone = torch.cat([step([0], kept=False), step([1], kept=False)], dim=1)  # [LAYERS, 2, HQ, D]
        together = step([0, 1], kept=True)
        assert torch.equal(together, alone), (together - alone).abs().amax(dim=(0, 2, 3))
    assert [s[_KEPT_KV].slots.shape[0] for s in scratch] == [13, 18]
    monkeypatch.setattr(torch_backend, "_KEEP_MIN_SLOTS", 64)  # too short now: batches gather and rotate
    positions[0][13], positions[1][20] = 13, 18
    assert torch.equal(step([0, 1], kept=True), step([0, 1], kept=False))
    assert [s[_KEPT_KV].slots.shape[0] for s in scratch] == [13, 18]  # not advanced
    positions[1][21] = 19
    assert torch.equal(step([1], kept=True), step([1], kept=False))  # the first finished: the second alone
    assert scratch[1][_KEPT_KV].slots.shape[0] == 20  # alone, it keeps K at any length


def test_a_float16_kept_kv_is_close_and_half_the_bytes():
    """int8 decode weights keep K and V in float16 (``decode_kv_dtype``): the kept buffers are float16, the
    outputs stay float32 and within float16's rounding of the exact path's."""
    torch.manual_seed(2)
    rope = rope_table(D, 64, "default", "cpu")
    shape = AttentionShape(HQ, HKV, D, torch.float32, (None,))
    exact, half = TorchBackend(shape), TorchBackend(shape, decode_kv_dtype=torch.float16)
    caches = [(torch.randn(20, BS, HKV, D), torch.randn(20, BS, HKV, D)) for _ in range(LAYERS)]
    table = torch.tensor([7, 2, 11, 5, 16, 3, 9, 14])
    positions = torch.full((table.shape[0] * BS,), -1)
    positions[:12] = torch.arange(12)
    scratch: dict = {}
    query = positions[11:12]
    got = _step(half, rope, caches, table, positions, query, [scratch], None)
    want = _step(exact, rope, caches, table, positions, query, [], None)
    assert got.dtype == torch.float32 and not torch.equal(got, want)
    assert torch.allclose(got, want, atol=5e-3, rtol=0)
    assert scratch[_KEPT_KV].dtype == torch.float16
    assert all(k.dtype == torch.float16 for k, _, _ in scratch[_KEPT_KV]._layers.values())
