"""``pic eval accuracy --workload niah``: RULER's needle-in-a-haystack cases over a haystack of real prose."""

from __future__ import annotations

import dataclasses
import re

import pytest

import pic
from pic.cli import main
from pic.evaluation.accuracy import evaluate_accuracy
from pic.evaluation.haystack import sentences
from pic.evaluation.niah import CHARS_PER_TOKEN, NEEDLE, niah_workload
from pic.evaluation.qa import QAKind
from tests.models import model
from tests.test_chat import CHATML, chat_tokenizer

NEEDLE_RE = re.compile(r"One of the special magic numbers for ([a-z]+-[a-z]+) is: (\d{7})\.")


def _needles(case) -> list[tuple[int, str, str]]:
    """(document, key, value) of every needle in the case's documents."""
    return [(i, *m.groups()) for i, d in enumerate(case.documents) for m in NEEDLE_RE.finditer(d)]


def _key(case) -> str:
    return re.search(r"for ([a-z]+-[a-z]+) mentioned", case.question).group(1)


def test_seeded_and_mixed():
    a, b = niah_workload(num_cases=10, seed=3), niah_workload(num_cases=10, seed=3)
    assert a == b and a != niah_workload(num_cases=10, seed=4)
    single, multikey, multivalue = QAKind.NIAH_SINGLE, QAKind.NIAH_MULTIKEY, QAKind.NIAH_MULTIVALUE
    assert [c.kind for c in a.cases[:5]] == [single, multikey, single, multikey, multivalue]
    assert a.description["num_by_kind"] == {"niah-single": 4, "niah-multikey": 4, "niah-multivalue": 2}
    assert len(a.description["depths"]) == 10 and all(0 <= d <= 1 for ds in a.description["depths"] for d in ds)


@pytest.mark.parametrize("kind", ["single", "multikey", "multivalue"])
def test_needles_answers_and_gold(kind):
    for case in niah_workload(num_cases=12, kind=kind, seed=1).cases:
        assert all(d.endswith("\n") and d.count("\n") == 1 for d in case.documents)  # one line each
        needles, key = _needles(case), _key(case)
        asked = [(i, value) for i, k, value in needles if k == key]
        assert [value for _, value in asked] == list(case.answers)  # in haystack order
        assert tuple(sorted({i for i, _ in asked})) == case.gold
        for answer in case.answers:
            assert "".join(case.documents).count(answer) == 1
            assert sum(answer in case.documents[g] for g in case.gold) == 1
            assert answer[0] != "0" and len(answer) == 7
        if kind == "single":
            assert len(needles) == 1 and case.stop == (".", "\n")
        if kind == "multikey":
            assert len(needles) == 4 and len({k for _, k, _ in needles}) == 4 and len({v for *_, v in needles}) == 4
            assert len(asked) == 1 and case.stop == (".", "\n")
        if kind == "multivalue":
            assert len(needles) == 4 and len(asked) == 4 and len(set(case.answers)) == 4
            assert "What are all the special magic numbers" in case.question and case.stop == ("\n",)
            assert case.answer_prefix.endswith("mentioned in the provided text are")


@pytest.mark.parametrize(("haystack_tokens", "chunk_tokens"), [(1000, 128), (2000, 256), (4000, 512), (300, 300)])
def test_sizes(haystack_tokens, chunk_tokens):
    longest = max(map(len, sentences()))
    for case in niah_workload(num_cases=5, haystack_tokens=haystack_tokens, chunk_tokens=chunk_tokens).cases:
        lengths = [len(d) - 1 for d in case.documents]
        limit = chunk_tokens * CHARS_PER_TOKEN
        assert all(limit <= n < limit + longest + 1 for n in lengths[:-1]) and lengths[-1] < limit + longest + 1
        total = sum(lengths) + len(lengths) - 1
        assert haystack_tokens * CHARS_PER_TOKEN - longest <= total <= haystack_tokens * CHARS_PER_TOKEN + longest


