"""The order a link's chunks run in: ``order="given"`` keeps the caller's prompt token for token, ``"relevance"``
puts the most relevant chunk last (by the caller's scores, else BM25 over token ids), and what ran is reported
(``Linked.order``, ``Linked.cache_ids``, ``Linked.input_ids``, ``GenerationStats.chunk_order``)."""

from __future__ import annotations

import pytest
import torch

import pic
from pic.link.order import ChunkOrder, Order, bm25, chunk_order, parse_order

DOCS = ["Tom had a big red ball.", "Lily loved to sing songs.", "The cat sat on the warm mat."]
QUERY = " Tom and the red ball"


def _tokens(engine: pic.PIC, text: str) -> list[int]:
    return engine.tokenizer(text, add_special_tokens=False).input_ids


def _expected(engine: pic.PIC, ids: list[str], order: list[int], prefix: str = "") -> list[int]:
    """The prompt of ``prefix + DOCS[order...] + QUERY`` as pic lays it out (BOS on the prefix and on each chunk)."""
    bos = [engine.bos_token_id]
    chunks = [bos + _tokens(engine, DOCS[i]) for i in order]
    return (bos + _tokens(engine, prefix) if prefix else []) + sum(chunks, []) + _tokens(engine, QUERY)


def test_given_keeps_the_callers_prompt_token_for_token(stories):
    ids = stories.compile(DOCS)
    for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
        with stories.link([ids[i] for i in order], QUERY, prefix="A story:", order="given") as linked:
            assert linked.input_ids.tolist() == _expected(stories, ids, order, prefix="A story:")
            assert linked.order == ChunkOrder(Order.GIVEN, (0, 1, 2)) and not linked.order.moved
            assert linked.cache_ids == [ids[i] for i in order]


def test_relevance_puts_the_most_relevant_last_and_reports_it(stories):
    ids = stories.compile(DOCS)
    scores = bm25(_tokens(stories, QUERY), [_tokens(stories, d) for d in DOCS])
    want = sorted(range(3), key=lambda i: scores[i])
    assert want != [0, 1, 2] and scores[want[-1]] > scores[want[0]]  # the case can fail: the order moves
    with stories.link(ids, QUERY, order="relevance", policy="full") as linked:
        assert linked.order == ChunkOrder(Order.RELEVANCE, tuple(want)) and linked.order.moved
        assert linked.cache_ids == [ids[i] for i in want]
        assert linked.input_ids.tolist() == _expected(stories, ids, want)
        logits = linked.logits
    # the reordered link is the link of the reordered ids: the same prompt, the same logits (Full Recompute)
    with stories.link([ids[i] for i in want], QUERY, order="given", policy="full") as same:
        torch.testing.assert_close(same.logits, logits, rtol=0, atol=0)


def test_the_callers_relevance_scores_decide_and_ties_keep_the_given_order(stories):
    ids = stories.compile(DOCS)
    with stories.link(ids, QUERY, order="relevance", relevance=[0.9, 0.1, 0.5]) as linked:
        assert linked.order.indices == (1, 2, 0)
    with stories.link(ids, QUERY, order="relevance", relevance=[1.0, 1.0, 1.0]) as linked:
        assert linked.order.indices == (0, 1, 2)  # a stable sort: equal scores stay where they were


def test_every_built_in_policy_but_auto_keeps_the_given_order_by_default(stories):
    ids = stories.compile(DOCS)
    for policy in ("full", "naive", "mepic", "legolink:4", "regions", "prophetkv:0.2", "suffix:0.2"):
        with stories.link(ids, QUERY, policy=policy) as linked:
            assert linked.order.order is Order.GIVEN and linked.cache_ids == ids, policy
    with stories.link(ids, QUERY, policy="auto:0.05,min_gain=1.0") as linked:  # auto, linking: by relevance
        assert linked.policy.name != "auto" and linked.order.order is Order.RELEVANCE and linked.order.moved
    with stories.link(ids, QUERY) as linked:  # the default on a prompt too short to win: Full Recompute, as given
        assert linked.policy.name == "full" and linked.order.order is Order.GIVEN and linked.cache_ids == ids
    with stories.link(ids, QUERY, order="given") as linked:  # unless the link asks for the caller's order
        assert linked.order.order is Order.GIVEN and linked.cache_ids == ids


