"""The in-process tiers: LRU eviction by bytes, promotion, pinning, expiry, lookup and stats."""

from __future__ import annotations

import pytest
import torch

import pic
from tests.models import QUERY, model, tokenizer

NUM_TOKENS = 20  # every test chunk: BOS + 20 tokens, so all have the same size


def docs(first: int, count: int) -> list[list[int]]:
    return [[100 + first + i] + list(range(200, 200 + NUM_TOKENS - 1)) for i in range(first, first + count)]


def engine_with(device_chunks: float | None, cpu_chunks: float | None = 0) -> tuple[pic.PIC, int]:
    """An engine whose tiers hold ``device_chunks`` and ``cpu_chunks`` test chunks; and a chunk's bytes."""
    probe = pic.PIC(model("stories260K"), tokenizer())
    size = probe.store.get(probe.compile(docs(0, 1))[0]).num_bytes
    to_bytes = lambda n: None if n is None else int(n * size)  # noqa: E731
    store = pic.StoreConfig(device_bytes=to_bytes(device_chunks), cpu_bytes=to_bytes(cpu_chunks))
    return pic.PIC(model("stories260K"), tokenizer(), store=store), size


def compile_each(engine: pic.PIC, documents: list[list[int]]) -> list[str]:
    """Compile one document per call (a single call never evicts its own chunks)."""
    return [engine.compile([doc])[0] for doc in documents]


def where(engine: pic.PIC, ids: list[str]) -> list[list[str]]:
    return [engine.store.lookup(i) for i in ids]


def stats(engine: pic.PIC) -> dict[str, pic.store.TierStats]:
    return {s.name: s for s in engine.store.stats()}


def test_lru_eviction_by_bytes_and_promotion():
    engine, size = engine_with(device_chunks=2.5, cpu_chunks=4)
    ids = compile_each(engine, docs(0, 6))
    assert where(engine, ids) == [[], [], ["cpu"], ["cpu"], ["device", "cpu"], ["device", "cpu"]]
    device, cpu = stats(engine)["device"], stats(engine)["cpu"]
    assert (device.num_entries, device.num_bytes, device.evictions, device.capacity_bytes) == (
        2,
        2 * size,
        4,
        int(2.5 * size),
    )
    assert (cpu.num_entries, cpu.num_bytes, cpu.evictions) == (4, 4 * size, 2)
    with pytest.raises(pic.UnknownCacheIdError, match=f"{ids[0]}.*in no tier \\(device, cpu\\)"):
        engine.link(ids[:1], QUERY)

    reference = pic.PIC(model("stories260K"), tokenizer())
    reference.compile(docs(0, 6))
    linked = engine.link([ids[2], ids[5]], QUERY, policy="full")  # ids[2] comes up from the CPU tier
    assert (linked.logits - reference.link([ids[2], ids[5]], QUERY, policy="full").logits).abs().max() == 0
    assert where(engine, ids[2:]) == [["device", "cpu"], ["cpu"], ["cpu"], ["device", "cpu"]]  # ids[4] made room
    after = stats(engine)
    assert (after["device"].hits, after["device"].misses, after["cpu"].hits) == (1, 2, 1)  # + the failed link's miss
    assert after["device"].evictions == 5 and after["cpu"].evictions == 2

    engine.link([ids[5]], QUERY)  # a device hit makes ids[5] the most recently used
    (new,) = engine.compile(docs(6, 1))
    assert where(engine, [ids[2], ids[5], new]) == [["cpu"], ["device", "cpu"], ["device", "cpu"]]


