"""The Redis tier against a real redis-server: sharing across processes, the wire format's defences,
an unreachable or restarted server, URL forms and namespacing."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import time

import msgpack
import pytest
import torch

import pic
from pic.config import CompileOptions
from pic.engine.core.kv_manager import KVManager
from pic.ids import chunk_id
from pic.kv import BlockPool, ChunkKV, KVCache
from pic.store import ChunkDescription, RedisTier, TieredStore
from pic.store.serde import Expected
from tests.conftest import make_engine
from tests.models import DOCS, QUERY, model, tokenizer
from tests.redis_server import PASSWORD
from tests.redis_server import redis_server as new_redis_server

SMALL_PARTS = 4096  # several parts per chunk, so part handling is exercised


# The tests that restart a Redis give the tier's breaker a short retry: after a failure, calls are refused that long.
RETRY_S = 0.3


def redis_engine(url: str, family: str = "stories260K", **store) -> pic.PIC:
    """An engine with a Redis tier below its KV pool, parts small enough that every chunk has several."""
    config = pic.StoreConfig(redis_url=url, part_bytes=SMALL_PARTS, **store)
    return pic.PIC(model(family), tokenizer(), store=config)


def redis_tier(engine: pic.PIC) -> RedisTier:
    """The engine's Redis tier (its lowest), taken while the engine is paused; tests use it while the
    engine is idle."""
    with engine.paused() as core:
        tier = core.store.tiers[-1]
    assert isinstance(tier, RedisTier)
    return tier


def generate(engine: pic.PIC, ids: list[str], policy: str = "legolink:16", *, from_redis: bool = False) -> list[int]:
    """Greedy tokens of the reversed chunks and the query; ``from_redis``: forget the pool's resident
    chunks first, so that every chunk is read from Redis and promoted into fresh blocks."""
    if from_redis:
        with engine.paused() as core:
            for cid in list(core.pool.chunks):
                core.pool.drop(cid)
    return engine.link(ids[::-1], QUERY, policy=policy).generate(max_new_tokens=16).token_ids


def test_round_trip_through_redis(redis_url):
    engine = redis_engine(redis_url)
    ids = engine.compile(list(DOCS))
    assert all(engine.store.lookup(i) == ("device", "redis") for i in ids)
    local = make_engine("stories260K")
    assert local.compile(list(DOCS)) == ids  # same content, same ids
    for policy in ("full", "legolink:16", "cacheblend:0.3"):
        assert generate(engine, ids, policy, from_redis=True) == generate(local, ids, policy)
    assert all(engine.store.lookup(i) == ("device", "redis") for i in ids)  # promoted into the pool
    redis_stats = engine.store.stats()[-1]
    assert redis_stats.name == "redis" and redis_stats.num_entries == 3 and redis_stats.hits >= 9
    assert redis_stats.num_bytes == sum(local.store.get(i).num_bytes for i in ids)


def test_describe_reads_metadata_not_kv(redis_server, redis_url):
    """``describe`` of a chunk only Redis holds reads its metadata record, not its parts: the server sends
    a small fraction of the chunk's KV (counted by the server itself), where ``get`` sends all of it."""
    shape = dict(num_layers=4, num_kv_heads=4, head_dim=64, dtype=torch.float32)
    expected = Expected("describe-test", **shape, max_tokens=1024, vocab_size=1000)
    tokens, options = torch.arange(3, 3 + 256), CompileOptions(add_bos=False)
    k, v = (torch.randn(4, 256, 4, 64) for _ in range(2))
    chunk = ChunkKV(chunk_id(expected.fingerprint, tokens.tolist(), options), tokens, k, v, options)
    redis = RedisTier(redis_url, expected=expected, part_bytes=2**16)
    assert redis.put(chunk)
    pool = BlockPool(32, block_size=16)
    cache = KVCache(num_blocks=32, block_size=16, device="cpu", **shape)
    kv = KVManager(pool, cache, block_size=16, kv_bytes_per_token=0, store_over=lambda d: TieredStore(d, [redis]))
    store = kv.store
    client = redis_server.client()

    def bytes_sent(call):
        before = client.info("stats")["total_net_output_bytes"]
        result = call()
        return result, client.info("stats")["total_net_output_bytes"] - before

    described, sent = bytes_sent(lambda: store.describe(chunk.cache_id))
    assert described == ChunkDescription(
        chunk.cache_id, ("redis",), num_tokens=256, num_bytes=chunk.num_bytes, token_ids=tuple(chunk.token_ids.tolist())
    )
    assert chunk.num_bytes == 2**21 and sent < chunk.num_bytes / 200, sent  # metadata and the INFO reply only
    assert store.lookup(chunk.cache_id) == ("redis",)  # nothing was promoted
    got, sent = bytes_sent(lambda: store.get(chunk.cache_id))
    assert torch.equal(got.k, k) and sent > chunk.num_bytes  # the counter sees a download

    pool.free(store.promote(store.load(chunk.cache_id)))  # resident now, told from the pool's own record
    assert store.describe(chunk.cache_id) == dataclasses.replace(described, tiers=("device", "redis"))
    with pytest.raises(pic.UnknownCacheIdError, match="unknown cache id 'nope': in no tier \\(device, redis\\)"):
        store.describe("nope")


