"""The order a link's chunks take in its prompt: the caller's, or by relevance to the query.

A retriever hands pic its documents in *some* order, and the order moves answers: on SmolLM2-135M, Full Recompute
of paragraphs asked about after them answers more often with the most relevant paragraph next to the question than
in the retriever's order (docs/policies.md#the-documents-order). pic's chunks are position independent, so reordering
them costs nothing: the same cached KV is linked at other positions. But the order is part of the prompt the
model reads, so a link that reorders is no longer the caller's prompt; the link reports the order it ran
(``ChunkOrder``), and ``Order.GIVEN`` keeps the caller's order token for token.

Relevance comes from the caller's scores when the request has them (``link(..., relevance=[...])``: a
retriever's), else from BM25 over token ids between each chunk and the query (``bm25``): no model, no text. The
words a retriever matched, counted on the tokenizer's ids, rank the document holding the answer first in every
case of both QA workloads on SmolLM2 (docs/policies.md), where the query's attention over the cached chunks (a
probe) does no better than chance. Ties keep the caller's order.
"""

from __future__ import annotations

import enum
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from pic.errors import InvalidInputError
from pic.text import refuse_text_for_list

T = TypeVar("T")

# BM25's usual constants: term-frequency saturation and length normalisation.
_K1, _B = 1.2, 0.75


class Order(str, enum.Enum):
    """How a link orders its chunks.

    - ``GIVEN``: the caller's order, token for token.
    - ``RELEVANCE``: the least relevant first, the most relevant last, next to the query (where a model
      reading the question after the documents looks most; and where a recomputed suffix would fall).
    - ``POLICY``: the link's policy's (``Policy.order``): ``auto`` orders by relevance; every other built-in
      policy keeps the caller's order.
    """

    GIVEN = "given"
    RELEVANCE = "relevance"
    POLICY = "policy"


def parse_order(value: object) -> Order:
    """``value`` (an ``Order`` or its name) as an ``Order``.

    Raises:
        InvalidInputError: anything else, naming the value and the orders there are.
    """
    try:
        return Order(value)
    except (ValueError, TypeError):
        names = ", ".join(repr(o.value) for o in Order)
        raise InvalidInputError(f"order is {value!r:.80}; expected one of {names}") from None


@dataclass(frozen=True)
class ChunkOrder:
    """The order a link ran its chunks in: ``GIVEN`` or ``RELEVANCE`` (what ``POLICY`` resolved to), and the
    caller's chunk indices in prompt order."""

    order: Order
    indices: tuple[int, ...]

    @property
    def moved(self) -> bool:
        """Whether any chunk left the caller's place."""
        return self.indices != tuple(range(len(self.indices)))

    def apply(self, items: Sequence[T]) -> list[T]:
        """``items`` (one per chunk, in the caller's order) in prompt order."""
        if len(items) != len(self.indices):
            raise InvalidInputError(f"{len(items)} items for an order of {len(self.indices)} chunks")
        return [items[i] for i in self.indices]


def chunk_order(
    order: Order,
    query: Sequence[int],
    chunks: Sequence[Sequence[int] | TermStats],
    relevance: Sequence[float] | None = None,
) -> ChunkOrder:
    """The order ``order`` gives (``POLICY`` is resolved by the linker first). ``RELEVANCE``: the chunks least
    relevant first (a stable sort) by ``relevance`` (higher: more relevant), else by BM25 against ``query`` (a chunk
    given as its tokens or its ``TermStats``)."""
    if order is Order.GIVEN:
        return ChunkOrder(Order.GIVEN, tuple(range(len(chunks))))
    if order is not Order.RELEVANCE:
        raise InvalidInputError(f"order {order.value!r} must be resolved by the link's policy first")
    scores = list(relevance) if relevance is not None else bm25(list(query), list(chunks))
    return ChunkOrder(Order.RELEVANCE, tuple(sorted(range(len(chunks)), key=lambda i: scores[i])))


@dataclass(frozen=True)
class TermStats:
    """What BM25 reads of one unit (``term_stats``), made once per chunk, not once per link: its length, each
    distinct token's count, and each distinct token's place in ``set(tokens)``'s iteration order (the order
    ``bm25`` meets the terms in, which fixes the order its sums add in)."""

    length: int
    counts: Counter
    order: dict[int, int]


def term_stats(tokens: Sequence[int] | torch.Tensor) -> TermStats:
    """``tokens``' ``TermStats`` (a tensor: its ``[L]`` token ids)."""
    tokens = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
    return TermStats(len(tokens), Counter(tokens), {t: i for i, t in enumerate(set(tokens))})


def bm25(
    query: Sequence[int],
    units: Sequence[Sequence[int] | TermStats],
    *,
    corpus: Sequence[Sequence[int] | TermStats] | None = None,
):
    """BM25 of each unit (a chunk, or a window of one) against the query's distinct tokens: ``list[float]``, 0 for a
    unit sharing no token with it. The terms' rarity (IDF) is counted over ``corpus`` (default: ``units``): windows
    of chunks are scored with the chunks' IDF, so a word every chunk has counts for little in any window. A unit may
    be its ``TermStats`` (a chunk's, kept between links): then its cost is the query's terms, not its tokens."""
    units = [u if isinstance(u, TermStats) else term_stats(u) for u in units]
    corpus = units if corpus is None else [u if isinstance(u, TermStats) else term_stats(u) for u in corpus]
    terms = set(query)
    df: Counter = Counter()
    for doc in corpus:  # the terms each doc holds, in its set's order (as iterating ``set(doc)`` meets them)
        df.update(sorted((t for t in terms if t in doc.order), key=doc.order.__getitem__))
    idf = {t: math.log(1 + (len(corpus) - n + 0.5) / (n + 0.5)) for t, n in df.items()}
    mean_len = sum(u.length for u in units) / max(len(units), 1)
    scores = []
    for unit in units:
        counts, norm = unit.counts, _K1 * (1 - _B + _B * unit.length / max(mean_len, 1e-9))
        scores.append(sum(w * counts[t] * (_K1 + 1) / (counts[t] + norm) for t, w in idf.items() if counts[t]))
    return scores


def relevance_scores(relevance: object, num_chunks: int) -> tuple[float, ...] | None:
    """``relevance`` as a tuple of floats, one per chunk (``None``: not given).

    Raises:
        InvalidInputError: not a sequence of finite numbers, or not ``num_chunks`` of them.
    """
    if relevance is None:
        return None
    refuse_text_for_list(relevance, "relevance", "numbers, one per cache id")
    if not isinstance(relevance, Sequence | torch.Tensor):
        raise InvalidInputError(f"relevance is {relevance!r:.80}; expected one number per cache id")
    values = relevance.tolist() if isinstance(relevance, torch.Tensor) else list(relevance)
    if not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in values):
        raise InvalidInputError(f"relevance {values!r:.80} holds something else than finite numbers")
    if len(values) != num_chunks:
        raise InvalidInputError(f"relevance has {len(values)} scores for {num_chunks} cache ids; give one per cache id")
    return tuple(float(v) for v in values)
