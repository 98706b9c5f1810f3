"""Compile leases that cannot be abused (issue 63): against a real redis-server, leases planted by anyone who can
write Redis (no expiry, an absurd one, another type) are replaced at once and their chunks compiled; a lease that
looks live is waited on at most a few lease lives; and no more than ``lease.MAX_WAITERS`` threads of a process wait
on leases at once, so a flood of them cannot take a server's store threads (``GET /v1/chunks``, ``/metrics`` and
other compiles keep answering)."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import redis

import pic
from pic.store import lease
from tests.models import model, tokenizer
from tests.test_fleet import _ids_of

DOCS = [f"Story {i}: Tom and Lily found {i} shiny stones by the river and took them home." for i in range(64)]


def _engine(redis_url: str, **store) -> pic.PIC:
    return pic.PIC(model("stories260K"), tokenizer(), store=pic.StoreConfig(redis_url=redis_url, **store))


def _messages(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_a_lease_lives_at_most_the_lease_life(redis_url):
    with _engine(redis_url, redis_lease_s=2.0) as engine:
        fleet, client = engine.store.fleet, redis.Redis.from_url(redis_url)
        assert fleet.max_wait_s == lease.WAIT_LEASES * 2.0  # not 300 s
        (cid,) = _ids_of(engine, DOCS[:1])
        assert fleet._acquire(cid)
        assert 0 < client.pttl(fleet._lease(cid)) <= 2000
        assert not fleet._acquire(cid)  # held by a live worker (this one): not taken twice


def test_planted_leases_are_replaced_and_their_chunks_compiled_at_once(redis_url, caplog):
    """64 leases with no expiry, one hour to live, or of another type: none is waited on. Each is replaced (logged)
    and its chunk compiled once; the compile returns without having waited on any (no "waited" line)."""
    with _engine(redis_url) as engine:
        client, ids = redis.Redis.from_url(redis_url), _ids_of(engine, DOCS)
        for i, cid in enumerate(ids):
            key = engine.store.fleet._lease(cid)
            if i % 3 == 0:
                client.set(key, "planted")  # no expiry
            elif i % 3 == 1:
                client.set(key, "planted", px=3600 * 1000)  # an hour: longer than any lease lives
            else:
                client.hset(key, "planted", 1)  # not even a string
        with caplog.at_level(logging.WARNING, logger="pic.store"):
            assert engine.compile(DOCS) == ids
        assert len(_messages(caplog, "replaced the lease")) == 64
        assert not _messages(caplog, "waited") and not _messages(caplog, "anyway")
        stats = engine.store.fleet.stats()
        assert (stats.num_compiles, stats.num_duplicate_compiles) == (64, 0)
        assert not any(client.exists(engine.store.fleet._lease(cid)) for cid in ids)  # released after the compile


class _LiveLooking:
    """An attacker who keeps leases looking live (renewed within the lease's life) and never lands the chunks."""

    def __init__(self, client, keys: list[str], lease_ms: int) -> None:
        self.client, self.keys, self.lease_ms = client, keys, lease_ms
        self.stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _LiveLooking:
        for key in self.keys:
            self.client.set(key, "attacker", px=self.lease_ms)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self.stop.wait(self.lease_ms / 4000):
            for key in self.keys:
                self.client.set(key, "attacker", px=self.lease_ms)

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self._thread.join()


def test_a_lease_flood_leaves_the_store_threads_answering(redis_url, caplog):
    """The server's case: a pool of 64 store threads, 64 compiles of documents whose leases an attacker keeps live.
    At most ``MAX_WAITERS`` of them wait (the others compile at once, without waiting), so a ``stats()`` submitted
    to the same pool after them answers while the waiters still wait; the waiters compile anyway after a few lease
    lives, never 300 s. Checked by order and counts, not by timing."""
    with _engine(redis_url, redis_lease_s=5.0) as engine:
        client, ids = redis.Redis.from_url(redis_url), _ids_of(engine, DOCS)
        keys = [engine.store.fleet._lease(cid) for cid in ids]
        waited_out = threading.Event()  # set by the first compile that waited its time out
        handler = _OnMessage("waited", waited_out)
        logging.getLogger("pic.store").addHandler(handler)
        try:
            with _LiveLooking(client, keys, engine.store.fleet.lease_ms), ThreadPoolExecutor(64) as pool:
                with caplog.at_level(logging.WARNING, logger="pic.store"):
                    compiles = [pool.submit(engine.compile, [doc]) for doc in DOCS]
                    stats = pool.submit(engine.store.stats).result(timeout=120)
                    answered_while_waiting = not waited_out.is_set()
                    results = [c.result(timeout=120) for c in compiles]
        finally:
            logging.getLogger("pic.store").removeHandler(handler)
        assert [r[0] for r in results] == ids
        assert answered_while_waiting and stats[-1].name == "redis" and stats[-1].up
        waited, skipped = _messages(caplog, "on other workers' leases"), _messages(caplog, "wait on leases already")
        assert len(waited) <= lease.MAX_WAITERS and len(waited) + len(skipped) == 64, (len(waited), len(skipped))
        assert all(f"waited {lease.WAIT_LEASES * 5} s" in m for m in waited)


class _OnMessage(logging.Handler):
    """Sets ``event`` when a record whose message holds ``text`` is emitted."""

    def __init__(self, text: str, event: threading.Event) -> None:
        super().__init__(logging.WARNING)
        self.text, self.event = text, event

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.event.set()
