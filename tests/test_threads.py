"""One owner thread: any number of caller threads, releases and failures in one never disturb another,
and engines close and go away.

Every comparison is token for token against the same request run alone from one thread, in float32
(``EXACT``): batch shapes do not change greedy or seeded tokens there (see tests/test_engine.py).
"""

from __future__ import annotations

import gc
import random
import threading
import time
import weakref

import pytest

import pic
from tests.conftest import make_target_engine
from tests.device import target
from tests.kv_invariants import check_engine_pool
from tests.models import DOCS, QUERY

EXACT = target().exact_dtype


def engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "pic-engine"]


def test_releases_in_one_thread_never_break_generations_in_others():
    """The reproduction of issue 20: six threads generate while a seventh links and releases in a loop."""
    engine = make_target_engine("stories260K", dtype=EXACT)
    ids = engine.compile(["Tom had a big red ball.", "Lily loved to sing."])
    want = engine.link(ids, "One day").generate(max_new_tokens=24).token_ids
    results, errors = [], []

    def generate() -> None:
        try:
            for _ in range(6):
                results.append(engine.link(ids, "One day").generate(max_new_tokens=24).token_ids)
        except Exception as exc:
            errors.append(exc)

    def release() -> None:
        for i in range(40):
            linked = engine.link(ids, "Then")
            if i % 3 == 0:
                linked.release()
            elif i % 3 == 1:
                with linked:
                    pass
            else:
                del linked  # the finalizer releases it, in whatever thread collects it

    threads = [threading.Thread(target=generate) for _ in range(6)] + [threading.Thread(target=release)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors and results == [want] * 36
    gc.collect()
    stats = engine.kv_stats()
    assert stats.num_private_blocks == 0 and stats.num_shared_block_refs == 0
    check_engine_pool(engine, {})


@pytest.mark.parametrize("bad", ["", [10**6], "a\ud800b"], ids=["empty", "out-of-vocab", "lone-surrogate"])
def test_a_bad_request_in_generate_many_is_refused_before_any_runs(bad):
    """The second reproduction: a bad request after a good one raises ``InvalidInputError`` (an empty query
    already when the request is built), runs nothing, and the engine goes on serving."""
    engine = make_target_engine("stories260K", dtype=EXACT)
    ids = engine.compile(list(DOCS))
    good = pic.Request(ids, QUERY, max_new_tokens=8)
    steps = engine.stepper().num_steps
    with pytest.raises(pic.InvalidInputError, match="query"):
        engine.generate_many([good, pic.Request(ids, bad)])
    assert engine.stepper().num_steps == steps  # refused before anything ran
    assert engine.kv_stats().num_used_blocks == 0
    alone = engine.link(ids, QUERY).generate(8).token_ids
    assert [g.token_ids for g in engine.generate_many([good, good])] == [alone, alone]
    check_engine_pool(engine, {})


def test_a_failed_generate_option_leaves_the_request_usable():
    engine = make_target_engine("stories260K", dtype=EXACT)
    ids = engine.compile(list(DOCS))
    want = engine.link(ids, QUERY).generate(8).token_ids
    linked = engine.link(ids, QUERY)
    with pytest.raises(pic.InvalidInputError, match="temperature"):
        linked.generate(8, temperature=-1.0)
    with pytest.raises(pic.InvalidInputError, match="nosuch"):
        linked.generate(8, nosuch=1)
    assert linked.generate(sampling=pic.SamplingParams(max_new_tokens=8)).token_ids == want
    with pytest.raises(pic.LinkedReleasedError):
        linked.generate(8)


def test_an_idle_engine_costs_no_cpu_and_a_dropped_one_goes_away():
    before = len(engine_threads())
    engine = make_target_engine("stories260K")
    ids = engine.compile(list(DOCS))
    engine.link(ids, QUERY).generate(4)
    start = time.process_time()
    time.sleep(0.5)
    assert time.process_time() - start < 0.05  # its thread blocks on its queue: no polling
    ref = weakref.ref(engine)
    del engine
    assert ref() is None  # no cycle keeps it: collected when the last reference goes
    deadline = time.monotonic() + 30  # (a bound on the wait: the thread ends as soon as it is told to)
    while len(engine_threads()) > before:
        assert time.monotonic() < deadline, "the dropped engine's thread did not end"
        time.sleep(0.01)


def test_close_fails_open_requests_and_refuses_later_calls():
    with make_target_engine("stories260K") as engine:
        ids = engine.compile(list(DOCS))
        linked = engine.link(ids, QUERY)
        stream = engine.link(ids, QUERY).stream(400)
        next(stream)
    # closed by the with block: a parked request fails, a stream in progress ends with the error
    with pytest.raises(pic.EngineClosedError):
        linked.generate(4)
    with pytest.raises(pic.EngineClosedError):
        list(stream)
    with pytest.raises(pic.EngineClosedError):
        engine.link(ids, QUERY)
    with pytest.raises(pic.EngineClosedError):
        engine.kv_stats()
    linked.release()  # a no-op now, not an error
    engine.close()  # idempotent


# -- the stress test -----------------------------------------------------------------------------------

NUM_THREADS = 8
NUM_OPERATIONS = 2000


def _cases(ids: list[str]) -> list[pic.Request]:
    """Request shapes the stress test draws from: policies, orders, prefixes, greedy and seeded."""
    policies = ("naive", "full", "legolink:16", "mepic", "cacheblend:0.15")
    orders = [ids, ids[::-1], ids[1:], ids[:1], []]
    cases = []
    for i in range(10):
        sampling = dict(temperature=0.9, top_p=0.9, seed=i) if i % 3 == 0 else {}
        cases.append(
            pic.Request(
                orders[i % 5], f"{QUERY} {i}", prefix="Stories." if i % 4 == 0 else "", policy=policies[i % 5],
                max_new_tokens=4 + i % 7, **sampling,
            )
        )  # fmt: skip
    return cases


class Stress:
    """One thread's share of the stress test: random operations, each checked against the alone outputs."""

    def __init__(self, engine: pic.PIC, cases: list[pic.Request], want: list[pic.Generation], seed: int) -> None:
        self.engine, self.cases, self.want, self.rng = engine, cases, want, random.Random(seed)
        self.ops = (
            self.generate, self.stream, self.release, self.drop, self.close_early, self.bad_option,
            self.generate_many, self.bad_generate_many,
        )  # fmt: skip

    def link(self, i: int) -> pic.Linked:
        case = self.cases[i]
        return self.engine.link(case.cache_ids, case.query, prefix=case.prefix, policy=case.policy)

    def pick(self) -> int:
        return self.rng.randrange(len(self.cases))

    def generate(self) -> None:
        i = self.pick()
        assert self.link(i).generate(sampling=self.cases[i].sampling).token_ids == self.want[i].token_ids

    def stream(self) -> None:
        i = self.pick()
        assert "".join(self.link(i).stream(sampling=self.cases[i].sampling)) == self.want[i].text

    def release(self) -> None:
        self.link(self.pick()).release()

    def drop(self) -> None:
        self.link(self.pick())  # dropped at once: its finalizer releases it

    def close_early(self) -> None:
        i = self.pick()
        pieces = self.link(i).stream(sampling=self.cases[i].sampling.model_copy(update={"max_new_tokens": 200}))
        next(pieces, None)
        pieces.close()

    def bad_option(self) -> None:
        i = self.pick()
        linked = self.link(i)
        with pytest.raises(pic.InvalidInputError):
            linked.generate(4, top_p=2.0)
        assert linked.generate(sampling=self.cases[i].sampling).token_ids == self.want[i].token_ids

    def generate_many(self) -> None:
        picks = [self.pick() for _ in range(self.rng.randint(1, 4))]
        got = self.engine.generate_many([self.cases[i] for i in picks])
        assert [g.token_ids for g in got] == [self.want[i].token_ids for i in picks]

    def bad_generate_many(self) -> None:
        good = self.cases[self.pick()]
        bad = self.rng.choice([pic.Request(good.cache_ids, [10**6]), pic.Request(["0" * 32], QUERY)])
        error = pic.InvalidInputError if bad.query == [10**6] else pic.UnknownCacheIdError
        with pytest.raises(error):
            self.engine.generate_many([good, bad, good])

    def run(self, num_operations: int, counts: dict[str, int]) -> None:
        for _ in range(num_operations):
            op = self.rng.choice(self.ops)
            op()
            counts[op.__name__] = counts.get(op.__name__, 0) + 1


@pytest.mark.slow
def test_eight_threads_mixing_every_operation():
    """8 threads, 2,000 operations: link/generate/stream/release/drop/early close/bad options/generate_many
    with good and bad requests. Every good request gets its single-thread output, no block leaks, and the
    engine stays usable."""
    engine = make_target_engine("stories260K", dtype=EXACT)
    ids = engine.compile(list(DOCS))
    cases = _cases(ids)
    want = [Stress(engine, cases, [], 0).link(i).generate(sampling=c.sampling) for i, c in enumerate(cases)]
    errors: list[BaseException] = []
    per_thread: list[dict[str, int]] = [{} for _ in range(NUM_THREADS)]

    def worker(seed: int) -> None:
        try:
            Stress(engine, cases, want, seed).run(NUM_OPERATIONS // NUM_THREADS, per_thread[seed])
        except BaseException as exc:  # noqa: BLE001 - reported below, with the thread's traceback
            errors.append(exc)
            raise

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(NUM_THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=900)
    assert not errors, errors[0]
    counts = {op: sum(c.get(op, 0) for c in per_thread) for c in per_thread for op in c}
    assert sum(counts.values()) == NUM_OPERATIONS and len(counts) == 8, counts
    gc.collect()
    stats = engine.kv_stats()
    assert stats.num_private_blocks == 0 and stats.num_shared_block_refs == 0 and stats.num_used_blocks == 0
    check_engine_pool(engine, {})
    assert (
        engine.link(cases[1].cache_ids, cases[1].query, policy=cases[1].policy)
        .generate(sampling=cases[1].sampling)
        .token_ids
        == want[1].token_ids
    )
