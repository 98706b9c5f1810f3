"""A seeded soak of the batched engine: 1,200 requests arriving at random steps, with random chunks,
orders, prefixes, query and output lengths, policies, sampling and aborts, through a KV pool so small
that running requests are preempted and resident chunks evicted (and promoted back from the CPU tier).

Every request must end (finished, or aborted) with the tokens and text it gets alone through the
one-at-a-time facade of an engine with a huge pool (an aborted one: a prefix of them), the pool's
invariants must hold after every step, and at the end no block may be referenced. The model is a
tiny Llama in float64, so that batching (other matrix shapes) cannot flip a greedy tie.
"""

from __future__ import annotations

import random

import pytest

import pic
from tests.kv_invariants import check_engine_pool
from tests.models import tiny_model, tokenizer

SEED = 20261122
NUM_REQUESTS = 1200
NUM_TEMPLATES = 48
POLICIES = ("naive", "full", "legolink:16", "mepic", "cacheblend:0.15")
POOL_TOKENS = 36 * 16  # a request needs at most ~27 blocks alone; 16 running need far more


def make_engine(**config) -> pic.PIC:
    model = tiny_model("llama").double()
    store = pic.StoreConfig(cpu_bytes=None)  # evicted chunks come back from the CPU tier
    return pic.PIC(model, tokenizer(), config=pic.PICConfig(**config), store=store)


def templates(rng: random.Random, ids: list[str]) -> list[pic.Request]:
    requests = []
    for i in range(NUM_TEMPLATES):
        chunks = rng.sample(ids, rng.randint(0, 4))
        query = [rng.randrange(3, 512) for _ in range(rng.randint(1, 12))]
        prefix = [rng.randrange(3, 512) for _ in range(rng.choice((0, 0, 5, 20)))]
        sampling = dict(temperature=0.8, top_k=50, seed=i) if i % 3 == 0 else {}
        policy = POLICIES[i % len(POLICIES)]
        new = rng.randint(1, 40)
        requests.append(pic.Request(chunks, query, prefix=prefix, policy=policy, max_new_tokens=new, **sampling))
    return requests


def alone(engine: pic.PIC, request: pic.Request) -> pic.Generation:
    params = request.sampling
    linked = engine.link(request.cache_ids, request.query, prefix=request.prefix, policy=request.policy)
    return linked.generate(params.max_new_tokens, temperature=params.temperature, top_k=params.top_k, seed=params.seed)


@pytest.mark.slow
def test_engine_soak_with_preemption_and_aborts():
    rng = random.Random(SEED)
    docs = [[rng.randrange(3, 512) for _ in range(rng.randint(10, 40))] for _ in range(12)]
    reference = make_engine(kv_pool_tokens=1 << 16)
    ids = reference.compile(docs)
    shapes = templates(rng, ids)
    expected = [alone(reference, r) for r in shapes]

    engine = make_engine(kv_pool_tokens=POOL_TOKENS, max_num_seqs=16, max_num_batched_tokens=256)
    assert engine.compile(docs) == ids
    core = engine.stepper()
    which: dict[int, int] = {}  # request id -> template
    tokens: dict[int, list[int]] = {}
    texts: dict[int, str] = {}
    ended: dict[int, pic.RequestOutput] = {}
    to_abort: dict[int, int] = {}  # step -> request id
    step = 0
    while len(which) < NUM_REQUESTS or core.has_unfinished():
        for _ in range(min(rng.choice((0, 0, 1, 3, 8)), NUM_REQUESTS - len(which))):
            t = rng.randrange(NUM_TEMPLATES)
            rid = core.add_request(shapes[t])
            which[rid], tokens[rid], texts[rid] = t, [], ""
            if rng.random() < 0.05:
                to_abort[step + rng.randint(0, 30)] = rid
        if step in to_abort:
            core.abort(to_abort.pop(step))
        for out in core.step():
            assert out.error is None, (step, which[out.request_id], out.error)
            tokens[out.request_id] += out.token_ids
            texts[out.request_id] += out.text
            if out.finished:
                ended[out.request_id] = out
        check_engine_pool(engine)
        step += 1
        assert step < 20_000, "the engine stopped making progress"

    assert len(ended) == NUM_REQUESTS
    reasons = {r: 0 for r in pic.FinishReason}
    for rid, out in ended.items():
        want, got = expected[which[rid]], out.generation
        reasons[got.stats.finish_reason] += 1
        assert got.token_ids == tokens[rid] and got.text == texts[rid]
        if got.stats.finish_reason is pic.FinishReason.ABORT:
            assert got.token_ids == want.token_ids[: len(got.token_ids)], rid
        else:
            assert (got.token_ids, got.text) == (want.token_ids, want.text), (rid, which[rid])
            assert got.stats.finish_reason == want.stats.finish_reason
    num_preemptions = sum(out.generation.stats.num_preemptions for out in ended.values())
    assert num_preemptions > 50 and reasons[pic.FinishReason.ABORT] > 10, (num_preemptions, reasons)
    assert engine.kv_stats().num_evicted_chunks > 0
    stats = engine.kv_stats()
    assert stats.num_used_blocks == 0 and stats.num_shared_block_refs == 0 and stats.num_private_blocks == 0
    check_engine_pool(engine, {})
    print(f"{step} steps, {num_preemptions} preemptions, {reasons}, {stats}")
