"""``auto``, the default: the chunks in relevance order, the last (most relevant) ones recomputed whole, at least
``budget`` and at most ``max_share`` of the chunk tokens (else the best regions within that share), and
no probe; Full Recompute in the caller's order where the prompt is less than ``min_gain`` times what that recomputes
(a short prompt, one document). Pinned on the accuracy workloads' real chat prompts in SmolLM2's template, both
layouts, linked end to end, and on hand-made layouts for the rule's edges."""

from __future__ import annotations

import pytest
import torch

import pic
from pic.evaluation.niah import niah_workload
from pic.evaluation.profiles import profile_workload
from pic.evaluation.qa import qa_workload
from pic.evaluation.twohop import twohop_workload
from pic.kv import ChunkKV
from pic.link import lay_out
from pic.link.policies.builtin import MIN_GAIN, AutoChoice, AutoPlan, auto_plan
from pic.policies import Auto, FullRecompute, Regions, Suffix

WORKLOADS = {
    "qa": lambda first: qa_workload(num_cases=2, question_first=first, seed=3),
    "profiles": lambda first: profile_workload(num_cases=2, question_first=first, seed=3),
    "niah": lambda first: niah_workload(num_cases=2, kind="multikey", haystack_tokens=1000, chunk_tokens=256,
                                        question_first=first, seed=3),
    "twohop": lambda first: twohop_workload(num_cases=2, question_first=first, seed=3),
    "niah-long": lambda first: niah_workload(num_cases=2, kind="single", haystack_tokens=2700, chunk_tokens=256,
                                             question_first=first, seed=3),
}  # fmt: skip
# qa's prompts, about 230 tokens, are too short to win (the last document whole and the chat around it are near 40% of
# the prompt): test_a_prompt_too_short_to_win_runs_full_recompute_as_given pins them
LONG_ENOUGH = sorted(set(WORKLOADS) - {"qa"})


def _layout(prefix: list[int], query: list[int], chunks=((5, 6, 7),)):
    empty = torch.empty(0)
    kvs = [ChunkKV(f"c{i}", torch.tensor(ids), empty, empty, pic.CompileOptions()) for i, ids in enumerate(chunks)]
    return lay_out(prefix=prefix, chunks=kvs, query=query, block_size=4)


@pytest.mark.parametrize("workload", LONG_ENOUGH)
@pytest.mark.parametrize("question_first", [True, False], ids=["question-before", "question-after"])
def test_the_default_recomputes_the_most_relevant_chunk_whole(smollm2, workload, question_first):
    """On every workload's real prompts: the link ``auto`` would run (``min_gain=1``: linked whatever the length) puts
    the gold document last and recomputes it whole; the default runs that link where the prompt is at least
    ``MIN_GAIN`` times what it recomputes, else Full Recompute in the caller's order."""
    assert smollm2.default_policy == Auto()
    for case in WORKLOADS[workload](question_first).cases:
        messages = case.messages()
        prefix, query = smollm2.chat_segments(messages)
        ids = smollm2.compile(list(case.documents), context=smollm2.chat_context(messages), progress=False)
        with smollm2.link(ids, query + case.answer_prefix, prefix=prefix, policy="auto:0.05,min_gain=1.0") as linked:
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
            wins = layout.num_tokens >= MIN_GAIN * int(recomputed.sum())
        with smollm2.link(ids, query + case.answer_prefix, prefix=prefix) as default:
            if wins:
                assert default.policy == linked.policy and torch.equal(default.input_ids, linked.input_ids)
            else:
                assert default.policy == FullRecompute() and not default.order.moved and bool(default.recomputed.all())


def test_whole_chunks_from_the_last_until_they_hold_the_budget():
    chunks = [tuple(range(100, 140)), tuple(range(200, 230)), tuple(range(300, 320))]  # 40, 30, 20 tokens
    layout = _layout([9], [1, 2], chunks)
    for budget, num_whole in ((0.05, 20), (0.22, 20), (0.23, 50), (0.6, 90)):
        policy = Auto(budget=budget, max_share=1.0, min_gain=1.0).for_layout(layout)
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
    rule = {"min_gain": 1.0}  # the ceiling's own rule, whatever the gain
    assert Auto(**rule).for_layout(layout) == Regions(budget=0.5)  # half the chunk tokens, the best regions
    recomputed = Regions(budget=0.5).recompute_mask(layout) & layout.cached
    assert int(recomputed.sum()) <= 100
    assert Auto(max_share=0.7, **rule).for_layout(layout) == Suffix(ratio=0.05, whole=True)  # 140 of 200 fits 70%
    # the prefix and query are not counted in the share: a long query over short chunks recomputes the last whole
    short = _layout(list(range(50)), list(range(50)), [tuple(range(100, 112)), tuple(range(200, 210))])
    assert Auto(**rule).for_layout(short) == Suffix(ratio=0.05, whole=True)


