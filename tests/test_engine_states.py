"""A sequence is one state machine (issue 49): the issue's two reproductions, a transition its status does not
allow, and an invariant broken inside one sequence, which fails that request alone.

Before issue 49 a parked link whose generation started was put among the running while its status said waiting;
the first time the pool filled it was preempted, ``Sequence.preempt`` asserted, and the assertion escaped the
scheduler: every open request failed (six of six in the first reproduction, three of three in the second).
"""

from __future__ import annotations

import threading

import pytest

import pic
from pic.engine.core.sequence import TRANSITIONS, Queues, Sequence, Status, Transition
from pic.engine.request import NewRequest
from pic.errors import SequenceStateError
from pic.link import policies
from pic.link.order import Order
from tests.conftest import make_engine
from tests.kv_invariants import check_engine_pool
from tests.models import DOCS, QUERY

# auto without its floor on the gain: the pools are sized for links that share the chunks' blocks, and these short
# prompts would run Full Recompute under the default
LINKING = "auto:0.05,min_gain=1.0"


def _engine(pool: int) -> tuple[pic.PIC, list[str]]:
    """The embedded model over a ``pool``-token pool, with the same two chunks compiled."""
    engine = make_engine("stories260K", kv_pool_tokens=pool, block_size=16)
    return engine, engine.compile(list(DOCS[:2]))


def _in_threads(work, num: int) -> list:
    """``work(i)`` for ``i < num``, each in a thread of its own; the results (or the exceptions) in order."""
    results: list = [None] * num

    def run(i: int) -> None:
        try:
            results[i] = work(i)
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(num)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return results


# 640: the engine refuses a link (it does not wait) when nothing runs and parked links hold the blocks it needs, and a
# thread is briefly parked between its link and its generate. Under auto a link keeps 4 private blocks (of 16 tokens):
# five parked (20), both chunks' 5 canonical blocks (reloaded after an eviction) and the worst re-admission, a
# preempted sequence with its 150 tokens (14), make 39 of 40 blocks; 448 tokens (28) refused one on a loaded CI
# machine. Six generations together need ~84 blocks, so 640 still preempts.
@pytest.mark.parametrize("pool", [1024, 640])
def test_six_threads_generating_from_parked_links_all_complete(pool):
    """Reproduction 1: six threads link, then generate (sampled, seeded) over one pool; all complete, and the
    greedy variant of each equals it alone (the pool fills: some are preempted after their generation started)."""
    engine, ids = _engine(pool)

    def sampled(i: int) -> pic.Generation:
        return engine.link(ids, f"One day number {i}", policy=LINKING).generate(
            max_new_tokens=150, temperature=0.8, seed=i
        )

    outs = _in_threads(sampled, 6)
    assert all(isinstance(out, pic.Generation) for out in outs), outs
    assert all(out.stats.num_generated_tokens == 150 or out.stats.finish_reason.value == "eos" for out in outs)
    greedy = _in_threads(
        lambda i: engine.link(ids, f"One day number {i}", policy=LINKING).generate(max_new_tokens=150), 6
    )
    assert sum(out.stats.num_preemptions for out in [*outs, *greedy]) > 0  # (the path the issue found)
    alone = [
        engine.link(ids, f"One day number {i}", policy=LINKING).generate(max_new_tokens=150).token_ids for i in range(6)
    ]
    assert [out.token_ids for out in greedy] == alone
    assert engine.kv_stats().num_used_blocks == 0
    check_engine_pool(engine, {})


@pytest.mark.parametrize("pool", [320, 384, 448])
def test_generate_together_of_three_parked_links_completes(pool):
    """Reproduction 2: ``generate_together`` of three links over a small pool; all complete, greedy ones as alone."""
    engine, ids = _engine(pool)
    queries = [f"One day number {i}" for i in range(3)]
    link = lambda q: engine.link(ids, q, policy=LINKING)  # noqa: E731
    outs = pic.generate_together([link(q) for q in queries], 150, temperature=0.8, seed=1)
    assert len(outs) == 3 and all(out.stats.num_generated_tokens >= 1 for out in outs)
    greedy = pic.generate_together([link(q) for q in queries], 150)
    alone = [link(q).generate(150).token_ids for q in queries]
    assert [out.token_ids for out in greedy] == alone
    assert engine.kv_stats().num_used_blocks == 0


def _sequence() -> Sequence:
    new = NewRequest(
        7, [], [], [1, 5], policies.resolve("naive"), Order.GIVEN, None, pic.CompileOptions(), None, sink=None
    )  # type: ignore[arg-type]
    return Sequence(new)


