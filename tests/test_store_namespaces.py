"""Namespace-aware reads of every tier (issue 63): a reader names the namespaces it may read (``readable``: name ->
salt), and a chunk of any other namespace is answered exactly as an id nobody stored: no hit, no error, nothing
logged above DEBUG, nothing deleted. The shared tiers (a real redis-server, a real folder) verify the salt against
the entry's id; the in-process tiers (the pool, the CPU) compare the label. ``readable=None`` reads as before."""

from __future__ import annotations

import logging

import pytest
import torch

from pic.config import CompileOptions
from pic.engine.core.kv_manager import KVManager
from pic.errors import UnknownCacheIdError
from pic.ids import chunk_id
from pic.kv import BlockPool, ChunkKV, KVCache
from pic.store import DiskTier, LruTier, RedisTier, TieredStore
from tests.test_disk import EXPECTED, FINGERPRINT

SALT_A, SALT_B = b"tenant a's secret salt", b"tenant b's secret salt"
KEY = b"the fleet's store key, 32 bytes!"
SHAPE = dict(num_layers=EXPECTED.num_layers, num_kv_heads=EXPECTED.num_kv_heads, head_dim=EXPECTED.head_dim)


def chunk(seed: int, namespace: str = "", salt: bytes = b"") -> ChunkKV:
    """A chunk of namespace ``namespace`` (labelled so, its id hashing ``salt``), with a BOS (token 1)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.cat([torch.tensor([1]), torch.randint(3, 1000, (15,), generator=g)])
    options = CompileOptions(add_bos=True, namespace=namespace)
    shape = (EXPECTED.num_layers, 16, EXPECTED.num_kv_heads, EXPECTED.head_dim)
    k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    return ChunkKV(chunk_id(FINGERPRINT, tokens[1:].tolist(), options, salt=salt), tokens, k, v, options)


@pytest.fixture(params=["redis", "disk", "redis+key", "disk+key"])
def shared(request, tmp_path):
    """A shared tier (Redis or disk), with or without the fleet's store key."""
    key = KEY if request.param.endswith("+key") else None
    if request.param.startswith("redis"):
        return RedisTier(request.getfixturevalue("redis_url"), expected=EXPECTED, part_bytes=1000, store_key=key)
    return DiskTier(tmp_path, expected=EXPECTED, capacity_bytes=1 << 30, part_bytes=1000, store_key=key)


def test_a_shared_tier_serves_a_chunk_to_the_namespaces_whose_salt_reproduces_it(shared, caplog):
    mine, default = chunk(1, "tenant-a", SALT_A), chunk(2)
    assert shared.put(mine) and shared.put(default)
    # the writer's label, or another local name for the same salt (a fleet names its tenants as it likes)
    for name in ("tenant-a", "alice"):
        got = shared.get(mine.cache_id, readable={name: SALT_A})
        assert got is not None and got.options.namespace == name and torch.equal(got.k, mine.k)
        assert shared.extent(mine.cache_id, readable={"": b"", name: SALT_A}).namespace == name
    assert shared.get(default.cache_id, readable={"": b"", "tenant-a": SALT_A}).options.namespace == ""
    before = shared.stats()
    with caplog.at_level(logging.INFO):
        for readable in ({"": b""}, {"tenant-a": SALT_B}, {"tenant-b": SALT_B}, {"tenant-a": b""}):
            assert shared.get(mine.cache_id, readable=readable) is None
            assert shared.extent(mine.cache_id, readable=readable) is None
        assert shared.get(default.cache_id, readable={"tenant-a": SALT_A}) is None  # not the default's reader
    assert not caplog.records  # nothing above DEBUG: it may be another tenant's
    after = shared.stats()
    assert (after.hits, after.errors, after.misses - before.misses) == (before.hits, 0, 5)  # as ids nobody stored
    assert shared.contains(mine.cache_id) and shared.contains(default.cache_id)  # nothing dropped
    assert after.num_entries == 2  # every namespace's entry counted


def test_readable_none_reads_as_before(shared):
    """Every caller before tenants: the default namespace's chunks, and a label's unsalted ones; a salted
    namespace's entry is a plain miss, never dropped."""
    default, labelled, salted = chunk(1), chunk(2, "public"), chunk(3, "tenant-a", SALT_A)
    for c in (default, labelled, salted):
        assert shared.put(c)
    assert shared.get(default.cache_id).options.namespace == ""
    assert shared.get(labelled.cache_id).options.namespace == "public"
    assert shared.get(salted.cache_id) is None and shared.contains(salted.cache_id)
    assert shared.stats().errors == 0


