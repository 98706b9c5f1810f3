"""``pic eval accuracy --workload musique``: CacheBlend's MuSiQue file read, its prompt, F1 over aliases, the paired
F1 bootstrap, and one evaluation end to end.

No network and no real data: every file here is a tiny synthetic one in CacheBlend's exact record format
(``inputs/musique_s.json``: ``{"ctxs": [{"title", "text"}], "question", "answers"}``), written to tmp_path. The
evaluation runs on stories260K with a ChatML template, as tests/test_accuracy.py does: the bookkeeping is checked,
not the answers.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import re
import sys
from pathlib import Path

import pytest

import pic
from pic.cli import main
from pic.evaluation import cli, musique
from pic.evaluation.accuracy import Outcome, _summarize, evaluate_accuracy
from pic.evaluation.accuracy_report import paired_bootstrap
from pic.evaluation.answers import AnswerScore, parse_reply, score_answer
from pic.evaluation.fidelity import LinkMeasurement
from pic.evaluation.musique import musique_workload
from pic.evaluation.qa import SYSTEM_PROMPT, QAKind, ReplyParse, qa_workload
from tests.models import model
from tests.test_chat import CHATML, chat_tokenizer

ROOT = Path(__file__).resolve().parent.parent
RECORDS = [
    {
        "ctxs": [
            {"title": "", "text": "tom had a big red ball. he lived in a small town."},
            {"title": "", "text": "the small town was called oakley. it had a river."},
            {"title": "Lily", "text": "lily loved to sing a happy song."},
        ],
        "question": "Where did the owner of the red ball live",
        "answers": ["Oakley", "Oakley town"],
    },
    {
        "ctxs": [
            {"title": "", "text": "sam went to the park with\nhis dog."},
            {"title": "", "text": "the dog was named max."},
            {"title": "", "text": "max liked to run."},
        ],
        "question": "What was the name of Sam's dog?",
        "answers": ["Max"],
    },
]


def write(path: Path, records: object) -> Path:
    path.write_text(json.dumps(records), encoding="utf-8")
    return path


@pytest.fixture
def musique_file(tmp_path) -> Path:
    return write(tmp_path / "musique_s.json", RECORDS)


def test_cases_are_the_records_passages_question_and_answers(musique_file):
    workload = musique_workload(musique_file)
    first, second = workload.cases
    assert first.kind is QAKind.MUSIQUE and first.question == RECORDS[0]["question"]
    assert first.documents == (
        "tom had a big red ball. he lived in a small town.\n",
        "the small town was called oakley. it had a river.\n",
        "Lily\nlily loved to sing a happy song.\n",
    )
    assert second.documents[0] == "sam went to the park with his dog.\n"  # one line: the one-line rule
    assert (first.reference, first.answers, first.aliases) == ("Oakley", ("Oakley",), ("Oakley town",))
    assert (second.answers, second.aliases) == (("Max",), ())
    assert first.gold == second.gold == ()  # CacheBlend's file does not say which passages support
    assert first.answer_prefix == "" and first.stop == () and first.reply_parse is ReplyParse.CACHEBLEND
    description = workload.description
    assert description["num_cases"] == 2 and description["num_passages"] is None  # all
    assert description["sha256"] == hashlib.sha256(musique_file.read_bytes()).hexdigest()
    assert description["num_by_kind"] == {"musique": 2}
    # the first N questions, the first N passages
    assert [c.question for c in musique_workload(musique_file, num_cases=1).cases] == [RECORDS[0]["question"]]
    assert musique_workload(musique_file, num_passages=2).cases[1].documents == (
        "sam went to the park with his dog.\n",
        "the dog was named max.\n",
    )


def test_supporting_passages_are_the_gold_when_the_file_says(tmp_path):
    records = json.loads(json.dumps(RECORDS))
    records[0]["ctxs"][1]["is_supporting"] = True
    records[0]["ctxs"][0]["is_supporting"] = False
    (case, _) = musique_workload(write(tmp_path / "m.json", records)).cases
    assert case.gold == (1,)


def test_the_prompt_is_cacheblends(musique_file):
    """CacheBlend's prefix, query prompt and question normalization (example/blend_musique.py, utils.py), word
    for word; the query's first line break dropped, no system message."""
    cacheblend_prefix = (
        "You will be asked a question after reading several passages. Please directly answer the question based "
        "on the given passages. Do NOT repeat the question. The answer should be within 5 words..\nPassages:\n"
    )
    cacheblend_query = (
        "\n\nAnswer the question directly based on the given passages. Do NOT repeat the question. The answer "
        "should be within 5 words. \nQuestion:"
    )
    assert musique.PREFIX == cacheblend_prefix and musique.QUERY_START + musique.QUERY == cacheblend_query
    case = musique_workload(musique_file).cases[0]
    assert case.messages() == [
        {
            "role": "user",
            "content": cacheblend_prefix + "{documents}" + cacheblend_query[2:]
            + "where did the owner of the red ball live?\nAnswer:",
        }
    ]  # fmt: skip
    assert musique.normalize_question("What was it?") == "what was it?"
    engine = pic.PIC(model("stories260K"), chat_tokenizer(CHATML))
    prefix, query = engine.chat_segments(case.messages())
    assert prefix == "<|im_start|>user\n" + cacheblend_prefix
    assert query == (
        cacheblend_query[2:] + "where did the owner of the red ball live?\nAnswer:<|im_end|>\n<|im_start|>assistant\n"
    )


