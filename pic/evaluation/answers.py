"""Scoring a generated answer: found (every answer in the reply), exact match and token F1, as SQuAD scores them.

A case with aliases (MuSiQue's) scores as MuSiQue's and CacheBlend's evaluations do: exact match and F1 are the
best over the reference and its aliases, and the reply is found correct when it holds any of them.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from dataclasses import dataclass

from pic.evaluation.qa import QACase, ReplyParse


@dataclass(frozen=True)
class AnswerScore:
    """How one reply scores: ``correct`` (every answer appears in it, as whole words), ``exact`` (it is
    the reference, after normalization) and the token ``f1`` against the reference (SQuAD's)."""

    correct: bool
    exact: bool
    f1: float


def score_answer(reply: str, case: QACase) -> AnswerScore:
    """Score a generated reply (the text after ``case.answer_prefix``) against the case's answers: correct when
    it holds every answer, or any alias; exact match and F1 the best over the reference and the aliases. What of
    the reply is scored is the case's ``reply_parse``."""
    words = normalize(parse_reply(reply, case.reply_parse)).split()
    found = all(_contains(words, normalize(answer).split()) for answer in case.answers)
    found = found or any(_contains(words, normalize(alias).split()) for alias in case.aliases)
    references = [normalize(text).split() for text in (case.reference, *case.aliases)]
    return AnswerScore(
        correct=found,
        exact=any(words == reference for reference in references),
        f1=max(_f1(words, reference) for reference in references),
    )


def parse_reply(reply: str, parse: ReplyParse) -> str:
    """The part of ``reply`` that is scored. ``ReplyParse.CACHEBLEND`` is CacheBlend's ``parse_generation``
    (example/utils.py): the first line after leading newlines, "Yes" or "No" when that line starts with one.
    One difference: CacheBlend tests the line's first characters (``startswith("No")``), so a reply "Norway" or
    "Nobel Prize in Literature" became "No" and scored 0 against the very answer it gives (5 of the 150 MuSiQue
    answers start with "No"); here the first word, less punctuation, must be the whole word. An empty reply
    (where CacheBlend raised an IndexError) scores as empty."""
    if parse is ReplyParse.AS_GENERATED:
        return reply
    line = reply.lstrip("\n").split("\n")[0]
    words = line.split()
    first = words[0].strip(string.punctuation) if words else ""
    if first in ("Yes", "yes"):
        return "Yes"
    if first in ("No", "no"):
        return "No"
    return line


def normalize(text: str) -> str:
    """SQuAD's answer normalization: lower case, no punctuation, no articles, single spaces."""
    text = "".join(c for c in text.lower() if c not in string.punctuation)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def _contains(words: list[str], answer: list[str]) -> bool:
    n = len(answer)
    return n > 0 and any(words[i : i + n] == answer for i in range(len(words) - n + 1))


def _f1(words: list[str], reference: list[str]) -> float:
    common = sum((Counter(words) & Counter(reference)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(words), common / len(reference)
    return 2 * precision * recall / (precision + recall)
