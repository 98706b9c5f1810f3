"""The engine schedules all its work (issue 32): a compile never stalls running streams, preemption keeps
what a request needs, and a hung store stalls only the requests that need it.

Each test reproduces a defect of the engine before its scheduler took compiles and store I/O: on that
engine, the first saw a 0.7-1.2 s gap, the second ``UnknownCacheIdError`` for an evicted chunk, the third a
9.5 s completion that needed no Redis. They check it by steps and order, not by the clock (issue 67: a loaded
machine stretches every gap): the forwards the scheduler chose (``StepLog``), which request finished first.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

import pytest
import torch

import pic
from pic.errors import StoreUnavailableError
from tests.conftest import make_engine

NUM_DOC_TOKENS = 290
STREAM_TOKENS = 400  # a stream's generations (each of its links): no other request here asks for as many
WAIT_S = 60  # a bound on waiting for a thread that must end (seconds; only a hang reaches it)
REDIS_TIMEOUT_S = 5.0  # what a frozen Redis costs its requests: far more than 32 steps of stories260K, even loaded


def _documents(num: int, *, seed: int, vocab_size: int, num_tokens: int = NUM_DOC_TOKENS) -> list[list[int]]:
    """``num`` distinct documents of token ids (new to any cache: the seed makes them differ)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(num_tokens)] for _ in range(num)]


@dataclass(frozen=True)
class Step:
    """One step as the scheduler chose it: the requests open when it was scheduled (queued, prefilling or
    running: ``max_new_tokens`` each, ``None`` for a link), those it decodes, the tokens of each request's recompute
    pass in it, and its chunk prefills (compiles): cache id -> tokens."""

    open: dict[int, int | None]
    decodes: frozenset[int]
    passes: dict[int, int]
    compiles: dict[str, int]

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(self.passes.values()) + sum(self.compiles.values())


class StepLog:
    """Every step ``engine`` schedules from now on (``scheduler.schedule`` wrapped while the engine is paused; the
    record is taken on the engine's thread)."""

    def __init__(self, engine: pic.PIC) -> None:
        self.steps: list[Step] = []
        with engine.paused() as core:
            scheduler = core.scheduler
            schedule = scheduler.schedule

            def recorded():
                seqs = scheduler.queues.requests.values()
                open_ = {s.request_id: s.sampling.max_new_tokens if s.sampling else None for s in seqs}
                batch = schedule()
                compiles: dict[str, int] = {}
                for prefill, piece in batch.pieces:
                    compiles[prefill.cache_id] = compiles.get(prefill.cache_id, 0) + int(piece.token_ids.numel())
                passes = {p.seq.request_id: p.num_tokens for p in batch.passes}
                decodes = frozenset(s.request_id for s in batch.decodes)
                self.steps.append(Step(open_, decodes, passes, compiles))
                return batch

            scheduler.schedule = recorded

    def streams(self, steps: list[Step]) -> dict[int, list[int]]:
        """The streams' generations (``STREAM_TOKENS`` each): request id -> the indices of ``steps`` decoding it."""
        decoded: dict[int, list[int]] = {}
        for i, step in enumerate(steps):
            for rid in step.decodes:
                if step.open.get(rid) == STREAM_TOKENS:
                    decoded.setdefault(rid, []).append(i)
        return decoded

    def compile_steps(self, cache_ids: list[str]) -> list[int]:
        """The indices of the steps that prefilled a piece of one of ``cache_ids``."""
        wanted = set(cache_ids)
        return [i for i, step in enumerate(self.steps) if wanted & step.compiles.keys()]


def _assert_the_compile_ran_in_budgeted_steps_beside_every_stream(log: StepLog, compiled: list[str], budget: int):
    """What "never stalls a stream for more than a step" means in steps: the compile's chunks were prefilled in the
    scheduled steps (all of them, none outside a step), no step ran more than the budget of tokens (a step's length),
    every step from a stream generation's first token to its last decoded it (its gaps: one step each), and many of
    the compile's steps decoded a stream beside it (it ran during the compile)."""
    steps = list(log.steps)
    prefilled = {cid for step in steps for cid in step.compiles}
    assert set(compiled) <= prefilled, f"{len(set(compiled) - prefilled)} chunks were compiled outside any step"
    heavy = [(i, step.num_tokens) for i, step in enumerate(steps) if step.num_tokens > budget]
    assert not heavy, f"steps over the {budget}-token budget: {heavy[:5]}"
    streams = log.streams(steps)
    for rid, decoded in streams.items():
        skipped = sorted(set(range(decoded[0], decoded[-1] + 1)) - set(decoded))
        assert not skipped, f"stream request {rid} was not decoded in steps {skipped[:10]} while it was running"
    during = [i for i in log.compile_steps(compiled) if any(i in decoded for decoded in streams.values())]
    assert len(during) > 10, f"{len(during)} of the compile's steps decoded a stream beside it"