def test_the_other_workloads_prompts_are_unchanged():
    """The new QACase fields default to the old chat, byte for byte."""
    for case in qa_workload(num_cases=4, seed=1).cases:
        question = f"Question: {case.question}"
        assert case.messages() == [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"{question}\n\n{{documents}}{question}"},
        ]


def test_a_malformed_file_is_refused_naming_it_and_the_record(tmp_path):
    cases = {
        "not json": "{oops",
        "a dict": {"ctxs": []},
        "an empty list": [],
    }
    for label, content in cases.items():
        path = tmp_path / f"{label.replace(' ', '_')}.json"
        path.write_text(content if isinstance(content, str) else json.dumps(content))
        with pytest.raises(pic.InvalidInputError, match=re.escape(f"MuSiQue file '{path}'")):
            musique_workload(path)
    bad = json.loads(json.dumps(RECORDS))
    del bad[1]["answers"]
    with pytest.raises(pic.InvalidInputError, match=r"'.*bad\.json' record 1: answers: Field required"):
        musique_workload(write(tmp_path / "bad.json", bad))
    bad = json.loads(json.dumps(RECORDS))
    bad[0]["answers"] = "Oakley"  # strict: a string is not a list of one
    with pytest.raises(pic.InvalidInputError, match="record 0: answers: Input should be a valid list"):
        musique_workload(write(tmp_path / "bad.json", bad))
    bad = json.loads(json.dumps(RECORDS))
    bad[1]["ctxs"][2]["txt"] = "typo"
    with pytest.raises(pic.InvalidInputError, match=r"record 1: ctxs\.2\.txt: Extra inputs"):
        musique_workload(write(tmp_path / "bad.json", bad))
    good = write(tmp_path / "good.json", RECORDS)
    with pytest.raises(pic.InvalidInputError, match="record 0 has 3 passages, fewer than num_passages=4"):
        musique_workload(good, num_passages=4)
    with pytest.raises(pic.InvalidInputError, match="num_cases=3: .* holds 2 questions"):
        musique_workload(good, num_cases=3)


def test_an_oversized_or_missing_file_is_refused_before_reading(musique_file, tmp_path, monkeypatch):
    monkeypatch.setattr(musique, "MAX_FILE_BYTES", 100)
    with pytest.raises(pic.InvalidInputError, match=re.escape(f"'{musique_file}' is ") + r"\d+ bytes, more than 100"):
        musique_workload(musique_file)
    monkeypatch.undo()
    missing = tmp_path / "nowhere" / "musique_s.json"
    with pytest.raises(pic.InvalidInputError, match=re.escape(f"'{missing}' (") + ".*does not exist.*musique_data.py"):
        musique_workload(missing)


