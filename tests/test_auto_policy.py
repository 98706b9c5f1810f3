"""``auto``, the default: it links the chunks by relevance, reads where the question is and chooses ``regions``
(question before the chunks) or a probe's picks (question after them) within one budget, the probe counted. Pinned
on the accuracy workloads' real chat prompts in SmolLM2's template, both layouts, linked end to end."""

from __future__ import annotations

import pytest
import torch

import pic
from pic.evaluation.niah import niah_workload
from pic.evaluation.profiles import profile_workload
from pic.evaluation.qa import qa_workload
from pic.kv import ChunkKV
from pic.link import lay_out
from pic.link.policies.auto import question_before
from pic.link.probe import Probe
from pic.policies import Auto, ProphetKV, Regions

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
def test_the_default_reads_the_layout_and_picks_as_designed(smollm2, workload, question_first):
    assert smollm2.default_policy == Auto()
    for case in WORKLOADS[workload](question_first).cases:
        messages = case.messages()
        prefix, query = smollm2.chat_segments(messages)
        ids = smollm2.compile(list(case.documents), context=smollm2.chat_context(messages), progress=False)
        with smollm2.link(ids, query + case.answer_prefix, prefix=prefix) as linked:
            layout, by_layer = linked.layout, linked.recomputed_by_layer
            # in relevance order: the document holding the answer next to the question (BM25 ranks it first)
            assert linked.order.order is pic.Order.RELEVANCE and linked.order.indices[-1] in case.gold, case
            num_chunk, num_other = int(layout.cached.sum()), layout.num_tokens - int(layout.cached.sum())
            chunk_share = (sum(by_layer) - len(by_layer) * num_other) / (len(by_layer) * num_chunk)
            if workload == "qa":  # a 20-token query would take half the budget: no probe, the regions alone
                assert linked.policy == Regions(budget=0.2) and linked.probe is None
            elif question_first:
                assert linked.policy == Regions(budget=0.2, picks=0.5) and linked.probe is not None
            else:
                assert isinstance(linked.policy, ProphetKV) and linked.probe is not None
            # the chunk tokens' token-layers, the probe's rerun of the query included, stay within the budget
            # (Regions may take a window's remainder, ProphetKV rounds its count: a token either way)
            assert chunk_share <= 0.2 + 1.5 / num_chunk, (workload, chunk_share)


def test_question_before_needs_a_run_of_the_querys_tokens_in_the_prefix():
    template = [1, 2, 3]  # e.g. ChatML's "<|im_end|>\n<|im_start|>", in the prefix and the query alike
    question = [40, 41, 42, 43, 44, 45]
    assert question_before(_layout([9, *question, 9], [*question, *template]), 5)
    assert not question_before(_layout([9, *template, 9], [*question, *template]), 5)  # 3 shared tokens only
    assert not question_before(_layout([9, *question[:4], 9], question), 5)  # a run of 4 is not a question
    assert not question_before(_layout([], question), 5)  # no prefix: chunks start the prompt
    assert question_before(_layout([9, *question[:4], 9], question), 4)


def test_after_the_question_the_probe_is_paid_from_the_budget():
    chunk = tuple(range(100, 200))  # 100 chunk tokens; a 5-token query leaves 0.3 * 100 - 5 = 25 picks
    assert Auto(budget=0.3).for_layout(_layout([9], list(range(5)), [chunk])) == ProphetKV(ratio=0.25)
    # a 10-token query would cost a third of those 30 tokens (more than max_probe, a quarter): the regions alone
    assert Auto(budget=0.3).for_layout(_layout([9], list(range(10)), [chunk])) == Regions(budget=0.3)
    assert Auto(budget=0.3, max_probe=0.5).for_layout(_layout([9], list(range(10)), [chunk])) == ProphetKV(ratio=0.2)
    before = Auto(budget=0.3).for_layout(_layout(list(range(10)), list(range(10)), [chunk]))
    assert before == Regions(budget=0.3)  # the 10-token probe would cost a third of the 30 tokens: regions alone
    long_chunk = tuple(range(100, 300))
    before = Auto(budget=0.3).for_layout(_layout(list(range(10)), list(range(10)), [long_chunk]))
    assert before == Regions(budget=0.3, picks=0.5)  # a sixth of 60: the probe is worth its cost


def test_regions_with_picks_spends_the_budget_on_windows_then_the_probes_top_tokens():
    layout = _layout([9], [150, 151, 152, 153], [tuple(range(100, 200))])  # 100 chunk tokens from index 1
    mass = torch.zeros(1, layout.num_tokens)
    mass[0, 1:101] = torch.linspace(1e-3, 1e-4, 100)  # the query's attention falls off along the chunk ...
    mass[0, 1 + 10 : 1 + 13] = 1.0  # ... and is on chunk tokens 10-12 most
    probe = Probe(layout=layout, mass=mass, attention=mass, recomputed=~layout.cached)
    chosen = Regions(budget=0.3, picks=0.5).after_probe(probe)
    # 0.3 * 100 - 4 (the probe reran the query) = 26 tokens: 13 for the regions (the chunk's head, then 12 of
    # the window holding the query's words, up to its first match: chunk tokens 40-51), 13 for the picks
    # (10-12, then the next highest: 1-9 and 13)
    expected = {0, *range(40, 52), *range(1, 14)}
    assert set((chosen.nonzero()[:, 0] - 1).tolist()) == expected and len(expected) == 26


def test_auto_is_a_spec_and_cannot_be_run_without_a_layout():
    assert pic.policies.resolve("auto:0.25").budget == 0.25 and Auto().spec == "auto:0.2"
    assert pic.policies.resolve("auto:0.2,picks=0.25").picks == 0.25
    with pytest.raises(pic.PolicyError, match="budget"):
        pic.policies.resolve("auto:1.5")
    with pytest.raises(pic.PolicyError, match="for_layout"):
        Auto().select(_layout([9], [1, 2]))
