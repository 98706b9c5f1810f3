"""Lexical relevance of prompt regions to the query: BM25 over token ids, no model and no text needed.

A retriever found the linked chunks because they share words with the question; the same overlap, counted
on the tokenizer's ids, says which chunk (and which window of it) the question is about. Measured on
SmolLM2 (docs/policies.md), it ranks the document holding the answer first in every case of both QA
workloads, where the query's attention over the cached chunks (a probe) does no better than chance.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

# BM25's usual constants: term-frequency saturation and length normalisation.
_K1, _B = 1.2, 0.75


def bm25(query: Sequence[int], units: Sequence[Sequence[int]], *, corpus: Sequence[Sequence[int]] | None = None):
    """BM25 of each unit (a chunk, or a window of one) against the query's distinct tokens.

    Args:
        query: the query's token ids.
        units: the token ids of each unit scored.
        corpus: the documents the terms' rarity (IDF) is counted over (default: ``units``); windows of
            chunks are scored with the chunks' IDF, so a word every chunk has counts for little in any window.

    Returns:
        ``list[float]``, one score per unit (0 for a unit sharing no token with the query).
    """
    corpus = units if corpus is None else corpus
    terms = set(query)
    df = Counter(t for doc in corpus for t in set(doc) if t in terms)
    idf = {t: math.log(1 + (len(corpus) - n + 0.5) / (n + 0.5)) for t, n in df.items()}
    mean_len = sum(len(u) for u in units) / max(len(units), 1)
    scores = []
    for unit in units:
        counts, norm = Counter(unit), _K1 * (1 - _B + _B * len(unit) / max(mean_len, 1e-9))
        scores.append(sum(w * counts[t] * (_K1 + 1) / (counts[t] + norm) for t, w in idf.items() if counts[t]))
    return scores