def test_auto_is_a_spec_and_cannot_be_run_without_a_layout():
    assert pic.policies.resolve("auto:0.25").budget == 0.25 and Auto().spec == "auto:0.05"
    assert pic.policies.resolve("auto:0.1,max_share=0.6").max_share == 0.6
    with pytest.raises(pic.PolicyError, match="budget"):
        pic.policies.resolve("auto:1.5")
    with pytest.raises(pic.PolicyError, match="max_share"):
        pic.policies.resolve("auto:0.1,max_share=0")
    with pytest.raises(pic.PolicyError, match="for_layout"):
        Auto().select(_layout([9], [1, 2]))


def _docs(*lengths: int) -> list[tuple[int, ...]]:
    return [tuple(range(1000 * (i + 1), 1000 * (i + 1) + n)) for i, n in enumerate(lengths)]


@pytest.mark.parametrize(
    ("what", "prefix", "query", "lengths", "chosen"),
    [
        ("a short prompt", 30, 30, (50, 50, 50, 50), FullRecompute()),  # 110 of 260 recomputed: 2.4x at best
        ("paragraphs", 30, 30, (300, 300, 300), FullRecompute()),  # 360 of 960: 2.7x at best
        ("at the line", 30, 30, (80, 80, 80, 80, 80), Suffix(ratio=0.05, whole=True)),  # 140 of 460: 3.3x
        ("just under", 40, 60, (100, 100, 100), FullRecompute()),  # 200 of 400: 2x
        ("one document", 30, 30, (2000,), FullRecompute()),  # its regions, half of it, and the chat: under 2x
        ("two documents", 30, 30, (600, 600), FullRecompute()),  # one whole is half of them: under 2x
        ("two documents, the last short", 30, 30, (1200, 300), Suffix(ratio=0.05, whole=True)),  # 360 of 1,560
        ("over the ceiling", 30, 30, (300, 300, 300, 300, 1600), FullRecompute()),  # regions of half: 2x at best
        ("a long prompt", 30, 30, (300,) * 8, Suffix(ratio=0.05, whole=True)),  # 360 of 2,460: 6.8x
    ],
)
def test_the_default_chooses_by_layout_length_and_document_count(what, prefix, query, lengths, chosen):
    """The rule read from the counts alone (``auto_plan``): Full Recompute where the prompt is less than ``min_gain``
    (3) times what the link would recompute, else the last document whole (or the ceiling's regions)."""
    layout = _layout(list(range(prefix)), list(range(1, query + 1)), _docs(*lengths))
    assert Auto().for_layout(layout) == chosen, what


def test_a_lower_ceiling_leaves_room_for_its_regions():
    """The ceiling's regions recompute ``max_share`` of the chunk tokens: at the default half a link of them is under
    2x (Full Recompute runs); at 30% one is 3.2x, and they run."""
    layout = _layout(list(range(30)), list(range(1, 31)), _docs(300, 300, 300, 300, 1600))
    assert Auto(max_share=0.3).for_layout(layout) == Regions(budget=0.3)


def test_the_rule_is_the_connectors_too():
    """vLLM's connector runs the same counts (``VllmSuffix.num_recomputed``): every chunk token where the engine runs
    Full Recompute, the last whole document where it recomputes that."""
    from pic.vllm.params import parse_policy

    auto = parse_policy("auto")
    assert auto.num_recomputed([50] * 4, 60) == 200 and auto.keeps_given_order([50] * 4, 60)
    assert auto.num_recomputed([300] * 8, 60) == 300 and not auto.keeps_given_order([300] * 8, 60)
    plan = auto_plan([300] * 8, 60, budget=0.05, max_share=0.5, min_gain=3.0)
    assert plan == AutoPlan(AutoChoice.WHOLE_CHUNKS, 300)
    assert auto_plan([50] * 4, 60, budget=0.05, max_share=0.5, min_gain=3.0).choice is AutoChoice.FULL


def test_two_whole_documents_when_asked():
    layout = _layout(list(range(10)), list(range(1, 11)), _docs(100, 200, 300, 400))
    policy = Auto(min_chunks=2, max_share=1.0, min_gain=1.0).for_layout(layout)
    assert int((policy.recompute_mask(layout) & layout.cached).sum()) == 700  # the last two, whole
    assert Auto(min_chunks=2, min_gain=1.0).for_layout(layout) == Regions(budget=0.5)  # 700 of 1,000: over 50%


def test_a_prompt_too_short_to_win_runs_full_recompute_as_given(smollm2):
    """The qa workload's prompts asked first (about 230 tokens; its last document whole and the chat are over 40% of
    them): Full Recompute in the caller's order, the caller's prompt token for token, so the default answers what the
    model answers without pic."""
    for case in qa_workload(num_cases=2, question_first=True, seed=3).cases:
        messages = case.messages()
        prefix, query = smollm2.chat_segments(messages)
        ids = smollm2.compile(list(case.documents), context=smollm2.chat_context(messages), progress=False)
        with smollm2.link(ids, query + case.answer_prefix, prefix=prefix) as linked:
            assert linked.policy == FullRecompute() and linked.order.order is pic.Order.GIVEN
            assert not linked.order.moved and bool(linked.recomputed.all())
        with smollm2.link(ids, query + case.answer_prefix, prefix=prefix, policy="full") as full:
            assert torch.equal(full.input_ids, linked.input_ids)  # the caller's prompt, token for token
