"""``pic eval accuracy``: the generated QA workload, answer scoring, intervals, and the evaluation's bookkeeping.

The evaluation runs here on stories260K with a ChatML template (tests/test_chat.py): a model that cannot
answer, so accuracy is not what is checked; Full Recompute's row, policies at their limits, the partial
reports and the JSON are. Accuracy and attention sinks on a real model are in tests/test_smollm2.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics

import pytest

import pic
from pic.evaluation.accuracy import evaluate_accuracy
from pic.evaluation.accuracy_report import wilson_interval
from pic.evaluation.answers import score_answer
from pic.evaluation.qa import QAKind, qa_workload
from tests.models import model
from tests.test_chat import CHATML, chat_tokenizer


def test_workload_is_seeded_and_mixed():
    a, b = qa_workload(num_cases=40, seed=3), qa_workload(num_cases=40, seed=3)
    assert a == b and a != qa_workload(num_cases=40, seed=4)
    kinds = [c.kind for c in a.cases]
    assert kinds.count(QAKind.TWO_DOCS) == 8 and {QAKind.PASSKEY, QAKind.FACT} <= set(kinds)
    assert a.description["num_by_kind"] == {k.value: kinds.count(k) for k in QAKind}


def test_answers_are_in_the_gold_documents_only():
    for case in qa_workload(num_cases=60, num_documents=5, seed=1).cases:
        assert len(case.documents) == 5 and all(d.endswith("\n") and d.count("\n") == 1 for d in case.documents)
        holding = [i for i, d in enumerate(case.documents) if any(a in d for a in case.answers)]
        assert holding == sorted(case.gold), case
        if case.kind is QAKind.PASSKEY:  # the one key is the only one
            assert sum("pass key" in d for d in case.documents) == 1
        if case.kind is QAKind.FACT:  # every document holds a competing fact
            assert all(" lives in " in d for d in case.documents)
        assert case.question in case.messages()[1]["content"]


def test_question_placement():
    first, after = (qa_workload(num_cases=1, question_first=q).cases[0] for q in (True, False))
    assert first.messages()[1]["content"].count(first.question) == 2
    content = after.messages()[1]["content"]
    assert content.count(after.question) == 1 and content.startswith("{documents}")


def test_reordered_moves_the_gold_documents():
    case = next(c for c in qa_workload(num_cases=20, seed=2).cases if c.kind is QAKind.TWO_DOCS)
    order = [3, 1, 0, 2]
    moved = case.reordered(order)
    assert moved.documents == tuple(case.documents[i] for i in order)
    assert [moved.documents[g] for g in moved.gold] == [case.documents[g] for g in case.gold]


@pytest.mark.parametrize(
    ("reply", "correct", "exact", "f1"),
    [
        (" 4821", True, True, 1.0),
        (" 4821.", True, True, 1.0),
        (" the number 4821, I think", True, False, 2 / 5),
        (" 48210", False, False, 0.0),  # whole words only
        (" a small wooden key", False, False, 0.0),
    ],
)
def test_scoring_one_answer(reply, correct, exact, f1):
    case = next(c for c in qa_workload(num_cases=10).cases if c.kind is QAKind.PASSKEY)
    case = dataclasses.replace(case, answers=("4821",), reference="4821")
    score = score_answer(reply, case)
    assert (score.correct, score.exact) == (correct, exact) and math.isclose(score.f1, f1)


def test_scoring_two_answers_needs_both():
    case = next(c for c in qa_workload(num_cases=20, seed=2).cases if c.kind is QAKind.TWO_DOCS)
    a, b = case.answers
    assert score_answer(f" {case.reference}.", case).exact
    assert score_answer(f" {a}, and then {b}", case).correct
    assert not score_answer(f" {a}. The museum shows paintings.", case).correct


def test_wilson_interval():
    low, high = wilson_interval(5, 10)
    assert math.isclose(low, 0.2366, abs_tol=1e-4) and math.isclose(high, 0.7634, abs_tol=1e-4)
    assert wilson_interval(0, 10)[0] == 0.0 and math.isclose(wilson_interval(0, 10)[1], 0.2775, abs_tol=1e-4)
    assert wilson_interval(200, 200)[1] == 1.0 and wilson_interval(200, 200)[0] > 0.98
    # 60 of 60 and 31 of 31 landed a last bit under 1.0 (0.9999999999999999), and the plot's error bar below 0
    assert all(wilson_interval(n, n)[1] == 1.0 and wilson_interval(0, n)[0] == 0.0 for n in range(1, 200))
    assert all(math.isnan(x) for x in wilson_interval(0, 0))


def test_bad_workload_shapes():
    with pytest.raises(pic.InvalidInputError, match="num_documents=1"):
        qa_workload(num_documents=1)
    with pytest.raises(pic.InvalidInputError, match="two_docs_share=1.5"):
        qa_workload(two_docs_share=1.5)


def test_evaluation_bookkeeping(tmp_path):
    """Full Recompute is its own reference; a policy at its limit is Full Recompute; partial reports grow
    case by case; the sink profile has one value per layer; the JSON is strict (no NaN)."""
    engine = pic.PIC(model("stories260K"), chat_tokenizer(CHATML))
    workload = qa_workload(num_cases=3, num_documents=2, sentences_per_document=2, seed=5)
    partial = []
    report = evaluate_accuracy(
        engine, workload=workload, policies=["naive", "legolink:1000", "naive"], max_new_tokens=4,
        num_sink_cases=2, on_case=partial.append,
    )  # fmt: skip
    assert [s.policy for s in report.scores] == ["full", "naive", "legolink:1000"]
    assert [r.num_cases_evaluated for r in partial] == [1, 2, 3] and report.num_cases_evaluated == 3
    full, naive, limit = report.scores
    assert full.same_reply_as_full == 1.0 and full.mean_kl == 0.0 and full.num_gained == full.num_lost == 0
    assert limit.same_reply_as_full == 1.0 and limit.answer_kl < 1e-6 and limit.accuracy == full.accuracy
    assert limit.recompute_fraction == 1.0 and naive.recompute_fraction < 0.9 and naive.mean_kl > 1e-4
    assert full.accuracy_low <= full.accuracy <= full.accuracy_high
    assert [p.policy for p in report.sinks] == ["full", "naive", "legolink:1000"] and report.sinks[0].num_cases == 2
    assert all(len(p.chunk_firsts) == len(p.prompt_first) == engine.spec.num_layers for p in report.sinks)
    assert report.sinks[2].chunk_firsts == pytest.approx(report.sinks[0].chunk_firsts, abs=1e-5)
    path = tmp_path / "report.json"
    report.save_json(path)
    data = json.loads(path.read_text())
    assert data["add_bos"] is True and data["scores"][0]["policy"] == "full" and "| naive |" in report.table()


def test_a_model_without_a_chat_template_is_refused(stories):
    with pytest.raises(pic.InvalidInputError, match="workload case 0: .*no chat template"):
        evaluate_accuracy(stories, workload=qa_workload(num_cases=1), policies=["naive"])


def test_scores_count_what_the_replies_scored():
    """Per-policy figures from hand-made outcomes: accuracy overall, per kind and per gold position, the
    paired gains and losses, identical replies, and the answer-token and link-time columns."""
    from pic.evaluation.accuracy import Outcome, _summarize
    from pic.evaluation.answers import AnswerScore
    from pic.evaluation.fidelity import LinkMeasurement

    def outcome(correct: bool, reply: str, *, kl: float, link_s: float) -> Outcome:
        link = LinkMeasurement(
            kl=kl, top1=1.0, kl_last=3 * kl, top1_last=0.5, nll=None, recomputed=10, recomputed_first=10,
            fraction=0.25, fraction_last=0.25, link_s=link_s,
        )  # fmt: skip
        return Outcome(link=link, reply=reply, score=AnswerScore(correct=correct, exact=correct, f1=float(correct)))

    cases = list(qa_workload(num_cases=6, seed=3).cases)
    full_ok = [True, True, False, True, False, True]
    policy_ok = [True, False, True, False, False, True]
    full = [outcome(ok, r, kl=0.0, link_s=1.0) for ok, r in zip(full_ok, "abcdef", strict=True)]
    policy = [outcome(ok, r, kl=0.1, link_s=0.25) for ok, r in zip(policy_ok, "axcyef", strict=True)]
    score = _summarize("naive", policy, full, cases)
    assert score.accuracy == pytest.approx(3 / 6) and score.exact_match == pytest.approx(3 / 6)
    assert (score.num_gained, score.num_lost) == (1, 2) and score.same_reply_as_full == pytest.approx(4 / 6)
    assert set(score.accuracy_by_kind) == {c.kind.value for c in cases}  # the kinds the workload has
    for kind in {c.kind for c in cases}:
        picked = [ok for ok, c in zip(policy_ok, cases, strict=True) if c.kind is kind]
        assert score.accuracy_by_kind[kind.value] == pytest.approx(sum(picked) / len(picked)), kind
    diffs = [int(p) - int(f) for p, f in zip(policy_ok, full_ok, strict=True)]  # 0, -1, 1, -1, 0, 0
    half = 1.96 * statistics.stdev(diffs) / math.sqrt(6)
    assert score.diff_vs_full == pytest.approx(-1 / 6)
    assert (score.diff_low, score.diff_high) == pytest.approx((-1 / 6 - half, -1 / 6 + half))
    for position in range(4):
        picked = [ok for ok, c in zip(policy_ok, cases, strict=True) if c.gold == (position,)]
        expected = sum(picked) / len(picked) if picked else math.nan
        assert score.accuracy_by_gold_position[position] == pytest.approx(expected, nan_ok=True), position
    assert score.answer_kl == pytest.approx(0.3) and score.answer_top1 == 0.5 and score.mean_kl == pytest.approx(0.1)
    assert score.median_speedup_vs_full == 4.0 and score.recompute_fraction == 0.25
    assert (score.accuracy_low, score.accuracy_high) == wilson_interval(3, 6)


def test_orders_are_scored_against_full_recompute_in_both_orders(tmp_path):
    """A row in the relevance order is paired against Full Recompute in the caller's order and in the order it
    ran; Full Recompute in the relevance order is its own reference there (0 difference), and the case log
    resumes a stopped run with the same figures."""
    from pic.evaluation.case_log import CaseLog
    from pic.evaluation.command import run_accuracy

    engine = pic.PIC(model("stories260K"), chat_tokenizer(CHATML))
    workload = qa_workload(num_cases=4, num_documents=3, sentences_per_document=2, seed=5)
    kwargs = dict(workload=workload, policies=["naive", "full"], orders=["given", "relevance"], max_new_tokens=4,
                  num_sink_cases=0, out_dir=tmp_path, name="orders")  # fmt: skip
    report = run_accuracy(engine, **kwargs)
    rows = {s.policy: s for s in report.scores}
    assert list(rows) == ["full", "naive/given", "naive/relevance", "full/relevance"]
    moved = rows["full/relevance"]
    assert moved.order == "relevance" and 0 < moved.reordered <= 1 and rows["naive/given"].reordered == 0
    assert moved.diff_vs_link_order == 0 and moved.full_link_order_accuracy == moved.accuracy
    assert rows["naive/given"].diff_vs_link_order == rows["naive/given"].diff_vs_full
    # stop after two cases (a line cut off mid-write), resume: the same report
    log = tmp_path / "orders.cases.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    assert len(lines) == 5 and CaseLog(log, json.loads(lines[0])["header"]).read().keys() == {0, 1, 2, 3}
    log.write_text("".join(lines[:3]) + lines[3][:40])
    resumed = run_accuracy(engine, **kwargs, resume=True)
    assert [(s.policy, s.accuracy, s.diff_vs_full) for s in resumed.scores] == [
        (s.policy, s.accuracy, s.diff_vs_full) for s in report.scores
    ]
    assert len(log.read_text().splitlines()) == 5
    with pytest.raises(pic.InvalidInputError, match="another evaluation .*labels"):
        run_accuracy(engine, **(kwargs | {"orders": ["given"]}), resume=True)
