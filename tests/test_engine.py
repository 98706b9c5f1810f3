"""The batched engine: batched generation equals one-at-a-time generation, the iterative interface,
preemption, aborts, failures, and threads sharing one engine.

On ``PIC_TEST_DEVICE`` (tests/device.py). Tests that compare outputs token for token across batches run
in ``EXACT``: the test dtype, but float32 in place of bfloat16, where other batch shapes round differently
and flip greedy ties (see ``Target.exact_dtype``). In float32 that holds on CUDA too: the greedy steps of
these tests have top-2 margins of 6e-4 and more (measured on the CPU), float32 rounding of other shapes
moves logits by about 1e-5. In bfloat16, ``test_batched_linking_is_close_in_the_test_dtype``
holds batching to a logits tolerance instead, and the tests without such comparisons run in bfloat16.
"""

from __future__ import annotations

import threading

import pytest

import pic
from pic.engine import RequestOutput
from tests.conftest import make_target_engine
from tests.device import target, tolerances
from tests.kv_invariants import check_engine_pool
from tests.models import DOCS, PREFIX, QUERY

EXACT = target().exact_dtype

POLICIES = ("naive", "full", "legolink:16", "mepic", "cacheblend:0.15")


def mixed_requests(ids: list[str]) -> list[pic.Request]:
    """Every policy, several chunk sets and orders, prefixes, query lengths, greedy and seeded sampling."""
    orders = [ids, ids[::-1], ids[1:], [ids[2], ids[0]], ids[:1]]
    queries = [QUERY, "Then", QUERY + " the park and saw a dog.", "Lily", "One day"]
    requests = []
    for i, policy in enumerate(POLICIES):
        for j in range(2):
            k = (i + 2 * j) % len(orders)
            sampling = dict(temperature=0.9, top_p=0.9, seed=i) if j else {}
            prefix = PREFIX if (i + j) % 2 else ""
            requests.append(
                pic.Request(orders[k], queries[k], prefix=prefix, policy=policy, max_new_tokens=6 + 3 * i, **sampling)
            )
    return requests


def alone(engine: pic.PIC, request: pic.Request) -> pic.Generation:
    """The request through the one-at-a-time facade."""
    linked = engine.link(request.cache_ids, request.query, prefix=request.prefix, policy=request.policy)
    params = request.sampling
    return linked.generate(
        params.max_new_tokens, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
        seed=params.seed, stop=params.stop,
    )  # fmt: skip


def test_batched_generation_equals_one_at_a_time(family):
    engine = make_target_engine(family, dtype=EXACT)
    ids = engine.compile(list(DOCS))
    requests = mixed_requests(ids)
    expected = [alone(engine, r) for r in requests]
    steps_before = engine.stepper().num_steps
    batched = engine.generate_many(requests)
    for want, got in zip(expected, batched, strict=True):
        assert got.token_ids == want.token_ids and got.text == want.text
        assert got.stats.finish_reason == want.stats.finish_reason
        assert got.stats.num_recomputed_tokens == want.stats.num_recomputed_tokens
    core = engine.stepper()
    assert core.num_steps - steps_before < sum(len(g.token_ids) for g in batched) / 4  # many requests per forward
    check_engine_pool(engine, {})


def test_iterative_interface_streams_pieces_and_aborts():
    engine = make_target_engine("stories260K", dtype=EXACT)
    ids = engine.compile(list(DOCS))
    core = engine.stepper()
    first = core.add_request(pic.Request(ids, QUERY, max_new_tokens=30))
    second = core.add_request(pic.Request(ids[::-1], "Then", max_new_tokens=30, temperature=1.0, seed=3))
    outputs: dict[int, list[RequestOutput]] = {first: [], second: []}
    while core.has_unfinished():
        for out in core.step():
            outputs[out.request_id].append(out)
            if out.request_id == second and len(outputs[second]) == 10:
                core.abort(second)
    done = outputs[first][-1]
    assert done.finished and done.generation.stats.finish_reason is pic.FinishReason.LENGTH
    assert "".join(o.text for o in outputs[first]) == done.generation.text
    assert [t for o in outputs[first] for t in o.token_ids] == done.generation.token_ids
    assert done.generation.token_ids == engine.link(ids, QUERY).generate(30).token_ids
    aborted = outputs[second][-1].generation
    assert aborted.stats.finish_reason is pic.FinishReason.ABORT and len(aborted.token_ids) == 10
    assert aborted.token_ids == engine.link(ids[::-1], "Then").generate(30, temperature=1.0, seed=3).token_ids[:10]
    assert not any(o.finished for o in outputs[first][:-1])
    check_engine_pool(engine, {})


def test_preemption_keeps_outputs_and_frees_every_block():
    """A pool that holds only a few of the requests at once: the latest admitted are preempted and later
    recomputed over their prompt and generated tokens; each ends with the tokens it gets alone."""
    big = make_target_engine("stories260K", dtype=EXACT, kv_pool_tokens=4096)
    ids = big.compile(list(DOCS))
    linking = "auto:0.05,min_gain=1.0"  # auto without its floor on the gain: these short prompts share chunk blocks
    requests = [
        pic.Request(ids[i % 3 :] + ids[: i % 3], f"Tom and Lily {i}", max_new_tokens=40, policy=linking)
        for i in range(8)
    ]
    expected = [alone(big, r).token_ids for r in requests]
    small = make_target_engine("stories260K", dtype=EXACT, kv_pool_tokens=16 * 40)
    assert small.compile(list(DOCS)) == ids
    got = small.generate_many(requests)
    assert [g.token_ids for g in got] == expected
    assert sum(g.stats.num_preemptions for g in got) > 0
    check_engine_pool(small, {})


