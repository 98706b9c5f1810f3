"""The device tier (chunks resident in the KV pool) and the CPU tier: eviction, promotion, pinning,
expiry, lookup, stats; and sizing the pool."""

from __future__ import annotations

import pytest
import torch

import pic
import pic.kv.memory
from tests.models import QUERY, model, tokenizer

NUM_TOKENS = 20  # every test chunk: BOS + 20 tokens = 21 tokens, 2 blocks of 16
BLOCKS_PER_CHUNK = 2


def docs(first: int, count: int) -> list[list[int]]:
    return [[100 + first + i] + list(range(200, 200 + NUM_TOKENS - 1)) for i in range(first, first + count)]


def engine_with(pool_blocks: int, cpu_chunks: float | None = 0) -> pic.PIC:
    """An engine whose pool has ``pool_blocks`` blocks of 16 and whose CPU tier holds ``cpu_chunks`` chunks."""
    chunk_bytes = (NUM_TOKENS + 1) * pic.PIC(model("stories260K"), tokenizer()).spec.kv_bytes_per_token
    store = pic.StoreConfig(cpu_bytes=None if cpu_chunks is None else int(cpu_chunks * chunk_bytes))
    config = pic.PICConfig(kv_pool_tokens=16 * pool_blocks, block_size=16)
    return pic.PIC(model("stories260K"), tokenizer(), config=config, store=store)


def compile_each(engine: pic.PIC, documents: list[list[int]]) -> list[str]:
    """Compile one document per call (a single call never evicts its own chunks)."""
    return [engine.compile([doc])[0] for doc in documents]


def where(engine: pic.PIC, ids: list[str]) -> list[list[str]]:
    return [engine.store.lookup(i) for i in ids]


def stats(engine: pic.PIC) -> dict[str, pic.store.TierStats]:
    return {s.name: s for s in engine.store.stats()}


def reference_logits(ids_docs: list[list[int]], policy: str = "naive") -> torch.Tensor:
    reference = pic.PIC(model("stories260K"), tokenizer())
    return reference.link(reference.compile(ids_docs), QUERY, policy=policy).logits


def test_pool_evicts_least_recently_used_chunks_whole_and_the_cpu_tier_keeps_them():
    engine = engine_with(pool_blocks=6, cpu_chunks=None)
    ids = compile_each(engine, docs(0, 5))
    assert where(engine, ids) == [("cpu",), ("cpu",), ("device", "cpu"), ("device", "cpu"), ("device", "cpu")]
    device = stats(engine)["device"]
    with engine.paused() as core:
        block_bytes = core.cache.bytes_per_block
    assert (device.num_entries, device.num_bytes, device.evictions) == (3, 6 * block_bytes, 2)
    assert device.capacity_bytes == 6 * block_bytes
    kv = engine.kv_stats()
    assert (kv.num_resident_chunk_blocks, kv.num_available_blocks, kv.num_used_blocks) == (6, 6, 0)
    assert kv.num_evictable_blocks == 6 and kv.num_empty_blocks == 0

    # ids[0] comes up from the CPU tier into fresh blocks: the two least recently used chunks make room
    with engine.link(ids[:1], QUERY, policy="naive") as linked:
        assert torch.equal(linked.logits, reference_logits(docs(0, 1)))
        assert where(engine, ids[:1]) == [("device", "cpu")]
        assert where(engine, ids[2:4]) == [("cpu",), ("cpu",)] and engine.store.lookup(ids[4]) == ("device", "cpu")
        assert engine.kv_stats().num_used_blocks == BLOCKS_PER_CHUNK + 1  # the chunk (shared) and the query block
    after = stats(engine)
    assert (after["device"].hits, after["device"].misses, after["cpu"].hits) == (0, 1, 1)
    assert after["device"].evictions == 4 and engine.kv_stats().num_evicted_chunks == 4

    engine.link(ids[4:], QUERY).release()  # a link makes ids[4] the most recently used; ids[0] is now the oldest
    new = compile_each(engine, docs(5, 2))  # the first takes the 2 plain free blocks, the second evicts ids[0]
    assert where(engine, [ids[0], ids[4], *new]) == [("cpu",), *[("device", "cpu")] * 3]


def test_a_chunk_in_use_is_never_evicted():
    engine = engine_with(pool_blocks=6)
    ids = compile_each(engine, docs(0, 2))
    with engine.link(ids[:1], QUERY, policy="naive"):  # holds 2 chunk blocks + 1 query block
        with pytest.raises(pic.KVPoolExhaustedError, match="needs 4 blocks of 16 tokens but 3 of 6"):
            engine.compile(docs(2, 2))  # would need ids[0]'s blocks
        before = engine.kv_stats()
        (third,) = engine.compile(docs(2, 1))  # fits by evicting ids[1], not ids[0]
        assert where(engine, [ids[0], ids[1], third]) == [("device",), (), ("device",)]
        assert engine.kv_stats().num_evicted_chunks == before.num_evicted_chunks + 1


