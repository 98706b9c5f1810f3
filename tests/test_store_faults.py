"""Lower tiers that stall, fill up and come back, under an engine (issue 40): a real redis-server paused with
SIGSTOP, a real full file system (a small tmpfs). A tier that fails is short-circuited by its breaker in both
``on_*_error`` modes; a compile says which tiers took each chunk, and what a "miss" tier failed to take is written
to it once it works again; the start-up check writes nothing into a user's tiers; a delete that cannot reach a
tier says so instead of answering "deleted"."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import pic
from pic.check import DOCS as CHECK_DOCS
from pic.store.breaker import Breaker, BreakerOpenError
from tests.full_disk import fill, tmpfs
from tests.local_redis import wait_until
from tests.models import DOCS, model, tokenizer
from tests.test_redis import redis_tier

# New documents (not the start-up check's, not another test's), each a chunk of its own.
NEW = [f"Story {i}: a small fox named Pip found {i} red berries under the old oak tree." for i in range(8)]
TIMEOUT_S = 1.0  # Redis socket timeout: what a call to a paused server costs


def test_a_breaker_opens_at_a_failure_refuses_lets_one_probe_through_and_closes():
    now = [100.0]
    breaker = Breaker("Redis at x", retry_s=5.0, clock=lambda: now[0])
    breaker.call(lambda: None, unreachable=lambda e: True)  # closed: calls go through
    with pytest.raises(TimeoutError):
        breaker.call(lambda: (_ for _ in ()).throw(TimeoutError("timed out")), unreachable=lambda e: True)
    assert breaker.is_open and breaker.num_opened == 1
    now[0] += 1
    with pytest.raises(BreakerOpenError, match=r"not tried: Redis at x failed 1.0 s ago \(TimeoutError: timed out\)"):
        breaker.allow()
    now[0] += 4
    breaker.allow()  # the probe
    with pytest.raises(BreakerOpenError, match="a probe is under way"):
        breaker.allow()  # only one at a time
    breaker.failed(TimeoutError("again"))  # the probe failed: open for another retry_s
    with pytest.raises(BreakerOpenError, match="next try in 5.0 s"):
        breaker.allow()
    now[0] += 5
    breaker.call(lambda: None, unreachable=lambda e: True)  # a probe that works closes it
    assert not breaker.is_open and breaker.num_opened == 1
    assert (breaker.num_allowed, breaker.num_refused) == (4, 3)
    with pytest.raises(KeyError):  # the caller's own error: neither opens nor closes it
        breaker.call(lambda: {}["x"], unreachable=lambda e: isinstance(e, TimeoutError))
    assert not breaker.is_open


def disk_writable(engine: pic.PIC) -> bool:
    """The disk tier's ``writable`` (``False`` while its write breaker is open)."""
    return next(t.writable for t in engine.store.stats() if t.name == "disk")


def engine_over(store: pic.StoreConfig) -> pic.PIC:
    return pic.PIC(model("stories260K"), tokenizer(), store=store)


def test_miss_mode_pays_one_timeout_for_a_stalled_redis_says_so_and_writes_the_chunks_once_it_is_back(paused_redis):
    """Issue 40, items 5 and 6: a compile of 8 new documents while Redis is paused makes over 30 store calls
    (leases, checks, writes); the breaker lets through one per ``tier_retry_s`` (each costs a timeout), refuses
    the rest at once, and the compile reports the chunks in the pool only; once Redis answers again, the engine
    writes them there by itself (no request asks)."""
    store = pic.StoreConfig(redis_url=paused_redis.url, on_redis_error="miss", redis_timeout_s=TIMEOUT_S,
                            tier_retry_s=2.0)  # fmt: skip
    engine = engine_over(store)
    (first,) = engine.compile_report([DOCS[0]]).tiers
    assert first == ("device", "redis")
    breaker = redis_tier(engine).breaker
    allowed = breaker.num_allowed
    paused_redis.pause()
    report = engine.compile_report(NEW)
    assert report.tiers == [("device",)] * len(NEW) and report.num_compiled == len(NEW)
    # One call let through per retry_s of the compile's length (the first timed out; a loaded machine may see a
    # probe or two more), against the 30+ calls a compile of 8 documents makes, refused without waiting.
    num_tried = breaker.num_allowed - allowed
    assert breaker.num_opened == 1 and num_tried <= 3 and breaker.num_refused >= 20, (num_tried, breaker.num_refused)
    paused_redis.resume()
    wait_until(lambda: all(engine.store.lookup(cid) == ("device", "redis") for cid in report.ids), "the retried writes")
    with engine.paused() as core:
        assert not breaker.is_open and len(core.store.backlog) == 0
    engine.close()