def test_a_transition_its_status_does_not_allow_raises_a_named_error_and_changes_nothing():
    """``Queues.move``: checked before anything changes; the sequence is in the queue of its status, and only there."""
    seq, queues = _sequence(), Queues()
    queues.add(seq)
    with pytest.raises(SequenceStateError, match="request 7 cannot preempt while waiting"):
        queues.move(seq, Transition.PREEMPT)
    assert seq.status is Status.WAITING and seq.num_preemptions == 0 and list(queues.to_admit) == [seq]
    queues.move(seq, Transition.ADMIT)
    assert queues.prefilling == [seq] and not queues.to_admit and seq.times.scheduled_s is not None
    with pytest.raises(SequenceStateError, match="cannot resume while prefilling"):
        queues.move(seq, Transition.RESUME)
    assert queues.prefilling == [seq]
    queues.move(seq, Transition.FINISH)
    assert not queues.prefilling and not queues.requests
    with pytest.raises(SequenceStateError, match="cannot finish while finished"):
        queues.move(seq, Transition.FINISH)


def test_every_status_but_finished_is_reached_and_left():
    """The table is one machine: each live status has a way in and a way out; FINISHED none out."""
    targets = {target for _, target in TRANSITIONS.values()}
    sources = {s for starts, _ in TRANSITIONS.values() for s in starts}
    assert targets == set(Status) and sources == set(Status) - {Status.FINISHED}
    assert TRANSITIONS[Transition.START] == (frozenset({Status.RESUMING}), Status.RUNNING)


@pytest.mark.parametrize("broken", [Status.WAITING, Status.PARKED])
def test_a_broken_invariant_fails_that_request_alone_and_the_engine_serves_the_next(broken, caplog):
    """A running sequence forced into another status (``WAITING``: what the resumed-link bug left behind) while
    another request generates: that one request fails with ``SequenceStateError`` (and a log line), the other
    ends as it does alone, the pool comes back to rest, and a new request is served."""
    engine = make_engine("stories260K", eos_token_ids=())
    ids = engine.compile(list(DOCS))
    alone = engine.link(ids, QUERY, policy=LINKING).generate(60).token_ids
    victim = engine.link(ids, "The victim", policy=LINKING).stream(400)
    next(victim)  # it runs
    other: dict = {}
    thread = threading.Thread(target=lambda: other.update(out=engine.link(ids, QUERY, policy=LINKING).generate(60)))
    with engine.paused() as core:
        thread.start()  # (its request arrives while the engine is paused)
        (seq,) = [s for s in core.scheduler.queues.running if s.status is Status.RUNNING]
        seq.status = broken  # the invariant broken: a sequence among the running that is not running
    with pytest.raises(SequenceStateError, match=f"is {broken.value} where only running can be"):
        for _ in victim:
            pass
    thread.join(timeout=60)
    assert other["out"].token_ids == alone
    assert any("SequenceStateError" in r.getMessage() or "where only running" in r.getMessage() for r in caplog.records)
    assert engine.kv_stats().num_used_blocks == 0
    check_engine_pool(engine, {})
    assert engine.link(ids, QUERY, policy=LINKING).generate(60).token_ids == alone


def test_a_pass_under_way_goes_before_an_earlier_request_that_waits_for_blocks():
    """Work under way is scheduled before new work: the pieces of a long static pass are not held up behind an
    earlier request that waits for the blocks the pass's own request holds (else a livelock: the waiting request
    waits for the prefilling one, which is never scheduled)."""
    engine = make_engine("stories260K", kv_pool_tokens=256, eos_token_ids=(), max_num_batched_tokens=16)
    ids = engine.compile(list(DOCS))
    stepper = engine.stepper()
    long = stepper.add_request(pic.Request(ids, QUERY, policy="full", max_new_tokens=4))
    assert stepper.step() == []  # its first piece
    big = stepper.add_request(pic.Request([], [5] * 150, policy="naive", max_new_tokens=4))  # fits alone, not beside
    with engine.paused() as core:
        seqs = core.scheduler.queues.requests
        assert seqs[long].status is Status.PREFILLING  # its next pieces are the next steps' work
        seqs[big].times.arrival_s = seqs[long].times.arrival_s - 1.0  # it came first
    finished: dict[int, pic.RequestOutput] = {}
    for _ in range(60):
        finished |= {out.request_id: out for out in stepper.step() if out.finished}
    assert set(finished) == {long, big} and all(out.error is None for out in finished.values())
    assert [len(out.generation.token_ids) for out in finished.values()] == [4, 4]