def test_question_placement():
    first, after = (niah_workload(num_cases=1, question_first=q).cases[0] for q in (True, False))
    assert first.messages()[1]["content"].count(first.question) == 2
    content = after.messages()[1]["content"]
    assert content.count(after.question) == 1 and content.startswith("{documents}")


def test_haystack_is_prose():
    text = sentences()
    assert len(text) > 500 and len(set(text)) == len(text)
    for sentence in text:
        assert sentence[0].isupper() and sentence.endswith(".") and "\n" not in sentence, sentence
        assert ">>>" not in sentence and "::" not in sentence and "  " not in sentence, sentence
        assert not re.search(r"\d{4,}", sentence) and "magic number" not in sentence, sentence


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"kind": "tripleneedle"}, "kind='tripleneedle'"),
        ({"num_cases": 0}, "num_cases=0"),
        ({"haystack_tokens": 150}, "haystack_tokens=150"),
        ({"haystack_tokens": 10**6}, "haystack_tokens=1000000"),
        ({"chunk_tokens": 8}, "chunk_tokens=8"),
        ({"haystack_tokens": 500, "chunk_tokens": 600}, "chunk_tokens=600"),
    ],
)
def test_bad_arguments_are_named(arguments, named):
    with pytest.raises(pic.InvalidInputError, match=re.escape(named)):
        niah_workload(**{"num_cases": 2, **arguments})


def test_cli_builds_the_niah_workload(monkeypatch, tmp_path):
    """The flags reach ``niah_workload``; a bad size fails before the model loads."""
    import pic.evaluation.command as command

    monkeypatch.setattr(pic.cli, "load_engine", lambda *a, **k: pytest.fail("loaded a model"))
    argv = ["eval", "accuracy", "--model", "x", "--workload", "niah", "--out", str(tmp_path), "--cases", "3"]
    assert main([*argv, "--haystack-tokens", "100"]) == 1
    assert main([*argv, "--documents", "3"]) == 1
    seen = []
    monkeypatch.setattr(pic.cli, "load_engine", lambda *a, **k: _ChatEngine())
    monkeypatch.setattr(command, "run_accuracy", lambda engine, *, workload, **kw: seen.append(workload))
    flags = ["--niah-kind", "single", "--haystack-tokens", "1000", "--chunk-tokens", "128", "--question-after-only"]
    assert main([*argv, *flags]) == 0
    (workload,) = seen
    assert workload == niah_workload(
        num_cases=3, kind="single", haystack_tokens=1000, chunk_tokens=128, question_first=False
    )


class _ChatEngine:
    class tokenizer:  # noqa: N801 - stands in for a tokenizer with a chat template
        chat_template = "{{ messages }}"


def test_evaluation_runs_on_niah(tmp_path):
    """Two small cases through ``evaluate_accuracy`` on stories260K with a ChatML template: the niah kinds are the
    report's per-kind columns."""
    engine = pic.PIC(model("stories260K"), chat_tokenizer(CHATML))
    workload = niah_workload(num_cases=2, haystack_tokens=200, chunk_tokens=32, question_first=False)
    # stories260K reads 512 tokens of about 1.5 characters: keep the gold chunk and the one after it
    cases = [dataclasses.replace(c, documents=c.documents[c.gold[0] :][:2], gold=(0,)) for c in workload.cases]
    workload = dataclasses.replace(workload, cases=tuple(cases))
    report = evaluate_accuracy(engine, workload=workload, policies=["naive"], max_new_tokens=2, num_sink_cases=0)
    assert [s.policy for s in report.scores] == ["full", "naive"] and report.num_cases_evaluated == 2
    assert set(report.scores[0].accuracy_by_kind) == {"niah-single", "niah-multikey"}
    assert "| niah-single | niah-multikey |" in report.table()
    assert NEEDLE.format(key=_key(cases[0]), value=cases[0].answers[0]) in cases[0].documents[0]