def _stream(engine: pic.PIC, ids: list[str], stop: threading.Event) -> None:
    """Stream tokens until ``stop`` (linking again when a generation ends)."""
    while not stop.is_set():
        for _ in engine.link(ids, [5, 6, 7], policy="naive").stream(max_new_tokens=STREAM_TOKENS):
            if stop.is_set():
                break


def test_a_compile_of_60_documents_never_stalls_a_stream_for_more_than_a_step():
    engine = make_engine("stories260K", eos_token_ids=(), kv_pool_tokens=1 << 16)  # the default budget: 256 tokens
    budget = engine.config.max_num_batched_tokens
    ids = engine.compile(["Tom had a big red ball.", "Lily loved to sing."])
    docs = _documents(60, seed=1, vocab_size=engine.spec.vocab_size)
    log, stop = StepLog(engine), threading.Event()
    streamer = threading.Thread(target=_stream, args=(engine, ids, stop))
    streamer.start()
    _wait_for_stream(log)
    compiled = engine.compile(docs, progress=False)
    stop.set()
    streamer.join(WAIT_S)
    assert not streamer.is_alive(), "the stream did not stop"
    assert len(set(compiled)) == 60 and all(engine.store.contains(cid) for cid in compiled)
    _assert_the_compile_ran_in_budgeted_steps_beside_every_stream(log, compiled, budget)


def _wait_for_stream(log: StepLog) -> None:
    """Return once a stream has decoded a few tokens (so it is running when the compile comes)."""
    deadline = time.monotonic() + WAIT_S  # (a bound on a wait: a stream decodes within milliseconds)
    while sum(len(d) for d in log.streams(list(log.steps)).values()) < 5:
        assert time.monotonic() < deadline, "the stream did not start"
        time.sleep(0.005)


def _first_token_steps(engine: pic.PIC, ids: list[str], log: StepLog) -> list[int]:
    """The steps each of 4 default requests sent together (the default policy over ``ids``, 4 queries) was open
    for until it had its first token (its only one): the steps it waited through, its own included. Four, not one:
    they take several steps, so a request that waits behind other prefill work shows in them."""
    first = len(log.steps)
    requests = [pic.Request(ids, [5, 6, 7 + i], max_new_tokens=1) for i in range(4)]
    engine.generate_many(requests, progress=False)
    steps = list(log.steps)[first:]
    mine = {rid for step in steps for rid, wants in step.open.items() if wants == 1}
    return sorted(sum(rid in step.open for step in steps) for rid in mine)


def _wait_for_compile(engine: pic.PIC, num_before: int, compiling: threading.Thread) -> None:
    """Return once a few chunks of the compile under way are resident (so it has started, and goes on)."""
    while engine.kv_stats().num_resident_chunks < num_before + 3:
        assert compiling.is_alive(), "the compile ended before a request could arrive during it"
        time.sleep(0.005)


def test_a_request_arriving_during_a_60_document_compile_is_served_first():
    """Issue 43: prefill work was first come first served, so a request that arrived during a bulk compile got its
    first token when the compile was done (734 ms of an 800 ms compile; alone, a few ms). Links and generations
    now go first (``PrefillOrder.INTERACTIVE``): each of the requests waits through as many steps as alone and at
    most two more (the running stream's decode takes a token of each step's budget, and its next link a pass of its
    query; here one more), where first come first served waits through the rest of the compile (60 steps and more
    here). Meanwhile a running stream is decoded in every step and the compile completes."""
    engine = make_engine("stories260K", eos_token_ids=(), kv_pool_tokens=1 << 16)  # the default budget: 256 tokens
    budget = engine.config.max_num_batched_tokens
    stream_ids = engine.compile(["Tom had a big red ball.", "Lily loved to sing."])
    ids = engine.compile(_documents(3, seed=2, vocab_size=engine.spec.vocab_size, num_tokens=150), progress=False)
    log = StepLog(engine)
    alone = _first_token_steps(engine, ids, log)
    stop, compiled = threading.Event(), []
    streamer = threading.Thread(target=_stream, args=(engine, stream_ids, stop))
    streamer.start()
    _wait_for_stream(log)
    docs = _documents(60, seed=3, vocab_size=engine.spec.vocab_size)
    compiling = threading.Thread(target=lambda: compiled.extend(engine.compile(docs, progress=False)))
    num_before = engine.kv_stats().num_resident_chunks
    compiling.start()
    _wait_for_compile(engine, num_before, compiling)
    during = [_first_token_steps(engine, ids, log) for _ in range(3)]
    assert compiling.is_alive(), "the compile ended before the requests did: they did not arrive during it"
    compiling.join(WAIT_S)
    stop.set()
    streamer.join(WAIT_S)
    assert not compiling.is_alive() and not streamer.is_alive(), "the compile or the stream did not end"
    assert len(set(compiled)) == 60 and all(engine.store.contains(cid) for cid in compiled)
    assert all(len(steps) == 4 for steps in [alone, *during]), (alone, during)
    assert all(max(steps) <= max(alone) + 2 for steps in during), (
        f"steps until the first token: {during}, {alone} alone"
    )
    _assert_the_compile_ran_in_budgeted_steps_beside_every_stream(log, compiled, budget)