def test_raise_mode_fails_the_compile_at_its_timeout_and_the_next_at_once(paused_redis):
    store = pic.StoreConfig(redis_url=paused_redis.url, redis_timeout_s=TIMEOUT_S, tier_retry_s=600)
    engine = engine_over(store)
    breaker = redis_tier(engine).breaker
    paused_redis.pause()
    with pytest.raises(pic.StoreUnavailableError, match="Redis at .* failed: TimeoutError"):
        engine.compile(NEW[:2])
    allowed = breaker.num_allowed
    with pytest.raises(pic.StoreUnavailableError, match=r"not tried: Redis at .* failed .* s ago \(TimeoutError"):
        engine.compile(NEW[2:4])
    assert breaker.num_allowed == allowed  # refused without touching the socket
    engine.close()


def test_a_delete_that_cannot_reach_redis_is_an_error_not_a_deleted_answer(paused_redis):
    """Issue 40, item 9: under "miss" a delete used to answer True while Redis kept the chunk, which came back
    after the outage. A delete has no miss to fall back on: it raises, the tiers above Redis still hold the chunk
    (Redis may or may not: the timed-out DEL runs when the server wakes), and deleting again finishes the job."""
    store = pic.StoreConfig(redis_url=paused_redis.url, on_redis_error="miss", redis_timeout_s=TIMEOUT_S,
                            tier_retry_s=0.2)  # fmt: skip
    engine = engine_over(store)
    (cid,) = engine.compile([NEW[0]])
    paused_redis.pause()
    with pytest.raises(pic.StoreUnavailableError, match="could not be deleted from the redis tier"):
        engine.store.expire(cid)
    assert engine.store.lookup(cid) == ("device",)  # (Redis: refused by its open breaker, as a miss)
    paused_redis.resume()
    time.sleep(0.2)  # the breaker's retry_s
    assert engine.store.expire(cid) and engine.store.lookup(cid) == ()
    engine.close()


def test_the_start_up_check_writes_nothing_into_the_users_tiers(tmp_path, redis_url):
    """Issue 40, item 8: ``pic serve`` checks its model at every start; the check's three chunks used to be
    written into every tier (a full disk then stopped the start). They stay in the pool, and no link's recheck
    writes them to Redis either."""
    store = pic.StoreConfig(disk_path=str(tmp_path), disk_bytes=1 << 30, redis_url=redis_url, shared_recheck_s=0)
    engine = engine_over(store)
    assert pic.check(engine).passed
    assert pic.check(engine).passed  # linked again: a recheck (every link here) would write them to Redis
    assert list(tmp_path.rglob("*.kv")) == [] and redis_tier(engine).ids() == []
    (cid,) = engine.compile([CHECK_DOCS[0]])  # a user's compile of the same text writes it through
    assert engine.store.lookup(cid) == ("device", "disk", "redis")
    engine.close()


@pytest.fixture
def disk(tmp_path) -> Iterator[Path]:
    """A 4 MiB tmpfs (stories260K's chunks are ~1 KB a token: room for a few dozen)."""
    with tmpfs(tmp_path / "disk", "4m") as mount:
        yield mount


def test_a_full_disk_in_miss_mode_acknowledges_only_what_it_took_and_takes_the_rest_when_room_returns(disk):
    """Issue 40, item 6: compiles on a full disk answered 200 and the chunks were never written, so a restart lost
    them. The report names the tiers that hold each chunk, and once the disk has room the engine writes the
    chunks it lacks: a restarted engine finds every one."""
    store = pic.StoreConfig(disk_path=str(disk), disk_bytes=1 << 30, on_disk_error="miss", tier_retry_s=0.2)
    engine = engine_over(store)
    filler = fill(disk)
    report = engine.compile_report(NEW)
    assert report.tiers == [("device",)] * len(NEW)
    filler.unlink()
    wait_until(lambda: all(engine.store.lookup(cid) == ("device", "disk") for cid in report.ids), "the retried writes")
    engine.close()
    restarted = engine_over(store)
    assert [restarted.store.lookup(cid) for cid in report.ids] == [("disk",)] * len(NEW)
    assert restarted.link(report.ids, "Pip").generate(max_new_tokens=4).stats.num_generated_tokens == 4
    restarted.close()


def test_a_full_disk_in_raise_mode_fails_the_compile_naming_the_path_and_starts_again(disk):
    """Nothing is acknowledged that the disk did not take (raise mode); an engine started on the full disk
    serves what is on it (item 8), and compiles again once there is room."""
    store = pic.StoreConfig(disk_path=str(disk), disk_bytes=1 << 30, tier_retry_s=0.2)
    engine = engine_over(store)
    kept = engine.compile(NEW[:2])
    for usage in disk.glob("*/.usage"):  # a start must write it again (what a crash mid-rewrite leaves)
        usage.unlink()
    filler = fill(disk)
    with pytest.raises(pic.StoreUnavailableError, match=f"disk tier at {disk}.*ENOSPC"):
        engine.compile(NEW[2:4])
    engine.close()
    restarted = engine_over(store)  # on the full disk: its start cannot write the usage record
    assert disk_writable(restarted) is False
    assert [restarted.store.lookup(cid) for cid in kept] == [("disk",)] * 2
    filler.unlink()
    time.sleep(0.2)  # the write breaker's retry_s (it opened at the start)
    assert restarted.compile_report(NEW[2:4]).tiers == [("device", "disk")] * 2
    restarted.close()
