"""Compile once across a fleet: workers sharing one real redis-server prefill each new chunk once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import redis

import pic
from tests.models import model, tokenizer

# 16 documents long enough that compiling them takes a while next to the workers' start skew.
DOCS = [" ".join(f"Story {i}: Tom and Lily played with ball number {j}." for j in range(12)) for i in range(16)]

WORKER = """
import json, sys
import pic
from tests.models import model, tokenizer
from tests.test_fleet import DOCS
engine = pic.PIC(model("stories260K"), tokenizer(), store=pic.StoreConfig(redis_url=sys.argv[1]))
print("ready", flush=True)
sys.stdin.readline()  # "go", to all four at once
ids = engine.compile(DOCS)
print(json.dumps(ids))
"""


def _engine(redis_url: str) -> pic.PIC:
    return pic.PIC(model("stories260K"), tokenizer(), store=pic.StoreConfig(redis_url=redis_url))


def test_four_workers_compile_sixteen_documents_sixteen_times(redis_url):
    """Four processes compile the same 16 documents at the same instant: 16 prefills in all, not 64."""
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, redis_url], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        for _ in range(4)
    ]
    assert [w.stdout.readline().strip() for w in workers] == ["ready"] * 4  # every model loaded
    for w in workers:
        w.stdin.write("go\n")
        w.stdin.flush()
    outputs = [json.loads(w.communicate(timeout=120)[0]) for w in workers]
    assert all(w.returncode == 0 for w in workers)
    assert all(ids == outputs[0] for ids in outputs) and len(set(outputs[0])) == 16
    stats = _engine(redis_url).store.fleet.stats()
    assert (stats.num_compiles, stats.num_duplicate_compiles) == (16, 0)


def _claims(engine: pic.PIC, monkeypatch) -> dict[str, list[bool]]:
    """Cache id -> whether each of ``engine``'s attempts to take its lease took it, in order (from now on)."""
    fleet, claims = engine.store.fleet, {}
    acquire = fleet._acquire

    def recorded(cache_id: str) -> bool:
        took = acquire(cache_id)
        claims.setdefault(cache_id, []).append(took)
        return took

    monkeypatch.setattr(fleet, "_acquire", recorded)
    return claims


def _assert_waited_out_the_leases_then_took_them(claims: dict[str, list[bool]], ids: list[str]) -> None:
    """What "delayed by at most the lease" means, by order: every chunk's first attempt found the dead worker's
    lease live (it waited), a later one took it (it expired: the dead worker's leases live no longer than theirs),
    and none was forced after the longest wait (``max_wait_s``, three of this worker's 10 s leases: a forced chunk
    is compiled without its lease being taken)."""
    assert set(claims) == set(ids)
    other = {cid: takes for cid, takes in claims.items() if takes[0] or takes[-1] is not True or sum(takes) != 1}
    assert not other, f"attempts to take the leases (took?): {other}"


def test_a_dead_workers_leases_delay_the_others_by_at_most_their_lease(redis_url, monkeypatch):
    """A worker that died mid-compile leaves its leases (never renewed) in Redis: another worker waits for
    them to expire, then compiles everything itself, once."""
    engine = _engine(redis_url)
    ids, lease_ms = _ids_of(engine, DOCS), 1500
    client = redis.Redis.from_url(redis_url)
    claims = _claims(engine, monkeypatch)
    for cache_id in ids:  # what a worker killed mid-compile leaves behind
        assert client.set(engine.store.fleet._lease(cache_id), "dead-worker", nx=True, px=lease_ms)
    start = time.monotonic()
    assert engine.compile(DOCS) == ids
    assert time.monotonic() - start > lease_ms / 1000 - 0.3  # waited for the leases (a lower bound: not a limit)
    _assert_waited_out_the_leases_then_took_them(claims, ids)
    stats = engine.store.fleet.stats()
    assert (stats.num_compiles, stats.num_duplicate_compiles) == (16, 0)


def test_a_second_compile_of_the_same_chunk_counts_as_a_duplicate(redis_url):
    first, second = _engine(redis_url), _engine(redis_url)
    first.compile(DOCS[:2])
    redis.Redis.from_url(redis_url).delete(*(k for k in redis.Redis.from_url(redis_url).keys("pic:*:*:meta")))
    second.compile(DOCS[:2])  # Redis lost the entries (evicted): compiled again within the hour
    stats = second.store.fleet.stats()
    assert (stats.num_compiles, stats.num_duplicate_compiles) == (4, 2)


def _ids_of(engine: pic.PIC, docs: list[str]) -> list[str]:
    from pic.compile import encode_documents
    from pic.ids import chunk_id

    options = engine.compile_options()
    tokens = encode_documents(engine.tokenizer, docs, vocab_size=engine.spec.vocab_size)
    return [chunk_id(engine.fingerprint, t, options) for t in tokens]


KILLED = """
import os, sys
import pic
from pic.compile import ChunkPrefill
from tests.models import model, tokenizer
from tests.test_fleet import DOCS
store = pic.StoreConfig(redis_url=sys.argv[1], redis_lease_s=2.0)
engine = pic.PIC(model("stories260K"), tokenizer(), store=store)
def die(*args, **kwargs):  # killed mid-compile: its leases are taken, nothing is written
    print("claimed", flush=True)
    os.kill(os.getpid(), 9)
ChunkPrefill.start = die
engine.compile(DOCS)
"""


def test_a_worker_killed_mid_compile_delays_the_others_by_at_most_its_lease(redis_url, monkeypatch):
    """A real worker process is SIGKILLed while compiling, its leases taken (2 s, renewed by a thread that
    dies with it): another worker's compile waits them out, then compiles all 16 chunks, once each."""
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    engine = _engine(redis_url)  # (first: the dead worker's leases run out while it is built)
    claims = _claims(engine, monkeypatch)
    victim = subprocess.Popen([sys.executable, "-c", KILLED, redis_url], stdout=subprocess.PIPE, text=True, env=env)
    assert victim.stdout.readline().strip() == "claimed"
    assert victim.wait(30) == -9
    ids = _ids_of(engine, DOCS)
    leased = [cid for cid in ids if redis.Redis.from_url(redis_url).exists(engine.store.fleet._lease(cid))]
    assert len(leased) == 16  # the dead worker's leases are still there
    engine.compile(DOCS)
    _assert_waited_out_the_leases_then_took_them(claims, ids)
    stats = engine.store.fleet.stats()
    assert (stats.num_compiles, stats.num_duplicate_compiles) == (16, 0)
