"""Laying a linked prompt out in blocks: segments, padding, positions and slots.

The linked prompt is ``prefix + chunk_1 + ... + chunk_n + query``. Every segment but the query is
*front-padded* to a whole number of blocks (MEPIC's canonical layout): a chunk then always fills the
same block-relative slots, whatever precedes it, so its blocks can hold identical content in every
request. The query starts on a block boundary and generation appends after it. Padding slots
consume no positions: logical positions run ``0 .. T-1`` over the real tokens, exactly as in the
unpadded prompt, and attention masks padding out. (APE lays chunks out in *parallel* instead: each
starts right after the prefix, and the query follows the longest.)
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pic.kv import ChunkInfo, ChunkKV


class SegmentKind(enum.Enum):
    PREFIX = "prefix"
    CHUNK = "chunk"
    QUERY = "query"


@dataclass(frozen=True)
class Segment:
    """A contiguous run of the linked prompt: its tokens' indices (``tokens``), the request slot of its first token
    (``slot_start``, after ``num_padding`` front padding slots), a chunk's cache id and the relevance to the query
    the request gave it (``link(..., relevance=...)``)."""

    kind: SegmentKind
    token_start: int
    num_tokens: int
    slot_start: int
    num_padding: int
    cache_id: str | None = None
    relevance: float | None = None

    @property
    def tokens(self) -> slice:
        return slice(self.token_start, self.token_start + self.num_tokens)


@dataclass(frozen=True)
class Layout:
    """A linked prompt laid out in a request's slots.

    Attributes:
        token_ids: ``[T]`` int64, the linked prompt without padding.
        positions: ``[T]`` int64 logical positions (``0 .. T-1``).
        slots: ``[T]`` int64 request slots of the tokens (padding skipped).
        cached: ``[T]`` bool, True for chunk tokens, whose KV the store holds.
        num_slots: slots the prompt spans, padding included.
        num_generated: tokens at the end of the query that the request generated (a preempted request is
            laid out again with them); a policy reading the query's text leaves them out (``query_ids``).
        lexical: each chunk's BM25 against the query (``pic.link.order.bm25``), in prompt order, when the link
            ranked its chunks by it: a policy that ranks them the same way (``regions``) reads it, not ranks again.
    """

    block_size: int
    segments: tuple[Segment, ...]
    token_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    cached: torch.Tensor
    num_slots: int
    num_generated: int = 0
    lexical: tuple[float, ...] | None = None

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    @property
    def chunks(self) -> tuple[Segment, ...]:
        return tuple(s for s in self.segments if s.kind is SegmentKind.CHUNK)

    @property
    def query(self) -> Segment:
        return self.segments[-1]

    @property
    def query_ids(self) -> list[int]:
        """The query's token ids as the request gave them (without generated tokens)."""
        query = self.query
        return self.token_ids[query.token_start : query.token_start + query.num_tokens - self.num_generated].tolist()

    def recomputed_whole(self, recomputed: torch.Tensor, indices: Sequence[int]) -> tuple[int, ...]:
        """The chunks ``recomputed`` (``[T]`` bool) covers whole, the documents a link read fresh, as ``indices`` (the
        caller's index of each chunk in prompt order: ``ChunkOrder.indices``) name them, in prompt order."""
        chunks = zip(indices, self.chunks, strict=True)
        return tuple(i for i, seg in chunks if seg.num_tokens and bool(recomputed[seg.tokens].all()))

    @property
    def end_position(self) -> int:
        """The logical position of the token that follows the prompt (the first generated one)."""
        return int(self.positions[-1]) + 1


def lay_out(
    *,
    prefix: Sequence[int],
    chunks: Sequence[ChunkInfo | ChunkKV],
    query: Sequence[int],
    block_size: int,
    parallel: bool = False,
    relevance: Sequence[float] | None = None,
    num_generated: int = 0,
    lexical: Sequence[float] | None = None,
) -> Layout:
    """Place prefix, chunks and query in slots (the module docstring); ``relevance``, one score per chunk, is
    kept in its segment. Per segment, not per token: the token ids are the chunks' own tensors concatenated, and
    slots and ``cached`` come from one ``repeat_interleave`` over the segments (a 32K-token link of 64 chunks
    builds them in a few torch calls, not from lists of 32K Python ints)."""
    scores = list(relevance) if relevance is not None else [None] * len(chunks)
    parts = [(SegmentKind.PREFIX, _ids(prefix), None, None)] if prefix else []
    parts += [(SegmentKind.CHUNK, _ids(c.token_ids), c.cache_id, r) for c, r in zip(chunks, scores, strict=True)]
    parts.append((SegmentKind.QUERY, _ids(query), None, None))
    segments, lengths, shifts = [], [], []
    num_slots = num_tokens = 0
    for kind, ids, cache_id, score in parts:
        n = ids.shape[0]
        padding = 0 if kind is SegmentKind.QUERY else -n % block_size
        slot_start = num_slots + padding
        segments.append(Segment(kind, num_tokens, n, slot_start, padding, cache_id, score))
        lengths.append(n)
        shifts.append(slot_start - num_tokens)  # a segment's slots: its tokens' indices, shifted
        num_tokens += n
        num_slots = slot_start + n
    counts = torch.tensor(lengths)
    kinds = torch.tensor([kind is SegmentKind.CHUNK for kind, *_ in parts])
    return Layout(
        block_size=block_size,
        segments=tuple(segments),
        token_ids=torch.cat([ids for _, ids, *_ in parts]),  # (a copy: never a chunk's own tensor)
        positions=_parallel_positions(segments) if parallel else torch.arange(num_tokens),
        slots=torch.arange(num_tokens) + torch.tensor(shifts).repeat_interleave(counts, output_size=num_tokens),
        cached=kinds.repeat_interleave(counts, output_size=num_tokens),
        num_slots=num_slots,
        num_generated=num_generated,
        lexical=None if lexical is None else tuple(lexical),
    )


def _ids(tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """``[n]`` int64 (CPU) token ids."""
    if isinstance(tokens, torch.Tensor):  # (a chunk's: int64 on the CPU already, as it is, no dispatch)
        ok = tokens.dtype is torch.long and tokens.dim() == 1 and not tokens.is_cuda
        return tokens if ok else tokens.reshape(-1).long().cpu()
    return torch.tensor(list(tokens), dtype=torch.long)


def _parallel_positions(segments: list[Segment]) -> torch.Tensor:
    start = sum(seg.num_tokens for seg in segments if seg.kind is SegmentKind.PREFIX)
    longest = max((seg.num_tokens for seg in segments if seg.kind is SegmentKind.CHUNK), default=0)
    first = {SegmentKind.PREFIX: 0, SegmentKind.CHUNK: start, SegmentKind.QUERY: start + longest}
    return torch.cat([torch.arange(first[seg.kind], first[seg.kind] + seg.num_tokens) for seg in segments])