def test_a_damaged_default_entry_is_dropped_whoever_reads_it(shared, caplog):
    """An entry labelled with the default namespace (which has no salt anywhere) whose tokens do not hash to its id
    is damaged, not another tenant's: dropped and logged, as before (keyless: with a key its MAC fails first)."""
    victim = chunk(1)
    assert shared.put(victim)
    tokens = victim.token_ids.clone()
    tokens[3] += 1
    forged = ChunkKV(victim.cache_id, tokens, victim.k, victim.v, victim.options)
    key, shared._store_key = shared._store_key, None  # written by a writer without the key
    assert shared.delete(victim.cache_id) and shared.put(forged)
    shared._store_key = key
    with caplog.at_level(logging.WARNING, logger="pic.store"):
        assert shared.get(victim.cache_id, readable={"tenant-a": SALT_A}) is None
    assert any("dropping" in r.getMessage() for r in caplog.records)
    assert not shared.contains(victim.cache_id) and shared.stats().errors == 1


def test_the_in_process_tiers_compare_the_label():
    cpu, mine = LruTier(), chunk(1, "tenant-a", SALT_A)
    assert cpu.put(mine)
    assert cpu.get(mine.cache_id, readable={"tenant-b": SALT_B}) is None
    assert cpu.extent(mine.cache_id, readable={"": b""}) is None
    assert cpu.get(mine.cache_id, readable={"tenant-a": SALT_A}) is mine
    assert cpu.extent(mine.cache_id, readable={"tenant-a": SALT_A}).namespace == "tenant-a"
    assert cpu.get(mine.cache_id) is mine and cpu.stats().misses == 1


def _store(lower) -> TieredStore:
    pool = BlockPool(32, block_size=16)
    cache = KVCache(num_blocks=32, block_size=16, device="cpu", dtype=torch.float32, **SHAPE)
    return KVManager(pool, cache, block_size=16, kv_bytes_per_token=0, store_over=lambda d: TieredStore(d, lower)).store


def test_the_store_answers_another_namespace_s_chunk_as_one_nobody_stored(shared):
    store = _store([LruTier(), shared])
    mine, other = chunk(1, "tenant-a", SALT_A), chunk(2, "tenant-b", SALT_B)
    store.write_lower(mine)
    store.write_lower(other)
    store.promote(store.load(other.cache_id, readable={"tenant-b": SALT_B}))  # resident in the pool too
    a, b = {"tenant-a": SALT_A}, {"tenant-b": SALT_B}
    never = chunk_id(FINGERPRINT, [5, 6, 7], CompileOptions(), salt=SALT_B)
    assert store.describe(mine.cache_id, readable=a).namespace == "tenant-a"
    assert store.describe(other.cache_id, readable=b).tiers == ("device", "cpu", store.lower[-1].name)
    for cid in (other.cache_id, never):  # another's chunk, in every tier, and an id nobody stored: one answer
        with pytest.raises(UnknownCacheIdError) as caught:
            store.describe(cid, readable=a)
        assert str(caught.value).replace(cid, "ID") == str(_unknown(store, never, a)).replace(never, "ID")
        assert store.get(cid, readable=a) is None and store.load(cid, readable=a) is None
        assert store.expire(cid, readable=a) is False
    assert store.lookup(other.cache_id) == ("device", "cpu", store.lower[-1].name)  # still everywhere
    assert store.get(other.cache_id, readable=b) is not None
    assert store.expire(other.cache_id, readable=b) is True and store.lookup(other.cache_id) == ()
    assert store.expire(mine.cache_id) is True  # readable=None: as before, whoever's it is


def _unknown(store: TieredStore, cid: str, readable) -> UnknownCacheIdError:
    try:
        store.describe(cid, readable=readable)
    except UnknownCacheIdError as exc:
        return exc
    raise AssertionError(f"{cid} is known")


def test_a_loaded_chunk_is_labelled_with_the_readers_name(shared):
    store = _store([LruTier(), shared])
    store.write_lower(chunk(1, "tenant-a", SALT_A))
    store.lower[0].delete(chunk(1, "tenant-a", SALT_A).cache_id)  # only the shared tier holds it
    loaded = store.load(chunk(1, "tenant-a", SALT_A).cache_id, readable={"alice": SALT_A})
    assert loaded.options.namespace == "alice"  # and so in the CPU tier it was promoted into
    assert store.lower[0].get(loaded.cache_id, readable={"alice": SALT_A}) is not None
    assert store.lower[0].get(loaded.cache_id, readable={"tenant-a": SALT_A}) is None


def test_an_unknown_id_is_echoed_cut_to_32_characters():
    store = _store([LruTier()])
    huge = "ab" * 2**20
    with pytest.raises(UnknownCacheIdError) as caught:
        store.describe(huge, readable={"": b""})
    message = str(caught.value)
    assert huge[:32] in message and huge[:33] not in message and f"({len(huge)} characters)" in message
    assert len(message) < 1000
