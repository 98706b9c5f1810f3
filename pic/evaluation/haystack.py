"""A haystack of real English prose that every install carries: the prose of CPython's reference topics.

``pydoc_data.topics`` (the text ``help("assignment")`` prints) is in the standard library of every
Python. Its paragraphs of ordinary prose become one ordered list of sentences: code (indented lines,
``>>>`` and ``...`` lines, grammar rules), headings and their underlines, list items, footnotes, reST
markup, short fragments and repeats are dropped, whitespace is normalised. The list is the same on every machine
with the same Python version (the topics change a little between versions).
"""

from __future__ import annotations

import functools
import re
import sys

MIN_SENTENCE_CHARS = 40
MAX_SENTENCE_CHARS = 400
# A sentence ends at ".", "!" or "?" followed by a space and a capital letter (or a quote and a capital).
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\u201c\"])")
_UNDERLINE = re.compile(r"^([*=\-~^#+`])\1{2,}\s*$")
_ITEM = re.compile(r"^(\*|-|\+|\d+\.|[a-z]\.|\[\d+\]|\[#|\.\.|\|)\s")
_EMPHASIS = re.compile(r"\*{1,2}([^*\s][^*]*?)\*{1,2}")
_NOT_PROSE = ("::", ">>>", "...", "__", "()", "=", "{", "}", "<", ">", "\\", "[", "]", "|", "`", '""', "\"'", "'\"")
_ABBREVIATIONS = ("e.g.", "i.e.", "etc.", "vs.", "cf.")


def source() -> str:
    """Where the haystack's text comes from, for a workload's description."""
    return f"pydoc_data.topics (Python {sys.version_info.major}.{sys.version_info.minor})"


@functools.cache
def sentences() -> tuple[str, ...]:
    """The prose sentences of ``pydoc_data.topics``, topic by topic in sorted key order, each once (some
    topics repeat others' paragraphs)."""
    from pydoc_data.topics import topics

    out: dict[str, None] = {}
    for key in sorted(topics):
        for paragraph in _paragraphs(topics[key]):
            out.update(dict.fromkeys(s for s in _split(paragraph) if _is_prose(s)))
    return tuple(out)


def _paragraphs(text: str) -> list[str]:
    """The topic's prose paragraphs, each on one line: blocks of unindented lines that are not headings,
    list items, footnotes or code."""
    kept = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.split("\n")
        if any(not line or line[0].isspace() or line.startswith((">>>", "...")) for line in lines):
            continue  # code, a grammar rule, or a list item's continuation
        if any(_UNDERLINE.match(line) for line in lines) or _ITEM.match(lines[0]):
            continue  # a heading, a list item, a footnote, a directive
        paragraph = _EMPHASIS.sub(r"\1", " ".join(line.strip() for line in lines))
        if paragraph.endswith(":"):
            paragraph = paragraph.rsplit(". ", 1)[0] + "." if ". " in paragraph else ""  # it introduces code
        kept.append(" ".join(paragraph.split()))
    return kept


def _split(paragraph: str) -> list[str]:
    """Sentences, split after ".", "!" or "?" before a capital letter (not after "e.g." and the like)."""
    parts: list[str] = []
    for piece in _SENTENCE_END.split(paragraph):
        if parts and parts[-1].endswith(_ABBREVIATIONS):
            parts[-1] += " " + piece
        else:
            parts.append(piece)
    return parts


def _is_prose(sentence: str) -> bool:
    """An ordinary sentence: a capital letter first, a full stop last, mostly words, no code, no long numbers."""
    return (
        MIN_SENTENCE_CHARS <= len(sentence) <= MAX_SENTENCE_CHARS
        and sentence[0].isupper()
        and sentence.endswith(".")
        and not any(mark in sentence for mark in _NOT_PROSE)
        and not re.search(r"\d{4,}", sentence)
        and sum(c.isalpha() or c == " " for c in sentence) >= 0.9 * len(sentence)
    )