def test_a_probes_second_pass_runs_in_its_probes_step_before_an_earlier_request():
    """A probe's second pass runs in the step of its probe (a second forward), never held up behind other work: not
    behind an earlier request that waits for the blocks the probe's own request holds. (The fuzzer's seed 9 over 256
    tokens livelocked when the second pass was the next step's work: the waiting request waited for the prefilling
    one, which was never scheduled.)"""
    engine = make_engine("stories260K", kv_pool_tokens=256, eos_token_ids=())
    ids = engine.compile(list(DOCS))
    stepper = engine.stepper()
    probe = stepper.add_request(pic.Request(ids, QUERY, policy="prophetkv", max_new_tokens=4))
    first = stepper.step()  # the probe's forward, then its second pass's: the first token
    assert [(out.request_id, len(out.token_ids)) for out in first] == [(probe, 1)]
    big = stepper.add_request(pic.Request([], [5] * 150, policy="naive", max_new_tokens=4))  # fits alone, not beside
    with engine.paused() as core:
        seqs = core.scheduler.queues.requests
        assert seqs[probe].status is Status.RUNNING
        seqs[big].times.arrival_s = seqs[probe].times.arrival_s - 1.0  # it came first
    finished: dict[int, pic.RequestOutput] = {}
    for _ in range(30):
        finished |= {out.request_id: out for out in stepper.step() if out.finished}
    assert set(finished) == {probe, big} and all(out.error is None for out in finished.values())
    assert [len(out.generation.token_ids) for out in finished.values()] == [4, 4]


@pytest.mark.parametrize("where", ["running", "waiting", "parked"])
def test_fail_moves_status_queue_and_blocks_together(where):
    """``Scheduler.fail`` (issue 57), the one way a sequence fails: status, queue and blocks go at once, its last
    output carries the error, and a second failure of the same sequence changes nothing."""
    engine = make_engine("stories260K", eos_token_ids=())
    ids = engine.compile(list(DOCS))
    stepper = engine.stepper()
    linked = engine.link(ids, QUERY, policy=LINKING) if where == "parked" else None
    rid = stepper.add_request(pic.Request(ids, QUERY, policy="naive", max_new_tokens=50))
    if where == "running":
        assert [len(out.token_ids) for out in stepper.step()] == [1]  # its pass ran: it decodes
    with engine.paused() as core:
        scheduler = core.scheduler
        seq = scheduler.queues.requests[linked._request_id if linked else rid]
        queue = {"running": scheduler.queues.running, "waiting": scheduler.queues.to_admit, "parked": []}[where]
        assert seq.status.value == where and (seq in queue or where == "parked")
        assert (seq.blocks.kv is not None) == (where != "waiting")
        scheduler.fail(seq, pic.PicError("broken on purpose"))
        assert seq.status is Status.FINISHED and seq.request_id not in scheduler.queues.requests
        queues = scheduler.queues
        assert all(seq not in q for q in (queues.running, queues.prefilling, queues.to_admit))
        assert seq.blocks.kv is None and not seq.blocks.held and not seq.blocks.reserved
        scheduler.fail(seq, pic.PicError("again"))  # (ended already: left as it is)
        assert str(seq.error) == "broken on purpose"
    if linked is not None:  # (its link's output was put already: its generation finds it gone)
        with pytest.raises(pic.LinkedReleasedError):
            linked.generate(4)
        stepper.abort(rid)
    else:
        (last,) = [out for out in stepper.step() if out.finished] or [None]
        assert last is not None and str(last.error) == "broken on purpose"
    while stepper.has_unfinished():
        stepper.step()
    assert engine.kv_stats().num_used_blocks == 0
    check_engine_pool(engine, {})


def test_a_resume_whose_decoder_fails_leaves_its_link_parked_and_the_others_running():
    """``Linked.generate`` on a link whose decoding cannot start (its sampler raises): the caller gets the error,
    the sequence is not moved to RESUMING without a sampler (whose next step would fail every open request), and
    another parked link and a new request still generate."""
    engine = make_engine("stories260K")
    try:
        ids = engine.compile(list(DOCS))
        other, linked = engine.link(ids, QUERY, policy=LINKING), engine.link(ids, f"{QUERY} again", policy=LINKING)
        with engine.paused() as core:
            start, calls = core.decoder.start, []

            def broken_once(params):
                if not calls:
                    calls.append(params)
                    raise RuntimeError("the sampler could not start")
                return start(params)

            core.decoder.start = broken_once
        with pytest.raises(RuntimeError, match="the sampler could not start"):
            linked.generate(max_new_tokens=3)
        assert other.generate(max_new_tokens=3).stats.num_generated_tokens == 3
        assert engine.link(ids, QUERY, policy=LINKING).generate(max_new_tokens=3).stats.num_generated_tokens == 3
        check_engine_pool(engine)
    finally:
        engine.close()