def test_failed_requests_do_not_disturb_the_others():
    engine = make_target_engine("stories260K", dtype=EXACT)
    ids = engine.compile(list(DOCS))
    good = pic.Request(ids, QUERY, max_new_tokens=8)
    with pytest.raises(pic.UnknownCacheIdError, match="nope"):
        engine.generate_many([good, pic.Request(["nope"], QUERY), good])
    with pytest.raises(pic.InvalidInputError, match="temperature"):
        pic.Request(ids, QUERY, temperature=-1.0)
    with pytest.raises(pic.PolicyError, match="nosuch"):
        pic.Request(ids, QUERY, policy="nosuch")
    with pytest.raises(pic.InvalidInputError, match="no tokens"):
        engine.stepper().add_request(pic.Request(ids, ""))
    assert [g.token_ids for g in engine.generate_many([good, good])] == [alone(engine, good).token_ids] * 2
    check_engine_pool(engine, {})


def test_a_request_larger_than_the_pool_fails_alone():
    engine = make_target_engine("stories260K", kv_pool_tokens=16 * 8)
    ids = engine.compile(list(DOCS))
    with pytest.raises(pic.KVPoolExhaustedError, match="blocks"):
        engine.generate_many([pic.Request(ids, QUERY * 3)])
    check_engine_pool(engine, {})


def test_eight_threads_link_and_generate_at_once():
    """Eight threads calling link(...).generate() on one engine each get their single-thread result,
    and their requests share forwards."""
    engine = make_target_engine("stories260K", dtype=EXACT)
    ids = engine.compile(list(DOCS))
    jobs = [(ids[i % 3 :] + ids[: i % 3], f"{QUERY} {i}", POLICIES[i % 5], i % 2) for i in range(8)]

    def run(i: int) -> list[int]:
        order, query, policy, sampled = jobs[i]
        options = dict(temperature=1.0, seed=i) if sampled else {}
        return engine.link(order, query, policy=policy).generate(24, **options).token_ids

    single = [run(i) for i in range(8)]
    core = engine.stepper()
    steps, seqs = core.num_steps, core.num_batched_seqs
    barrier = threading.Barrier(8)
    together: dict[int, list[int]] = {}

    def worker(i: int) -> None:
        barrier.wait()
        together[i] = run(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert [together.get(i) for i in range(8)] == single
    assert (core.num_batched_seqs - seqs) / (core.num_steps - steps) > 2  # batched, not one at a time
    check_engine_pool(engine, {})


def test_stream_pieces_equal_the_text_with_byte_tokens():
    """A regression: byte-fallback tokens once made the streamed pieces differ from ``generate().text``.
    Both run alone, the same shapes: the same tokens in any dtype."""
    engine = make_target_engine("qwen2")
    ids = engine.compile(list(DOCS))
    text = engine.link(ids, QUERY, prefix=PREFIX, policy="naive").generate(12).text
    pieces = list(engine.link(ids, QUERY, prefix=PREFIX, policy="naive").stream(12))
    assert "".join(pieces) == text and len(pieces) > 3


def test_batched_linking_is_close_in_the_test_dtype():
    """The engine in the test dtype (bfloat16 in a bfloat16 run): linked requests admitted together get
    the logits they get alone, within ``batch_logits``; generated together, each runs to its length or
    an EOS, recomputes what it recomputes alone, and the pool ends empty. (Token equality across batches:
    ``test_batched_generation_equals_one_at_a_time``, in ``EXACT``.)"""
    engine = make_target_engine("stories260K", max_num_batched_tokens=8192)  # a budget that holds them all
    ids = engine.compile(list(DOCS))
    requests = mixed_requests(ids)
    steps = engine.stepper().num_steps
    linked = engine.link_many(requests)
    assert engine.stepper().num_steps - steps == 1  # one forward for all their recompute passes
    together = [item.logits for item in linked]
    for item in linked:
        item.release()
    for r, logits in zip(requests, together, strict=True):
        alone_logits = engine.link(r.cache_ids, r.query, prefix=r.prefix, policy=r.policy).logits
        assert (logits - alone_logits).abs().max().item() <= tolerances().batch_logits
    expected = [alone(engine, r) for r in requests]
    for request, want, got in zip(requests, expected, engine.generate_many(requests), strict=True):
        reason = got.stats.finish_reason
        assert reason is pic.FinishReason.EOS or len(got.token_ids) == request.sampling.max_new_tokens
        assert reason is not pic.FinishReason.EOS or got.token_ids[-1] in engine.eos_token_ids
        assert got.stats.num_recomputed_tokens == want.stats.num_recomputed_tokens
    check_engine_pool(engine, {})