_WORKER = """
import json, sys, pic
engine = pic.load(store=pic.StoreConfig(redis_url=sys.argv[1], part_bytes=4096))
docs = json.loads(sys.argv[2])
ids = engine.compile(docs) if sys.argv[3] == "compile" else json.loads(sys.argv[3])
tiers = [engine.store.lookup(i) for i in ids]
out = engine.link(ids[::-1], sys.argv[4], policy="legolink:16").generate(max_new_tokens=24)
print(json.dumps({"ids": ids, "tokens": out.token_ids, "tiers": tiers}))
"""


def test_second_process_links_what_the_first_compiled(redis_url):
    """Acceptance 2: one process compiles into Redis, a fresh one links the same ids from it."""

    def worker(ids_or_compile: str) -> dict:
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        args = [sys.executable, "-c", _WORKER, redis_url, json.dumps(list(DOCS)), ids_or_compile, QUERY]
        proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.splitlines()[-1])

    first = worker("compile")
    assert all(t == ["device", "redis"] for t in first["tiers"])
    second = worker(json.dumps(first["ids"]))
    assert all(t == ["redis"] for t in second["tiers"])  # nothing resident in the new pool: read from Redis
    assert second["tokens"] == first["tokens"] and len(first["tokens"]) == 24


def _meta_key(redis_server, engine, cache_id):
    return f"pic:{engine.fingerprint}:{cache_id}:meta".encode()


def _edit_meta(**changes):
    def edit(client, meta_key):
        meta = msgpack.unpackb(client.get(meta_key))
        client.set(meta_key, msgpack.packb({**meta, **changes}))

    return edit


def _edit_part(index, change):
    def edit(client, meta_key):
        key = meta_key[: -len(b"meta")] + f"part:{index}".encode()
        client.set(key, change(client.get(key)))

    return edit