def test_chunks_a_request_waits_for_are_compiled_before_a_bulk_compile():
    """A chat's inline documents (``compile(..., interactive=True)``, as ``link_chat(documents=...)`` and the
    server's completions compile them) go with the requests, before the bulk compile under way: that call returns
    while most of the bulk compile's chunks are still to come (an order, not a time)."""
    engine = make_engine("stories260K", eos_token_ids=(), kv_pool_tokens=1 << 16)
    docs = _documents(60, seed=6, vocab_size=engine.spec.vocab_size)
    compiling = threading.Thread(target=engine.compile, args=(docs,), kwargs={"progress": False})
    num_before = engine.kv_stats().num_resident_chunks
    compiling.start()
    _wait_for_compile(engine, num_before, compiling)
    engine.compile(_documents(2, seed=7, vocab_size=engine.spec.vocab_size), progress=False, interactive=True)
    num_bulk = engine.kv_stats().num_resident_chunks - num_before - 2
    compiling.join(60)
    assert num_bulk < 30, f"{num_bulk} of the bulk compile's 60 chunks were compiled before the chat's 2"


def test_in_arrival_order_a_request_waits_for_the_compile_before_it():
    """``prefill_order="arrival"`` (first come first served): the request that arrives during the compile is
    admitted after the compile's last chunk prefill is scheduled, so every chunk of it is resident by its first
    token (an order, not a time: the knob does what it says)."""
    engine = make_engine("stories260K", eos_token_ids=(), kv_pool_tokens=1 << 16, prefill_order="arrival")
    ids = engine.compile(_documents(1, seed=4, vocab_size=engine.spec.vocab_size), progress=False)
    docs = _documents(30, seed=5, vocab_size=engine.spec.vocab_size)
    compiling = threading.Thread(target=engine.compile, args=(docs,), kwargs={"progress": False})
    num_before = engine.kv_stats().num_resident_chunks
    compiling.start()
    _wait_for_compile(engine, num_before, compiling)
    engine.generate_many([pic.Request(ids, [5, 6, 7], max_new_tokens=1)], progress=False)
    assert engine.kv_stats().num_resident_chunks == num_before + 30
    compiling.join(60)


def test_48_preempting_requests_over_a_4096_token_pool_all_finish_with_their_alone_output():
    """The default policy copies the chunk blocks it writes, so only holds keep the chunks resident. The pool
    holds ~25 of the 48 requests: the rest are preempted, their chunks' holds let go and the
    chunks evicted; each request loads or compiles them again from their tokens and ends as it does alone."""
    docs = [" ".join(["Tom had a big red ball and he played with it all day."] * 6), "Lily loved to sing."]
    queries = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    requests = [pic.Request([], q, max_new_tokens=150) for q in queries for _ in range(16)]
    small = make_engine("stories260K", eos_token_ids=(), kv_pool_tokens=4096)
    ids = small.compile(docs)
    for r in requests:
        r.cache_ids = ids
    big = make_engine("stories260K", eos_token_ids=())
    big.compile(docs)
    alone = {tuple(q): big.generate_many([pic.Request(ids, q, max_new_tokens=150)])[0].token_ids for q in queries}
    outs = small.generate_many(requests, progress=False)
    assert sum(out.stats.num_preemptions for out in outs) > 0 and small.kv_stats().num_evicted_chunks > 0
    for request, out in zip(requests, outs, strict=True):
        assert out.token_ids == alone[tuple(request.query)]


