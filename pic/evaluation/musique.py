"""MuSiQue as CacheBlend evaluates it, for ``pic eval accuracy --workload musique``.

MuSiQue (Trivedi et al., 2022, "MuSiQue: Multihop Questions via Single-hop Question Composition", TACL; CC BY
4.0) asks questions that need two to four facts from different Wikipedia paragraphs. CacheBlend (Yao et al.,
2024, "CacheBlend: Fast Large Language Model Serving for RAG with Cached Knowledge Fusion") measured its
selective recompute on 150 of them: ``inputs/musique_s.json`` of github.com/YaoJiayi/CacheBlend (snapshot
``55ad02675939f783a38d579393527d218a7fd581``), each question with 10 retrieved passages, scored by
``example/blend_musique.py`` with the helpers of ``example/utils.py``. pic does not ship the file:
``python benchmarks/musique_data.py`` downloads it and checks its sha256.

The file is a JSON list of records ``{"ctxs": [{"title": str, "text": str}, ...], "question": str, "answers":
[str, ...]}``. A case is one record: its first ``num_passages`` passages are the documents, one chunk each; the
answers' first is the reference, the others its aliases (the file has one answer per question); the file does
not say which passages support the answer (its titles are empty and its passages are retrieved windows), so
``gold`` is empty, unless a passage carries MuSiQue's own ``"is_supporting"`` flag.

CacheBlend's prompt, for Mistral-7B-Instruct-v0.2, is one user turn: ``[INST]``, ``PREFIX`` (below), each
passage as ``f"{title}\\n\\n{text}\\n\\n"``, then ``QUERY`` followed by the question as ``normalize_question``
writes it (a "?" added when missing, the first letter lower-cased) and ``"\\nAnswer:"``, then ``[/INST]``;
greedy, at most 32 new tokens (``MAX_NEW_TOKENS``); the reply's first line, after leading newlines, is scored by
token F1, the best over the answers, after SQuAD's normalization (lower case, no punctuation, no articles). Here
the same texts go into the model's own chat template (``QACase.messages``), with these deviations:

- **Passages end in one newline, and the query follows the last one directly**: ``f"{title}\\n{text}\\n"``
  (``f"{text}\\n"`` with an empty title, as every title in the file is) where CacheBlend writes
  ``f"{title}\\n\\n{text}\\n\\n"``, and ``QUERY`` without its two leading newlines. A byte-level BPE
  tokenizes the newlines between two chunks differently when they are split across the chunks than in running
  text (``pic.evaluation.qa.QACase``), so CacheBlend's layout would make the linked prompt differ from the plain
  chat prompt by a token at every boundary (SmolLM2's tokenizer does, on this file; with this layout its 150
  linked prompts are the plain prompts' tokens). Every word of the prompt is CacheBlend's, in its order.
- **No system message, and the model's own chat template** instead of Mistral's ``[INST] ... [/INST]``: the
  instructions are in the user message as CacheBlend has them, and a template that writes a default system
  turn when none is given (SmolLM2's, Qwen2.5's) writes it. CacheBlend encodes each piece separately with
  Mistral's SentencePiece tokenizer, which marks a leading space on each; pic tokenizes each segment with the
  model's own tokenizer, as ``link`` does.
- **F1 over words, not the model's tokens**: CacheBlend's ``compute_f1`` counts the model tokenizer's sub-word
  tokens of the normalized texts; pic counts words (``pic.evaluation.answers``), SQuAD's and MuSiQue's own
  metric, so a score means the same for every model. Both take the best over the answers.
- **"Yes" and "No" as whole words**: CacheBlend's ``parse_generation`` maps a reply whose first line starts with
  the letters "No" to "No" (and "Yes" to "Yes"), so "Norway" or "Nobel Prize in Literature" scores 0 against the
  answer it gives (5 of the file's 150 answers begin with "No" or "no"); here only the first word, less
  punctuation, counts (``pic.evaluation.answers.parse_reply``). An empty reply scores 0 where CacheBlend raises.
- **Line breaks inside a passage become spaces, and spaces around it are dropped** (the one-line rule above);
  the file has neither.

``correct`` (a reply that holds the answer or an alias as whole words) is scored too, beside CacheBlend's F1;
the report's ``f1_diff_vs_full`` is CacheBlend's comparison, each policy's F1 against Full Recompute's on the
same questions, with a paired bootstrap interval. Questions are taken in the file's order (the first
``num_cases``), so a run of N cases is the first N of CacheBlend's.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pic.errors import InvalidInputError
from pic.evaluation.qa import QACase, QAKind, QAWorkload, ReplyParse

# CacheBlend's prompt (example/blend_musique.py), word for word; QUERY_START is its query prompt's first line
# break (see the module's docstring), dropped here.
PREFIX = (
    "You will be asked a question after reading several passages. Please directly answer the question based on "
    "the given passages. Do NOT repeat the question. The answer should be within 5 words..\nPassages:\n"
)
QUERY_START = "\n\n"
QUERY = (
    "Answer the question directly based on the given passages. Do NOT repeat the question. The answer should be "
    "within 5 words. \nQuestion:"
)
ANSWER_CUE = "\nAnswer:"
MAX_NEW_TOKENS = 32  # CacheBlend's SamplingParams(temperature=0, max_tokens=32)
DEFAULT_PATH = "benchmarks/data/musique_s.json"  # relative to the working directory
DOWNLOAD = "python benchmarks/musique_data.py"
# CacheBlend's file is 3.6 MiB; a file this large is surely not a question set to read whole.
MAX_FILE_BYTES = 64 * 1024 * 1024


class _Passage(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    title: str
    text: str = Field(min_length=1)
    is_supporting: bool | None = None  # MuSiQue's own records say; CacheBlend's file does not


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    ctxs: list[_Passage] = Field(min_length=1)
    question: str = Field(min_length=1)
    answers: list[str] = Field(min_length=1)


def musique_workload(
    path: str | os.PathLike = DEFAULT_PATH, *, num_cases: int | None = None, num_passages: int | None = None
) -> QAWorkload:
    """The first ``num_cases`` questions (all, when ``None``) of a MuSiQue file in CacheBlend's format, each over
    its first ``num_passages`` passages (all of them, as CacheBlend links them, when ``None``: 10 in its file), in
    CacheBlend's prompt (see the module's docstring). Records are numbered from 0, as the evaluation numbers its
    cases, so "workload case 3" is record 3. The description records the file's sha256 (a resumed run must read
    the same file) and ``num_passages`` (``None``: all).

    Raises:
        InvalidInputError: a missing, unreadable or oversized file (naming it, and how to download CacheBlend's),
            one that is not JSON or not a list, a malformed record (naming its number and what is wrong), a
            record with fewer than ``num_passages`` passages, or more cases asked for than the file holds.
    """
    if num_cases is not None and num_cases < 1:
        raise InvalidInputError(f"num_cases={num_cases}: must be at least 1")
    if num_passages is not None and num_passages < 1:
        raise InvalidInputError(f"num_passages={num_passages}: must be at least 1")
    data = _read(path)
    name = str(path)
    try:
        items = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"MuSiQue file {name!r} is not JSON: {exc}") from None
    if not isinstance(items, list) or not items:
        raise InvalidInputError(f"MuSiQue file {name!r} is not a non-empty JSON list of questions")
    if num_cases is not None and num_cases > len(items):
        raise InvalidInputError(f"num_cases={num_cases}: MuSiQue file {name!r} holds {len(items)} questions")
    records = [_record(item, number, name) for number, item in enumerate(items[:num_cases])]
    cases = tuple(_case(record, number, name, num_passages) for number, record in enumerate(records))
    description = {
        "source": "MuSiQue (Trivedi et al., 2022; CC BY 4.0) as CacheBlend evaluates it: inputs/musique_s.json",
        "path": name,
        "sha256": hashlib.sha256(data).hexdigest(),
        "num_cases": len(cases),
        "num_passages": num_passages,
        "prompt": "cacheblend",
        "num_by_kind": {QAKind.MUSIQUE.value: len(cases)},
    }
    return QAWorkload(cases=cases, description=description)


def normalize_question(question: str) -> str:
    """CacheBlend's ``normalize_question``: a "?" added when missing, the first letter lower-cased."""
    if not question.endswith("?"):
        question += "?"
    return question[0].lower() + question[1:]


def format_passage(title: str, text: str) -> str:
    """One passage as a chunk: the title's line (when there is one), then the text, on one line."""
    text = _one_line(text)
    return f"{_one_line(title)}\n{text}\n" if title.strip() else f"{text}\n"


def user_message(question: str) -> str:
    """The user message of CacheBlend's prompt, ``{documents}`` where the passages go."""
    return f"{PREFIX}{{documents}}{QUERY}{normalize_question(question)}{ANSWER_CUE}"


def _read(path: str | os.PathLike) -> bytes:
    """The file's bytes, its size checked before anything is read (and the read bounded, should it grow)."""
    name = str(path)
    try:
        size = os.path.getsize(path)
        if size > MAX_FILE_BYTES:
            raise InvalidInputError(f"MuSiQue file {name!r} is {size} bytes, more than {MAX_FILE_BYTES}")
        with open(path, "rb") as file:
            data = file.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise InvalidInputError(
            f"MuSiQue file {name!r} ({os.path.abspath(path)}) does not exist; download CacheBlend's with "
            f"`{DOWNLOAD}` (`{DOWNLOAD} --from PATH` checks and copies a copy you have), or pass its path "
            "(pic eval accuracy --musique-file PATH)"
        ) from None
    except OSError as exc:
        raise InvalidInputError(f"cannot read MuSiQue file {name!r}: {exc.strerror or exc}") from None
    if len(data) > MAX_FILE_BYTES:
        raise InvalidInputError(f"MuSiQue file {name!r} is more than {MAX_FILE_BYTES} bytes")
    return data


def _record(item: object, number: int, name: str) -> _Record:
    try:
        return _Record.model_validate(item)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"]) or "the record"
        raise InvalidInputError(f"MuSiQue file {name!r} record {number}: {where}: {error['msg']}") from None


def _case(record: _Record, number: int, name: str, num_passages: int | None) -> QACase:
    if num_passages is not None and len(record.ctxs) < num_passages:
        raise InvalidInputError(
            f"MuSiQue file {name!r} record {number} has {len(record.ctxs)} passages, fewer than "
            f"num_passages={num_passages}"
        )
    passages = record.ctxs[:num_passages]
    reference, *aliases = record.answers
    return QACase(
        kind=QAKind.MUSIQUE,
        documents=tuple(format_passage(p.title, p.text) for p in passages),
        question=record.question,
        answers=(reference,),
        reference=reference,
        answer_prefix="",
        stop=(),
        gold=tuple(i for i, p in enumerate(passages) if p.is_supporting),
        question_first=False,
        aliases=tuple(aliases),
        system=None,
        user=user_message(record.question),
        reply_parse=ReplyParse.CACHEBLEND,
    )


def _one_line(text: str) -> str:
    return re.sub(r"\s*[\r\n]+\s*", " ", text).strip()