FAULTS = {
    "truncated part": _edit_part(1, lambda b: b[:-7]),
    "flipped payload byte": _edit_part(2, lambda b: b[:100] + bytes([b[100] ^ 0x01]) + b[101:]),
    "missing part": lambda client, key: client.delete(key[: -len(b"meta")] + b"part:0"),
    "metadata of another model": _edit_meta(fingerprint="0" * 32),
    "unknown format version": _edit_meta(format=99),
    "shape disagrees": _edit_meta(shape=[5, 3, 4, 8]),
    "tokens swapped": _edit_meta(token_ids=[1, 2, 3]),
    "garbage metadata": lambda client, key: client.set(key, b"\xc1\x00garbage" * 10),
    "huge array header": lambda client, key: client.set(key, b"\xdd\xff\xff\xff\xff"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_corrupt_entry_is_a_logged_miss_and_is_deleted(redis_server, redis_url, fault, caplog):
    writer = redis_engine(redis_url)
    ids = writer.compile(list(DOCS))
    local = make_engine("stories260K")
    assert local.compile(list(DOCS)) == ids
    expected = generate(local, ids)
    client = redis_server.client()
    FAULTS[fault](client, _meta_key(redis_server, writer, ids[1]))

    reader = redis_engine(redis_url)
    with caplog.at_level(logging.WARNING, logger="pic.store"):
        with pytest.raises(pic.UnknownCacheIdError, match=ids[1]):
            generate(reader, ids)
    assert f"dropping Redis entry {ids[1]}" in caplog.text
    assert client.keys(f"pic:*:{ids[1]}:*") == []  # meta and every part deleted
    assert reader.store.stats()[-1].errors == 1
    assert reader.compile(list(DOCS)) == ids  # recompiled into Redis, the others untouched
    assert generate(reader, ids) == expected


def test_hostile_entry_with_a_matching_cache_id_is_refused(redis_server, redis_url, caplog):
    """An entry forged to pass the cache-id check (token ids outside the vocabulary, hashed
    correctly) is still refused before anything is allocated from it."""
    engine = redis_engine(redis_url)
    (real,) = engine.compile(DOCS[2])
    client = redis_server.client()
    meta = msgpack.unpackb(client.get(_meta_key(redis_server, engine, real)))
    options = pic.CompileOptions(**meta["options"])
    tokens = [meta["token_ids"][0]] + [2**63 - 1] * (len(meta["token_ids"]) - 1)
    forged = chunk_id(engine.fingerprint, tokens[1:], options)
    prefix = f"pic:{engine.fingerprint}:"
    for i in range(meta["num_parts"]):
        client.set(f"{prefix}{forged}:part:{i}", client.get(f"{prefix}{real}:part:{i}"))
    client.set(f"{prefix}{forged}:meta", msgpack.packb({**meta, "cache_id": forged, "token_ids": tokens}))
    with caplog.at_level(logging.WARNING, logger="pic.store"):
        with pytest.raises(pic.UnknownCacheIdError, match=forged):
            engine.link([forged], QUERY)
    assert "outside the 512-token vocabulary" in caplog.text
    assert client.keys(f"*{forged}*") == [] and engine.store.lookup(real) == ("device", "redis")


def test_unreachable_redis_raises_naming_the_url(tmp_path, caplog):
    server = new_redis_server(tmp_path).start()
    engine = pic.PIC(model("stories260K"), tokenizer(), store=pic.StoreConfig(redis_url=server.url))
    ids = engine.compile(list(DOCS))
    expected = generate(engine, ids)
    server.stop()  # mid-run
    assert generate(engine, ids) == expected  # device hits touch Redis at most every shared_recheck_s
    fresh = redis_engine(server.url, tier_retry_s=RETRY_S)
    where = f"127.0.0.1:{server.port}"
    with pytest.raises(pic.StoreUnavailableError, match=f"Redis at redis://:\\*\\*\\*@{where}/0 failed") as info:
        generate(fresh, ids)
    assert PASSWORD not in str(info.value)
    with pytest.raises(pic.StoreUnavailableError, match=where):
        fresh.compile("A new story.")

    lenient = pic.PIC(
        model("stories260K"), tokenizer(), store=pic.StoreConfig(redis_url=server.url, on_redis_error="miss")
    )
    with pytest.raises(pic.UnknownCacheIdError, match=f"in no tier \\(device, redis\\); Redis at .*{where}"):
        generate(lenient, ids)
    with caplog.at_level(logging.WARNING, logger="pic.store"):
        assert lenient.compile(list(DOCS)) == ids  # Redis down: logged, the chunks live in the device tier
    assert "serving from the other tiers" in caplog.text
    assert generate(lenient, ids) == expected and lenient.store.lookup(ids[0]) == ("device",)

    server.start()  # restarted, empty (no persistence)
    time.sleep(RETRY_S)  # the breaker, open since the failures above, lets the next call try Redis again
    assert fresh.compile(list(DOCS)) == ids
    assert generate(fresh, ids) == expected
    server.stop()


def test_unix_socket_url_and_wrong_password(redis_server, redis_url):
    engine = redis_engine(redis_server.unix_url)
    ids = engine.compile(list(DOCS))
    local = make_engine("stories260K")
    assert local.compile(list(DOCS)) == ids
    assert generate(engine, ids, from_redis=True) == generate(local, ids)
    wrong = redis_server.url.replace("s3cret", "wrong")
    with pytest.raises(pic.StoreUnavailableError, match="AuthenticationError"):
        redis_engine(wrong).compile(list(DOCS))


def test_keys_are_namespaced_by_model(redis_server, redis_url):
    stories = redis_engine(redis_url)
    llama = redis_engine(redis_url, family="llama")
    other_namespace = redis_engine(redis_url, namespace="team-b")
    stories_ids, llama_ids = stories.compile(list(DOCS)), llama.compile(list(DOCS))
    assert redis_tier(stories).ids() == sorted(stories_ids)
    assert redis_tier(llama).ids() == sorted(llama_ids)
    assert redis_tier(other_namespace).ids() == []
    keys = {k.decode() for k in redis_server.client().keys("*:meta")}
    assert keys == {
        f"pic:{e.fingerprint}:{i}:meta" for e, ids in ((stories, stories_ids), (llama, llama_ids)) for i in ids
    }


def test_bad_store_config():
    with pytest.raises(pic.InvalidInputError, match="redis_url"):
        pic.PIC(model("stories260K"), tokenizer(), store=pic.StoreConfig(redis_url="http://x"))


def test_a_redis_outage_leaves_monitoring_describing_and_the_device_tier_working(tmp_path):
    """Issue 21, item 4: with Redis down (``on_redis_error="raise"``), ``/metrics`` reports the tier down
    and keeps working, a resident chunk is still described, and a failed expire changes nothing."""
    from fastapi.testclient import TestClient

    from pic.serve.app import build_app

    server = new_redis_server(tmp_path).start()
    store = pic.StoreConfig(redis_url=server.url, tier_retry_s=RETRY_S)
    engine = pic.PIC(model("stories260K"), tokenizer(), store=store)
    ids = engine.compile(list(DOCS))
    server.stop()
    tiers = {t.name: t for t in engine.store.stats()}  # no exception: monitoring needs it now
    assert tiers["redis"].up is False and tiers["device"].up and tiers["redis"].errors >= 1
    assert engine.store.describe(ids[0]).tiers == ("device",)
    with pytest.raises(pic.StoreUnavailableError):
        engine.store.expire(ids[0])
    with engine.paused() as core:
        assert core.pool.is_resident(ids[0])  # Redis goes first: nothing was removed
    with TestClient(build_app(engine, model_name="stories260K")) as http:
        text = http.get("/metrics").text
        assert 'pic_store_up{tier="redis"} 0.0' in text and 'pic_store_up{tier="device"} 1.0' in text
        assert http.get(f"/v1/chunks/{ids[0]}").json()["tiers"] == ["device"]
        assert http.delete(f"/v1/chunks/{ids[0]}").status_code == 503
    server.start()  # back (empty: no persistence)
    time.sleep(RETRY_S)  # until the breaker lets a call try Redis again
    assert engine.store.expire(ids[0]) and engine.store.lookup(ids[0]) == ()
    server.stop()


def test_compiling_again_restores_chunks_that_redis_lost(redis_server, redis_url):
    """Issue 21, item 5: after Redis loses its data (a restart without persistence), compiling the same
    documents writes the resident chunks back, so another worker can link them again."""
    engine = redis_engine(redis_url)
    ids = engine.compile(list(DOCS))
    redis_server.client().flushall()  # what a restart without persistence leaves
    assert engine.store.lookup(ids[0]) == ("device",)
    other = redis_engine(redis_url)
    with pytest.raises(pic.UnknownCacheIdError):
        generate(other, ids)
    assert engine.compile(list(DOCS)) == ids  # nothing to prefill; the lower tier gets its copy back
    assert all(engine.store.lookup(i) == ("device", "redis") for i in ids)
    local = make_engine("stories260K")
    assert generate(other, ids) == generate(local, local.compile(list(DOCS)))


def test_linking_a_resident_chunk_restores_what_redis_lost(tmp_path, monkeypatch, caplog):
    """Issue 21, item 5, on use: a link of a resident chunk checks Redis at most once per
    ``shared_recheck_s`` per chunk and writes back what it lost; a Redis that is down fails no link, is
    logged, and pauses the rechecks for a period."""
    clock = [1000.0]
    monkeypatch.setattr("pic.store.recheck.time.monotonic", lambda: clock[0])
    server = new_redis_server(tmp_path).start()
    url = server.url
    engine = redis_engine(url, shared_recheck_s=30, tier_retry_s=RETRY_S)
    ids = engine.compile(list(DOCS))
    expected = generate(engine, ids)  # compiled just now: nothing to check
    server.client().flushall()  # a restart without persistence
    assert generate(engine, ids) == expected and engine.store.lookup(ids[0]) == ("device",)  # checked < 30 s ago
    clock[0] += 31
    assert generate(engine, ids) == expected
    assert all(engine.store.lookup(i) == ("device", "redis") for i in ids)  # written back by the link
    assert generate(redis_engine(url), ids) == expected  # another worker links them

    server.stop()
    clock[0] += 31
    assert generate(engine, ids) == expected  # Redis down ("raise"): the link still serves from the pool
    assert "could not check that the shared tier holds chunk" in caplog.text
    server.start()  # back, empty
    time.sleep(RETRY_S)  # (the tier's breaker, open since the failure, lets a call through again)
    clock[0] += 29  # rechecks paused for 30 s after the failure
    assert generate(engine, ids) == expected and engine.store.lookup(ids[0]) == ("device",)
    clock[0] += 2
    assert generate(engine, ids) == expected and engine.store.lookup(ids[0]) == ("device", "redis")

    never = redis_engine(url, shared_recheck_s=None)
    never_ids = never.compile(["A chunk linked but never checked again."])
    server.client().flushall()
    clock[0] += 3600
    generate(never, never_ids)
    assert never.store.lookup(never_ids[0]) == ("device",)
    server.stop()


def test_a_key_of_another_type_is_a_damaged_entry_not_a_redis_down(redis_server, redis_url, caplog):
    """A hash where a chunk's metadata belongs (or a list where a part does) made every ``stats()`` fail with
    WRONGTYPE, and so ``/metrics`` report Redis down: it is skipped there, and a read of it is a logged miss that
    drops it, while the tier and its other entries go on."""
    from tests.test_disk import EXPECTED, make_chunk

    tier = RedisTier(redis_url, expected=EXPECTED, part_bytes=1000)
    good, bad_meta, bad_part = (make_chunk(i) for i in range(3))
    assert all(tier.put(c) for c in (good, bad_meta, bad_part))
    client = redis_server.client()
    client.delete(tier._key(bad_meta.cache_id))
    client.hset(tier._key(bad_meta.cache_id), "not", "metadata")
    client.delete(tier._key(bad_part.cache_id, 1))
    client.rpush(tier._key(bad_part.cache_id, 1), b"not a part")
    stats = tier.stats()
    assert stats.up and stats.writable and stats.num_entries == 2  # the hash skipped; the broken part's counted
    with caplog.at_level(logging.WARNING, logger="pic.store"):
        assert tier.get(bad_meta.cache_id) is None and tier.extent(bad_meta.cache_id) is None
        assert tier.get(bad_part.cache_id) is None
    dropped = [r.getMessage() for r in caplog.records if "dropping" in r.getMessage()]
    assert len(dropped) == 2 and all("of another type" in m for m in dropped), dropped
    assert not client.exists(tier._key(bad_meta.cache_id)) and not client.exists(tier._key(bad_part.cache_id, 1))
    assert tier.get(good.cache_id) is not None and tier.stats().num_entries == 1 and tier.last_error is None
