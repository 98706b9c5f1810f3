"""Scoring a generated answer: found (every answer in the reply), exact match and token F1, as SQuAD scores them."""

from __future__ import annotations

import re
import string
from collections import Counter
from dataclasses import dataclass

from pic.evaluation.qa import QACase


@dataclass(frozen=True)
class AnswerScore:
    """How one reply scores: ``correct`` (every answer appears in it, as whole words), ``exact`` (it is
    the reference, after normalization) and the token ``f1`` against the reference (SQuAD's)."""

    correct: bool
    exact: bool
    f1: float


def score_answer(reply: str, case: QACase) -> AnswerScore:
    """Score a generated reply (the text after ``case.answer_prefix``) against the case's answers."""
    words = normalize(reply).split()
    found = all(_contains(words, normalize(answer).split()) for answer in case.answers)
    reference = normalize(case.reference).split()
    return AnswerScore(correct=found, exact=words == reference, f1=_f1(words, reference))


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