def test_a_frozen_redis_fails_only_the_requests_that_need_it(paused_redis):
    """A request that needs a chunk only Redis holds, and a compile that writes through to it, wait on the frozen
    Redis and fail at its timeout; requests that need no Redis are served meanwhile: both finish while the other
    two are still waiting (an order; on the engine that did its store I/O on the step loop, they waited behind it
    and finished after the failures)."""
    url, freeze = paused_redis.url, paused_redis.pause
    store = pic.StoreConfig(redis_url=url, redis_timeout_s=REDIS_TIMEOUT_S, cpu_bytes=0)
    engine = make_engine("stories260K", eos_token_ids=())
    engine = pic.PIC(engine.model, engine.tokenizer, store=store, config=engine.config)
    other = pic.PIC(engine.model, engine.tokenizer, store=store, config=engine.config)
    resident = engine.compile(["Tom had a big red ball."])  # in engine's pool and in Redis
    only_in_redis = other.compile(["Lily loved to sing every morning."])  # not in engine's pool
    freeze()
    failures: list[Exception] = []

    def needs_redis() -> None:
        try:
            engine.link(only_in_redis, "Lily").generate(max_new_tokens=4)
        except Exception as exc:
            failures.append(exc)

    def compiles_while_frozen() -> None:
        try:
            engine.compile(["A new document written through to Redis."])
        except Exception as exc:
            failures.append(exc)

    start = time.perf_counter()
    waiting = [threading.Thread(target=needs_redis), threading.Thread(target=compiles_while_frozen)]
    for thread in waiting:
        thread.start()
    time.sleep(0.2)  # both are waiting on Redis now
    out = engine.link(resident, "Tom").generate(max_new_tokens=16)
    assert out.stats.num_generated_tokens == 16
    assert engine.generate_many([pic.Request([], "Once upon a time", max_new_tokens=16)])[0].token_ids
    assert not failures and all(t.is_alive() for t in waiting), "the requests that need no Redis waited for it"
    for thread in waiting:
        thread.join(WAIT_S)
    assert len(failures) == 2 and all(isinstance(e, StoreUnavailableError) for e in failures), failures
    assert time.perf_counter() - start >= REDIS_TIMEOUT_S  # they failed at their timeout, not before


def test_a_chunk_evicted_before_its_request_runs_is_compiled_again_from_its_tokens():
    """The server compiles a request's inline documents, then submits it: under load the chunk could be
    evicted in between (a 404 for an id the client never named). The engine keeps every chunk's tokens."""
    engine = make_engine("stories260K", kv_pool_tokens=1024, default_policy="naive")
    (cid,) = engine.compile(["Tom had a big red ball."])
    want = engine.link([cid], "Tom").generate(max_new_tokens=8).token_ids
    for doc in _documents(4, seed=2, vocab_size=engine.spec.vocab_size):  # one call each: each evicts the oldest
        engine.compile([doc])
    assert cid not in engine.store.ids()  # no tier holds it
    assert engine.link([cid], "Tom").generate(max_new_tokens=8).token_ids == want
    assert cid in engine.store.ids()


@pytest.mark.parametrize("policy", ["full", "legolink:16", "mepic"])
def test_a_recompute_pass_larger_than_the_budget_runs_in_pieces_and_links_as_one(policy):
    """Chunked prefill of a link: a static policy's pass over a 64-token budget runs over several steps
    beside the other work, with the logits and tokens of the pass run in one forward."""
    docs = _documents(3, seed=3, vocab_size=512)
    docs = [d[:100] for d in docs]
    results = []
    for budget in (64, 8192):
        engine = make_engine("stories260K", max_num_batched_tokens=budget)
        ids = engine.compile(docs)
        steps = engine.stepper().num_steps
        linked = engine.link(ids, "Once upon a time there was", policy=policy)
        results.append(
            (engine.stepper().num_steps - steps, linked.logits, linked.generate(max_new_tokens=12).token_ids)
        )
    (pieces, logits, tokens), (one, whole_logits, whole_tokens) = results
    assert one == 1 and (pieces >= 2) == (policy == "full")  # (the others recompute fewer than 64 tokens)
    assert torch.allclose(logits, whole_logits, atol=1e-4, rtol=0) and tokens == whole_tokens


def test_a_compile_beside_a_generation_that_fills_the_pool_waits_for_its_blocks():
    """Issue 49's fuzzer: a compile call that does not fit beside a running generation's blocks was refused with
    ``KVPoolExhaustedError`` although it fits alone and the generation would free them. It now waits for them (its
    prefills are scheduled work); one that does not fit once nothing runs still fails (tests/test_store.py)."""
    engine = make_engine("stories260K", eos_token_ids=(), kv_pool_tokens=256)  # 16 blocks
    ids = engine.compile(["Tom had a big red ball."])
    (doc,) = _documents(1, seed=8, vocab_size=engine.spec.vocab_size, num_tokens=60)  # 4 blocks with its BOS
    stream = engine.link(ids, [5, 6, 7], policy="naive").stream(max_new_tokens=400)
    for _ in stream:  # until the generation leaves fewer than 4 blocks (it ends with the pool, alone)
        if engine.kv_stats().num_available_blocks < 3:
            break
    (cid,) = engine.compile([doc], progress=False)
    assert engine.store.contains(cid) and "".join(stream)
    assert engine.kv_stats().num_used_blocks == 0