def test_f1_is_the_best_over_the_answer_and_its_aliases(musique_file):
    case = musique_workload(musique_file).cases[0]  # "Oakley", alias "Oakley town"
    assert score_answer("Oakley", case) == AnswerScore(correct=True, exact=True, f1=1.0)
    town = score_answer("Oakley town.", case)  # the alias exactly; the reference's F1 would be 2/3
    assert town.exact and town.f1 == 1.0 and town.correct
    near = score_answer("in the town of Oakley", case)
    assert near.correct and near.f1 == pytest.approx(max(2 * (1 / 4) / (1 + 1 / 4), 2 * (2 / 4) * 1 / (2 / 4 + 1)))
    assert score_answer("a river", case) == AnswerScore(correct=False, exact=False, f1=0.0)
    # without aliases it is the reference's F1, as before
    other = musique_workload(musique_file).cases[1]
    assert score_answer("his dog max", other).f1 == pytest.approx(2 * (1 / 3) / (1 + 1 / 3))


def test_the_reply_is_parsed_as_cacheblend_does():
    parse = ReplyParse.CACHEBLEND
    assert parse_reply("\n\nOakley\nThe passages say so.", parse) == "Oakley"  # the first line after newlines
    assert parse_reply("Yes, he did.", parse) == "Yes" and parse_reply("no.", parse) == "No"
    assert parse_reply("Norway", parse) == "Norway"  # CacheBlend's startswith("No") made this "No"
    assert parse_reply("Nobel Prize in Literature", parse) == "Nobel Prize in Literature"
    assert parse_reply("", parse) == parse_reply("\n\n", parse) == ""  # CacheBlend raised on these
    assert parse_reply("Yes\nNo", ReplyParse.AS_GENERATED) == "Yes\nNo"


def test_the_paired_bootstrap_holds_the_mean_and_is_seeded():
    diffs = [0.0] * 20 + [0.5, -1.0, 0.25, 1.0, -0.5, 0.0, 0.75, -0.25]
    mean, low, high = paired_bootstrap(diffs)
    assert mean == pytest.approx(sum(diffs) / len(diffs)) and low <= mean <= high and low < high
    assert min(diffs) <= low and high <= max(diffs)
    assert paired_bootstrap(diffs) == (mean, low, high)  # random.Random(0): the same every time
    assert paired_bootstrap(list(diffs)) == paired_bootstrap(diffs, seed=0) != paired_bootstrap(diffs, seed=1)
    assert paired_bootstrap([0.0, 0.0, 0.0]) == (0.0, 0.0, 0.0)  # identical replies: no spread
    assert all(math.isnan(x) for x in paired_bootstrap([]))
    wide = paired_bootstrap(diffs, confidence=0.99)  # the same resamples, further into their tails
    assert wide[0] == mean and wide[1] <= low and high <= wide[2]


def test_summaries_of_cases_without_gold_documents(musique_file):
    """No gold passages: no accuracy by gold position (not a column of NaN); the F1 difference paired."""
    cases = list(musique_workload(musique_file).cases)

    def outcome(f1: float, reply: str) -> Outcome:
        link = LinkMeasurement(
            kl=0.0, top1=1.0, kl_last=0.0, top1_last=1.0, nll=None, recomputed=10, recomputed_first=10,
            fraction=0.25, fraction_last=0.25, link_s=1.0,
        )  # fmt: skip
        return Outcome(link=link, reply=reply, score=AnswerScore(correct=f1 == 1.0, exact=f1 == 1.0, f1=f1))

    full = [outcome(1.0, "a"), outcome(0.5, "b")]
    policy = [outcome(0.5, "c"), outcome(0.5, "b")]
    score = _summarize("naive", policy, full, cases)
    assert score.accuracy_by_gold_position == [] and score.accuracy_by_kind == {"musique": 0.0}
    assert score.f1 == 0.5 and score.f1_diff_vs_full == -0.25
    assert score.f1_diff_low <= -0.25 <= score.f1_diff_high
    reference = _summarize("full", full, full, cases)
    assert (reference.f1_diff_vs_full, reference.f1_diff_low, reference.f1_diff_high) == (0.0, 0.0, 0.0)