def test_pinned_chunks_are_never_evicted():
    engine = engine_with(pool_blocks=6, cpu_chunks=3)
    (pinned,) = engine.compile(docs(0, 1))
    engine.store.pin(pinned)
    others = compile_each(engine, docs(1, 4))
    assert engine.store.lookup(pinned) == ("device", "cpu")
    assert where(engine, others) == [(), (), ("device", "cpu"), ("device", "cpu")]
    assert engine.kv_stats().num_used_blocks == BLOCKS_PER_CHUNK  # pinned blocks are not free

    (second,) = engine.compile(docs(5, 1))
    engine.store.pin(second)
    engine.store.pin(others[-1])  # the pool is now full of pinned chunks
    with pytest.raises(pic.KVPoolExhaustedError, match="0 of 6 are available"):
        engine.compile(docs(6, 1))
    with pytest.raises(pic.KVPoolExhaustedError):
        engine.link([pinned], QUERY)  # even its query block has no room
    assert engine.store.lookup(pinned) == ("device", "cpu") and engine.kv_stats().num_used_blocks == 6

    for cid in (pinned, second, others[-1]):
        engine.store.unpin(cid)
    compile_each(engine, docs(7, 3))
    assert engine.store.lookup(pinned) == ()  # evicted from the pool and the CPU tier once unpinned


def test_pin_survives_promotion():
    engine = engine_with(pool_blocks=4, cpu_chunks=None)
    ids = compile_each(engine, docs(0, 3))
    assert where(engine, ids) == [("cpu",), ("device", "cpu"), ("device", "cpu")]
    engine.store.pin(ids[0])  # only in the CPU tier now
    engine.link(ids[:1], QUERY, policy="naive").release()  # promoted into the pool, pinned there too
    compile_each(engine, docs(3, 2))
    assert engine.store.lookup(ids[0]) == ("device", "cpu")


def test_expire_removes_everywhere_but_live_requests_keep_their_blocks():
    engine = engine_with(pool_blocks=64, cpu_chunks=None)
    ids = engine.compile(docs(0, 2))
    engine.store.pin(ids[0])
    linked = engine.link(ids, QUERY, policy="mepic")
    assert engine.store.expire(ids[0]) is True
    assert engine.store.lookup(ids[0]) == () and engine.store.expire(ids[0]) is False
    assert engine.store.ids() == sorted(ids[1:])
    with pytest.raises(pic.UnknownCacheIdError):
        engine.link(ids, QUERY)
    expected = reference_logits(docs(0, 2), "mepic")
    # still its blocks (chunks prefilled in one forward or two: equal to float32 rounding)
    assert torch.allclose(linked.logits, expected, atol=1e-4, rtol=0) and linked.generate(max_new_tokens=4).token_ids
    kv = engine.kv_stats()
    assert (kv.num_used_blocks, kv.num_private_blocks, kv.num_resident_chunk_blocks) == (0, 0, BLOCKS_PER_CHUNK)
    assert engine.compile(docs(0, 1)) == ids[:1]  # compiles again


def test_chunk_that_fits_nowhere():
    engine = engine_with(pool_blocks=1)
    with pytest.raises(
        pic.StoreFullError, match=r"this compile call \(1 new chunk\) needs 2 blocks .* the pool has 1 in all"
    ):
        engine.compile(docs(0, 1))
    assert engine.store.ids() == []


def test_compile_keeps_every_id_it_returns():
    """A compile call never evicts its own chunks: one that cannot hold them all fails before any
    work, and the chunks of earlier calls are evicted (least recently used first) to make room."""
    engine = engine_with(pool_blocks=7)
    old = compile_each(engine, docs(0, 2))
    with pytest.raises(pic.KVPoolExhaustedError, match=r"this compile call \(4 new chunks\) needs 8 blocks"):
        engine.compile(docs(2, 4))
    assert engine.store.ids() == sorted(old)  # nothing compiled, nothing evicted
    ids = engine.compile(docs(0, 1) + docs(2, 2))  # one cached, two new: 3 chunks fit
    assert all(engine.store.contains(i) for i in ids) and not engine.store.contains(old[1])
    # 3 held by this call + 2 new > 7 blocks
    with pytest.raises(pic.KVPoolExhaustedError, match=r"this compile call \(2 new chunks\)"):
        engine.compile(docs(0, 1) + docs(2, 2) + docs(4, 2))
    assert engine.link(ids, QUERY, policy="naive").generate(max_new_tokens=2).token_ids