def test_pinned_chunks_are_never_evicted():
    engine, _ = engine_with(device_chunks=2.5, cpu_chunks=3)
    (pinned,) = engine.compile(docs(0, 1))
    engine.store.pin(pinned)
    others = compile_each(engine, docs(1, 5))
    assert engine.store.lookup(pinned) == ["device", "cpu"]
    assert where(engine, others) == [[], [], [], ["cpu"], ["device", "cpu"]]
    assert stats(engine)["device"].evictions == 4 and stats(engine)["cpu"].evictions == 3

    (second,) = engine.compile(docs(6, 1))
    engine.store.pin(second)  # the device tier is now full of pinned chunks
    (third,) = engine.compile(docs(7, 1))
    assert engine.store.lookup(third) == ["cpu"]  # refused by the device tier, nothing pinned evicted
    assert engine.link([third, pinned], QUERY).num_recomputed > 0  # linked straight from the CPU tier
    assert engine.store.lookup(third) == ["cpu"] and engine.store.lookup(pinned) == ["device", "cpu"]

    engine.store.unpin(pinned)
    engine.store.unpin(second)
    compile_each(engine, docs(8, 2))
    assert engine.store.lookup(pinned) == []
    with pytest.raises(pic.UnknownCacheIdError, match="cannot pin unknown cache id 'nope'"):
        engine.store.pin("nope")


def test_pin_survives_promotion():
    engine, _ = engine_with(device_chunks=1.5, cpu_chunks=None)
    ids = compile_each(engine, docs(0, 3))
    assert where(engine, ids) == [["cpu"], ["cpu"], ["device", "cpu"]]
    engine.store.pin(ids[0])  # only in the CPU tier now
    engine.link(ids[:1], QUERY)  # promoted into the device tier, pinned there too
    compile_each(engine, docs(3, 2))
    assert engine.store.lookup(ids[0]) == ["device", "cpu"]


def test_expire_removes_everywhere():
    engine, _ = engine_with(device_chunks=None, cpu_chunks=None)
    ids = engine.compile(docs(0, 2))
    engine.store.pin(ids[0])
    assert engine.store.expire(ids[0]) is True
    assert engine.store.lookup(ids[0]) == [] and engine.store.expire(ids[0]) is False
    assert engine.store.ids() == sorted(ids[1:])
    with pytest.raises(pic.UnknownCacheIdError):
        engine.link(ids, QUERY)
    assert engine.compile(docs(0, 1)) == ids[:1]  # compiles again


def test_chunk_that_fits_nowhere():
    engine, size = engine_with(device_chunks=0.5)
    with pytest.raises(pic.StoreFullError, match=f"1 new chunks .*\\({size} bytes\\).*device 0 used of {size // 2}"):
        engine.compile(docs(0, 1))
    assert engine.store.ids() == []


def test_compile_keeps_every_id_it_returns():
    """A compile call never evicts its own chunks: one that cannot hold them all fails before any
    work, and the chunks of earlier calls are evicted (least recently used first) to make room."""
    engine, size = engine_with(device_chunks=3.5)
    old = compile_each(engine, docs(0, 2))
    with pytest.raises(pic.StoreFullError, match=f"the 4 new chunks of this compile call \\({4 * size} bytes\\)"):
        engine.compile(docs(2, 4))
    assert engine.store.ids() == sorted(old)  # nothing compiled, nothing evicted
    ids = engine.compile(docs(0, 1) + docs(2, 2))  # one cached, two new: 3 fit
    assert all(engine.store.contains(i) for i in ids) and not engine.store.contains(old[1])
    with pytest.raises(pic.StoreFullError, match="the 2 new chunks"):  # 3 held by this call + 2 new > 3.5
        engine.compile(docs(0, 1) + docs(2, 2) + docs(4, 2))
    assert engine.link(ids, QUERY).generate(max_new_tokens=2).token_ids


def test_compile_with_a_lower_tier_that_holds_everything():
    engine, _ = engine_with(device_chunks=1.5, cpu_chunks=None)
    ids = engine.compile(docs(0, 4))
    assert where(engine, ids) == [["device", "cpu"], ["cpu"], ["cpu"], ["cpu"]]  # the first call's chunk stays
    reference = pic.PIC(model("stories260K"), tokenizer())
    expected = reference.link(reference.compile(docs(0, 4)), QUERY).logits
    assert torch.equal(engine.link(ids, QUERY).logits, expected)


@pytest.mark.parametrize(
    "values, named",
    [
        ({"device_bytes": -1}, "device_bytes=-1"),
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