def test_an_evaluation_end_to_end_reports_the_f1_difference(musique_file, tmp_path):
    engine = pic.PIC(model("stories260K"), chat_tokenizer(CHATML))
    workload = musique_workload(musique_file, num_cases=2)
    report = evaluate_accuracy(engine, workload=workload, policies=["auto"], max_new_tokens=4, num_sink_cases=0)
    assert [s.policy for s in report.scores] == ["full", "auto:0.05"] and report.num_cases_evaluated == 2
    full, auto = report.scores
    assert (full.f1_diff_vs_full, full.f1_diff_low, full.f1_diff_high) == (0.0, 0.0, 0.0)
    assert auto.f1_diff_low <= auto.f1_diff_vs_full <= auto.f1_diff_high
    assert auto.f1_diff_vs_full == pytest.approx(auto.f1 - full.f1)
    path = tmp_path / "report.json"
    report.save_json(path)
    data = json.loads(path.read_text())
    assert {"f1_diff_vs_full", "f1_diff_low", "f1_diff_high"} <= set(data["scores"][1])
    assert data["workload"]["num_by_kind"] == {"musique": 2} and "paired F1 diff" in report.table()


def test_the_command_names_a_missing_file_and_how_to_get_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(pic.cli, "load_engine", lambda *a, **k: pytest.fail("loaded a model"))
    missing = tmp_path / "musique_s.json"
    argv = ["eval", "accuracy", "--workload", "musique", "--model", "x", "--out", str(tmp_path)]
    assert main([*argv, "--musique-file", str(missing)]) == 1
    err = capsys.readouterr().err
    assert f"MuSiQue file '{missing}'" in err and "python benchmarks/musique_data.py" in err
    assert main([*argv, "--musique-file", str(missing), "--documents", "3"]) == 1
    assert "--documents 3 does not apply to --workload musique" in capsys.readouterr().err
    assert main(["eval", "accuracy", "--model", "x", "--passages", "3"]) == 1
    assert "--passages 3 applies to --workload musique only" in capsys.readouterr().err


def test_the_download_script_checks_the_bytes(musique_file, tmp_path, monkeypatch, capsys):
    """``--from`` copies a local file only when its sha256 is CacheBlend's; a wrong file writes nothing."""
    spec = importlib.util.spec_from_file_location("musique_data", ROOT / "benchmarks" / "musique_data.py")
    script = importlib.util.module_from_spec(spec)
    sys.modules["musique_data"] = script
    spec.loader.exec_module(script)
    out = tmp_path / "data" / "musique_s.json"
    assert script.main(["--from", str(musique_file), "--out", str(out)]) == 1 and not out.exists()
    assert f"'{musique_file}' has sha256" in capsys.readouterr().err
    monkeypatch.setattr(script, "SHA256", hashlib.sha256(musique_file.read_bytes()).hexdigest())
    assert script.main(["--from", str(musique_file), "--out", str(out)]) == 0
    assert out.read_bytes() == musique_file.read_bytes()
    assert script.URL.startswith("https://raw.githubusercontent.com/YaoJiayi/CacheBlend/" + script.COMMIT)
    assert script.DEFAULT_OUT.relative_to(ROOT).as_posix() == musique.DEFAULT_PATH == cli._MUSIQUE_PATH
    assert musique.DOWNLOAD == cli._MUSIQUE_DOWNLOAD  # the command's help names the script
