"""The order a link's chunks take in its prompt: the caller's, or by relevance to the query.

A retriever hands pic its documents in *some* order, and the order moves answers: on SmolLM2-135M, Full Recompute
of paragraphs asked about after them answers 8 points more often with the most relevant paragraph next to the
question than in the retriever's order (docs/policies.md). pic's chunks are position independent, so reordering
them costs nothing: the same cached KV is linked at other positions. But the order is part of the prompt the
model reads, so a link that reorders is no longer the caller's prompt; the link reports the order it ran
(``ChunkOrder``), and ``Order.GIVEN`` keeps the caller's order token for token.

Relevance comes from the caller's scores when the request has them (``link(..., relevance=[...])``: a
retriever's), else from BM25 over token ids between each chunk and the query (``pic.link.lexical``):
no model, no text. Ties keep the caller's order, so chunks the query shares nothing with stay where they were.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from pic.errors import InvalidInputError
from pic.link.lexical import bm25
from pic.text import refuse_text_for_list

T = TypeVar("T")


class Order(str, enum.Enum):
    """How a link orders its chunks.

    - ``GIVEN``: the caller's order, token for token.
    - ``RELEVANCE``: the least relevant first, the most relevant last, next to the query (where a model
      reading the question after the documents looks most; and where a recomputed suffix would fall).
    - ``POLICY``: what the link's policy chooses for the layout (``Policy.order_for``): ``auto`` orders by
      relevance; every other built-in policy keeps the caller's order.
    """

    GIVEN = "given"
    RELEVANCE = "relevance"
    POLICY = "policy"


def parse_order(value: object) -> Order:
    """``value`` (an ``Order`` or its name) as an ``Order``.

    Raises:
        InvalidInputError: anything else, naming the value and the orders there are.
    """
    if isinstance(value, Order):
        return value
    if isinstance(value, str):
        try:
            return Order(value)
        except ValueError:
            pass
    names = ", ".join(repr(o.value) for o in Order)
    raise InvalidInputError(f"order is {value!r:.80}; expected one of {names}")


@dataclass(frozen=True)
class ChunkOrder:
    """The order a link ran its chunks in.

    Attributes:
        order: ``GIVEN`` or ``RELEVANCE`` (what ``POLICY`` resolved to).
        indices: the caller's chunk indices in prompt order (``(0, 1, ..., n-1)`` when nothing moved).
    """

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


def given(num_chunks: int) -> ChunkOrder:
    """The caller's order of ``num_chunks`` chunks."""
    return ChunkOrder(Order.GIVEN, tuple(range(num_chunks)))


def by_relevance(
    query: Sequence[int], chunks: Sequence[Sequence[int]], relevance: Sequence[float] | None = None
) -> ChunkOrder:
    """The chunks least relevant first, most relevant last: by ``relevance`` (one score per chunk, higher: more
    relevant) when given, else by BM25 of each chunk's token ids against ``query``'s. Ties keep the caller's
    order (a stable sort), so a query that shares no token with any chunk leaves them as they were."""
    scores = list(relevance) if relevance is not None else bm25(list(query), [list(c) for c in chunks])
    indices = sorted(range(len(chunks)), key=lambda i: scores[i])
    return ChunkOrder(Order.RELEVANCE, tuple(indices))


def chunk_order(
    order: Order, query: Sequence[int], chunks: Sequence[Sequence[int]], relevance: Sequence[float] | None = None
) -> ChunkOrder:
    """The order ``order`` (``GIVEN`` or ``RELEVANCE``; ``POLICY`` is resolved by the linker first) gives."""
    if order is Order.RELEVANCE:
        return by_relevance(query, chunks, relevance)
    if order is Order.GIVEN:
        return given(len(chunks))
    raise InvalidInputError(f"order {order.value!r} must be resolved by the link's policy first")


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