def test_compile_with_a_lower_tier_that_holds_everything():
    """The pool only needs room for one chunk at a time when the CPU tier takes them all."""
    engine = engine_with(pool_blocks=3, cpu_chunks=None)
    ids = engine.compile(docs(0, 4))
    assert where(engine, ids) == [("cpu",), ("cpu",), ("cpu",), ("device", "cpu")]
    logits = engine.link(ids[:1], QUERY, policy="naive").logits
    assert torch.equal(logits, reference_logits(docs(0, 1)))


def test_pool_sizing(monkeypatch):
    sized = pic.kv.memory.pool_num_tokens
    assert sized(kv_pool_tokens=100, bytes_per_token=10, device=torch.device("cpu"), memory_fraction=0.5)[0] == 100
    monkeypatch.setattr(pic.kv.memory, "available_bytes", lambda device: 10 << 30)
    tokens, how = sized(kv_pool_tokens=None, bytes_per_token=1 << 10, device=torch.device("cuda"), memory_fraction=0.5)
    assert tokens == 5 << 20 and "0.5 of 10.0 GiB free on cuda" in how
    cpu_tokens, _ = sized(kv_pool_tokens=None, bytes_per_token=1 << 20, device=torch.device("cpu"), memory_fraction=1)
    assert cpu_tokens == min(pic.kv.memory.DEFAULT_CPU_POOL_TOKENS, (10 << 30) // 4 // (1 << 20))


@pytest.mark.parametrize(
    "values, named",
    [
        ({"redis_url": "http://localhost"}, "redis_url='http://localhost'"),
        ({"on_redis_error": "ignore"}, "on_redis_error='ignore'"),
        ({"namespace": "a b"}, "namespace='a b'"),
        ({"part_bytes": 0}, "part_bytes=0"),
        ({"cpu_gb": 1}, "cpu_gb"),
    ],
)
def test_bad_store_config(values, named):
    with pytest.raises(pic.InvalidInputError, match=named):
        pic.StoreConfig(**values)


def test_shared_rechecks_schedule(monkeypatch):
    """``SharedRechecks``: a chunk is due once per period, a write counts as a check, a failure pauses every
    check for a period, and the clocks of chunks no longer resident are dropped (they are due again)."""
    from pic.store.recheck import SharedRechecks

    clock = [0.0]
    monkeypatch.setattr("pic.store.recheck.time.monotonic", lambda: clock[0])
    rechecks = SharedRechecks(30.0)
    assert rechecks.is_due("a") and not rechecks.is_due("a")
    rechecks.written("b")
    assert not rechecks.is_due("b")
    clock[0] = 31.0
    assert rechecks.is_due("a") and rechecks.is_due("b")
    rechecks.failed()  # at 31: paused until 61
    clock[0] = 60.0
    assert not rechecks.is_due("c")
    clock[0] = 100.0
    ids = [f"id{i}" for i in range(100)]
    assert all(rechecks.is_due(i) for i in ids[:40])
    rechecks.forget(lambda cid: cid in ids[:10])  # 43 clocks, under the first bound (64): nothing dropped
    assert not rechecks.is_due(ids[20])
    assert all(rechecks.is_due(i) for i in ids[40:])
    rechecks.forget(lambda cid: cid in ids[:10])  # 103 clocks: those of chunks no longer resident go
    assert not rechecks.is_due(ids[0]) and rechecks.is_due(ids[20]) and rechecks.is_due(ids[50])
    assert not SharedRechecks(None).is_due("a") and SharedRechecks(0.0).is_due("a")


def test_compiling_resident_chunks_again_copies_none_out_of_the_pool_when_every_tier_holds_them(monkeypatch):
    """A compile of documents already resident asks the lower tiers which lack them first: the copy out of the
    pool (on the engine's thread) is made only for a tier that lost one."""
    engine = engine_with(pool_blocks=64, cpu_chunks=None)
    copies = []
    real = pic.store.TieredStore.copy_for_lower
    monkeypatch.setattr(pic.store.TieredStore, "copy_for_lower", lambda s, cid: copies.append(cid) or real(s, cid))
    ids = engine.compile(docs(0, 3))
    assert sorted(copies) == sorted(ids)  # written through once each
    copies.clear()
    assert engine.compile(docs(0, 3)) == ids and copies == []
    assert engine.store.lookup(ids[0]) == ("device", "cpu")
    with engine.paused() as core:
        assert core.store.lower[0].delete(ids[0])  # the CPU tier loses one
    assert engine.compile(docs(0, 3)) == ids and copies == [ids[0]]
    assert engine.store.lookup(ids[0]) == ("device", "cpu")
