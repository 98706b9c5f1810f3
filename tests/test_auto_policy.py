"""``auto``, the default: the chunks in relevance order, the last (most relevant) ones recomputed whole, at least
``budget`` and at most ``max_share`` of the chunk tokens (else the best regions within that share), and
no probe. Pinned on the accuracy workloads' real chat prompts in SmolLM2's template, both layouts, linked end to end,
and on hand-made layouts for the rule's edges."""

from __future__ import annotations

import pytest
import torch

import pic
from pic.evaluation.niah import niah_workload
from pic.evaluation.profiles import profile_workload
from pic.evaluation.qa import qa_workload
from pic.kv import ChunkKV
from pic.link import lay_out
from pic.policies import Auto, Regions, Suffix

WORKLOADS = {
    "qa": lambda first: qa_workload(num_cases=2, question_first=first, seed=3),
    "profiles": lambda first: profile_workload(num_cases=2, question_first=first, seed=3),
    "niah": lambda first: niah_workload(num_cases=2, kind="multikey", haystack_tokens=1000, chunk_tokens=256,
                                        question_first=first, seed=3),
}  # fmt: skip


def _layout(prefix: list[int], query: list[int], chunks=((5, 6, 7),)):
    empty = torch.empty(0)
    kvs = [ChunkKV(f"c{i}", torch.tensor(ids), empty, empty, pic.CompileOptions()) for i, ids in enumerate(chunks)]
    return lay_out(prefix=prefix, chunks=kvs, query=query, block_size=4)


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
@pytest.mark.parametrize("question_first", [True, False], ids=["question-before", "question-after"])
def test_the_default_recomputes_the_most_relevant_chunk_whole(smollm2, workload, question_first):
    assert smollm2.default_policy == Auto()
    for case in WORKLOADS[workload](question_first).cases:
        messages = case.messages()
        prefix, query = smollm2.chat_segments(messages)
        ids = smollm2.compile(list(case.documents), context=smollm2.chat_context(messages), progress=False)
        with smollm2.link(ids, query + case.answer_prefix, prefix=prefix) as linked:
            layout, recomputed, by_layer = linked.layout, linked.recomputed, linked.recomputed_by_layer
            # in relevance order: the document holding the answer next to the question (BM25 ranks it first) ...
            assert linked.order.order is pic.Order.RELEVANCE and linked.order.indices[-1] in case.gold, case
            # ... recomputed whole, and no other chunk token; every layer alike, one pass, no probe
            last = layout.chunks[-1]
            whole = ~layout.cached
            whole[last.token_start : last.token_start + last.num_tokens] = True
            assert linked.probe is None and by_layer == (int(recomputed.sum()),) * smollm2.spec.num_layers
            assert linked.policy == Suffix(ratio=0.05, whole=True) and torch.equal(recomputed, whole)
            assert last.num_tokens <= 0.5 * int(layout.cached.sum())  # under the ceiling


def test_whole_chunks_from_the_last_until_they_hold_the_budget():
    chunks = [tuple(range(100, 140)), tuple(range(200, 230)), tuple(range(300, 320))]  # 40, 30, 20 tokens
    layout = _layout([9], [1, 2], chunks)
    for budget, num_whole in ((0.05, 20), (0.22, 20), (0.23, 50), (0.6, 90)):
        policy = Auto(budget=budget, max_share=1.0).for_layout(layout)
        assert policy == Suffix(ratio=budget, whole=True)
        chosen = policy.recompute_mask(layout) & layout.cached
        assert int(chosen.sum()) == num_whole and bool(chosen[layout.chunks[-1].tokens].all()), budget


@pytest.mark.parametrize(("num_chunks", "num_recomputed"), [(4, 256), (8, 256), (16, 256), (32, 512)])
def test_a_longer_prompt_of_more_documents_recomputes_a_smaller_share(num_chunks, num_recomputed):
    """The budget is a floor in whole chunks: one 256-token document of a prompt of 1K, 2K or 4K chunk tokens (two of
    8K: 5% is 410 tokens), so the link's speedup grows with the prompt (docs/policies.md: 4x at 2K tokens, 5x at
    4K)."""
    chunks = [tuple(range(1000 * i, 1000 * i + 256)) for i in range(num_chunks)]
    layout = _layout(list(range(20)), list(range(30)), chunks)
    policy = Auto().for_layout(layout)
    chosen = policy.recompute_mask(layout)
    assert policy == Suffix(ratio=0.05, whole=True) and int((chosen & layout.cached).sum()) == num_recomputed
    assert bool(chosen[layout.chunks[-1].tokens].all())


def test_over_the_ceiling_the_best_regions_within_it():
    chunks = [tuple(range(100, 160)), tuple(range(200, 340))]  # 60 and 140 chunk tokens: the last is 70%
    layout = _layout([9, 8, 7, 6], [1, 2, 3, 4, 5], chunks)
    assert Auto().for_layout(layout) == Regions(budget=0.5)  # half the chunk tokens, the best regions
    recomputed = Regions(budget=0.5).recompute_mask(layout) & layout.cached
    assert int(recomputed.sum()) <= 100
    assert Auto(max_share=0.7).for_layout(layout) == Suffix(ratio=0.05, whole=True)  # 140 of 200 fits 70%
    # the prefix and query are not counted: a long query over short chunks still recomputes the last whole
    short = _layout(list(range(50)), list(range(50)), [tuple(range(100, 112)), tuple(range(200, 210))])
    assert Auto().for_layout(short) == Suffix(ratio=0.05, whole=True)


def test_auto_is_a_spec_and_cannot_be_run_without_a_layout():
    assert pic.policies.resolve("auto:0.25").budget == 0.25 and Auto().spec == "auto:0.05"
    assert pic.policies.resolve("auto:0.1,max_share=0.6").max_share == 0.6
    with pytest.raises(pic.PolicyError, match="budget"):
        pic.policies.resolve("auto:1.5")
    with pytest.raises(pic.PolicyError, match="max_share"):
        pic.policies.resolve("auto:0.1,max_share=0")
    with pytest.raises(pic.PolicyError, match="for_layout"):
        Auto().select(_layout([9], [1, 2]))
