"""The engine schedules all its work (issue 32): a compile never stalls running streams, preemption keeps
what a request needs, and a hung store stalls only the requests that need it.

Each test reproduces a defect of the engine before its scheduler took compiles and store I/O: on that
engine, the first saw a 0.7-1.2 s gap, the second ``UnknownCacheIdError`` for an evicted chunk, the third a
9.5 s completion that needed no Redis.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

import pic
from pic.errors import StoreUnavailableError
from tests.conftest import make_engine

NUM_DOC_TOKENS = 290


def _documents(num: int, *, seed: int, vocab_size: int, num_tokens: int = NUM_DOC_TOKENS) -> list[list[int]]:
    """``num`` distinct documents of token ids (new to any cache: the seed makes them differ)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(num_tokens)] for _ in range(num)]


def _stream_gaps(engine: pic.PIC, ids: list[str], stop: threading.Event, times: list[float]) -> None:
    """Stream tokens until ``stop``, recording when each piece arrived (re-linking when a generation ends)."""
    while not stop.is_set():
        for _ in engine.link(ids, [5, 6, 7], policy="naive").stream(max_new_tokens=400):
            times.append(time.perf_counter())
            if stop.is_set():
                break


def test_a_compile_of_60_documents_never_stalls_a_stream_for_more_than_a_step():
    engine = make_engine("stories260K", eos_token_ids=(), kv_pool_tokens=1 << 16)  # the default budget: 256 tokens
    ids = engine.compile(["Tom had a big red ball.", "Lily loved to sing."])
    docs = _documents(60, seed=1, vocab_size=engine.spec.vocab_size)
    stop, times = threading.Event(), []
    streamer = threading.Thread(target=_stream_gaps, args=(engine, ids, stop, times))
    streamer.start()
    time.sleep(0.3)
    start = time.perf_counter()
    compiled = engine.compile(docs, progress=False)
    end = time.perf_counter()
    time.sleep(0.1)
    stop.set()
    streamer.join(30)
    assert len(set(compiled)) == 60 and all(engine.store.contains(cid) for cid in compiled)
    during = [t for t in times if start <= t <= end + 0.25]
    gaps = [b - a for a, b in zip([start, *during], [*during, end], strict=True)]
    assert len(during) > 10, f"{len(during)} tokens in the {end - start:.2f} s compile"
    assert max(gaps) < 0.25, f"longest gap {max(gaps):.3f} s during a {end - start:.2f} s compile"


def _first_token_s(engine: pic.PIC, ids: list[str]) -> float:
    """Seconds until 4 default requests sent together (the default policy over ``ids``, 4 queries) all have their
    first token (their only one). Four, not one: alone a request takes about one step of a 256-token compile
    piece on this model, so one step under way would be most of its ratio, and a loaded machine's noise the
    rest; four take several steps, and the ratio measures the scheduling, not the step under way."""
    start = time.perf_counter()
    requests = [pic.Request(ids, [5, 6, 7 + i], max_new_tokens=1) for i in range(4)]
    engine.generate_many(requests, progress=False)
    return time.perf_counter() - start


def _wait_for_compile(engine: pic.PIC, num_before: int, compiling: threading.Thread) -> None:
    """Return once a few chunks of the compile under way are resident (so it has started, and goes on)."""
    while engine.kv_stats().num_resident_chunks < num_before + 3:
        assert compiling.is_alive(), "the compile ended before a request could arrive during it"
        time.sleep(0.005)


def test_a_request_arriving_during_a_60_document_compile_is_served_first():
    """Issue 43: prefill work was first come first served, so a request that arrived during a bulk compile got its
    first token when the compile was done (734 ms of an 800 ms compile; alone, a few ms). Links and generations
    now go first (``PrefillOrder.INTERACTIVE``): it waits for the step under way and its own. Meanwhile a running
    stream keeps its pace and the compile completes. (Medians of 5 alone and 3 during the compile; the bound is
    the issue's: 3x alone, and 0.25 s; the requests come 4 at a time: ``_first_token_s``.)"""
    engine = make_engine("stories260K", eos_token_ids=(), kv_pool_tokens=1 << 16)  # the default budget: 256 tokens
    stream_ids = engine.compile(["Tom had a big red ball.", "Lily loved to sing."])
    ids = engine.compile(_documents(3, seed=2, vocab_size=engine.spec.vocab_size, num_tokens=150), progress=False)
    alone = sorted(_first_token_s(engine, ids) for _ in range(5))[2]
    stop, times, compiled = threading.Event(), [], []
    streamer = threading.Thread(target=_stream_gaps, args=(engine, stream_ids, stop, times))
    streamer.start()
    time.sleep(0.3)
    docs = _documents(60, seed=3, vocab_size=engine.spec.vocab_size)
    compiling = threading.Thread(target=lambda: compiled.extend(engine.compile(docs, progress=False)))
    num_before = engine.kv_stats().num_resident_chunks
    start = time.perf_counter()
    compiling.start()
    _wait_for_compile(engine, num_before, compiling)
    during = sorted(_first_token_s(engine, ids) for _ in range(3))
    assert compiling.is_alive(), "the compile ended before the requests did: they did not arrive during it"
    compiling.join(60)
    end = time.perf_counter()
    stop.set()
    streamer.join(30)
    assert len(set(compiled)) == 60 and all(engine.store.contains(cid) for cid in compiled)
    assert during[1] < min(3 * alone, 0.25), f"first token {during} s during the compile, {alone:.3f} s alone"
    stream = [t for t in times if start <= t <= end + 0.25]
    gaps = [b - a for a, b in zip([start, *stream], [*stream, end], strict=True)]
    assert len(stream) > 10 and max(gaps) < 0.25, f"{len(stream)} tokens, longest gap {max(gaps):.3f} s"


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
    url, freeze = paused_redis.url, paused_redis.pause
    store = pic.StoreConfig(redis_url=url, redis_timeout_s=2.0, cpu_bytes=0)
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
    began = time.perf_counter()
    out = engine.link(resident, "Tom").generate(max_new_tokens=16)
    assert time.perf_counter() - began < 1.0 and out.stats.num_generated_tokens == 16
    began = time.perf_counter()
    assert engine.generate_many([pic.Request([], "Once upon a time", max_new_tokens=16)])[0].token_ids
    assert time.perf_counter() - began < 1.0
    for thread in waiting:
        thread.join(30)
    assert len(failures) == 2 and all(isinstance(e, StoreUnavailableError) for e in failures), failures
    assert time.perf_counter() - start >= 2.0  # they failed at their timeout, not before


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