def test_a_generation_reports_its_order(stories):
    ids = stories.compile(DOCS)
    out = stories.link(ids, QUERY, order="relevance").generate(max_new_tokens=3)
    assert out.stats.chunk_order.order is Order.RELEVANCE and sorted(out.stats.chunk_order.indices) == [0, 1, 2]
    [gen] = stories.generate_many([pic.Request(ids, QUERY, order="given", max_new_tokens=3)])
    assert gen.stats.chunk_order == ChunkOrder(Order.GIVEN, (0, 1, 2))


@pytest.mark.parametrize("bad", ["random", "", 3, None])
def test_an_unknown_order_is_refused_naming_it(stories, bad):
    ids = stories.compile(DOCS[:1])
    if bad is None:  # None is the default (the policy's choice: auto's is relevance), not an error
        assert stories.link(ids, QUERY, order=bad, policy="auto:0.05,min_gain=1.0").order.order is Order.RELEVANCE
        assert stories.link(ids, QUERY, order=bad, policy="full").order.order is Order.GIVEN
        return
    with pytest.raises(pic.InvalidInputError, match=f"order is {bad!r}"):
        stories.link(ids, QUERY, order=bad)
    with pytest.raises(pic.InvalidInputError, match=f"order is {bad!r}"):
        pic.Request(ids, QUERY, order=bad)


def test_parse_and_apply():
    assert parse_order("relevance") is Order.RELEVANCE and parse_order(Order.GIVEN) is Order.GIVEN
    order = chunk_order(Order.RELEVANCE, [5, 6], [[1, 2], [5, 9], [6, 6, 5]])
    assert order.indices == (0, 1, 2) or order.indices[-1] == 2
    assert ChunkOrder(Order.RELEVANCE, (2, 0, 1)).apply(["a", "b", "c"]) == ["c", "a", "b"]
    with pytest.raises(pic.InvalidInputError, match="2 items for an order of 3 chunks"):
        ChunkOrder(Order.RELEVANCE, (2, 0, 1)).apply(["a", "b"])


def test_a_preempted_request_keeps_its_order():
    """A tight pool preempts running requests; each is laid out again in the order it first ran in, and ends
    as it does alone."""
    from tests.conftest import make_engine

    docs = [[10 + i] * 20 for i in range(3)]  # token ids: 2 blocks each
    small = make_engine("llama", eos_token_ids=(), kv_pool_tokens=256, block_size=16)
    big = make_engine("llama", eos_token_ids=())
    ids = small.compile(docs)
    assert big.compile(docs) == ids
    linking = "auto:0.05,min_gain=1.0"  # auto without its floor on the gain: the short prompts share chunk blocks
    requests = [pic.Request(ids, [5, 6, 7, i], order="relevance", relevance=[3, 1, 2], max_new_tokens=60,
                            policy=linking) for i in range(6)]  # fmt: skip
    alone = [big.generate_many([r])[0].token_ids for r in requests]
    outs = small.generate_many(requests)
    assert sum(o.stats.num_preemptions for o in outs) > 0  # the case exercises a preemption
    assert all(o.stats.chunk_order.indices == (1, 2, 0) for o in outs)
    assert [o.token_ids for o in outs] == alone


def test_a_policy_that_still_overrides_order_for_is_refused_at_its_definition():
    """``Policy.order`` (a class attribute) replaced ``order_for(layout)``: a custom policy that overrides the old
    hook is refused when its class is made, naming the attribute to set, instead of running in the caller's order."""
    from pic.link.policies.base import Policy

    with pytest.raises(pic.PolicyError, match="defines order_for.*order = Order.RELEVANCE"):

        class OldStyle(Policy):  # noqa: F841 (refused before it exists)
            name = "old_style"

            def select(self, layout):
                return None

            def order_for(self, layout):
                return Order.RELEVANCE
