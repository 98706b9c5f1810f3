"""The scheduler side's decision for one linked request: which prompt tokens pic loads, and why not.

vLLM computes a suffix of every prompt: what a connector claims must run from the tokens vLLM already
holds (``num_computed``, its own prefix-cache hit) to some end, with no gap. So a link's prompt is read as

    prefix | chunk_1 ... chunk_n | query
    0      P                 P + C       len(prompt)

and pic claims ``[num_computed, P + C - R)``: the prefix's missing part (itself a chunk in pic's store, computed
at positions 0.. and so exact), then the chunks' tokens at their positions, up to the ``R`` last chunk tokens
the policy leaves to vLLM. The plan is made from token ids only (each chunk's ids from the store's metadata):
the prompt must hold the chunks' exact tokens, in order, or nothing is claimed (a plain prefill, with the
reason), never a cache for tokens the prompt does not have.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class LoadSpan:
    """Tokens of one stored chunk to load: the chunk's tokens ``[offset, offset + num_tokens)`` go to prompt
    positions ``[start, start + num_tokens)``."""

    cache_id: str
    start: int
    offset: int
    num_tokens: int


@dataclass(frozen=True)
class ConnectorPlan:
    """What the connector does for a request.

    Attributes:
        segments: what to load, in prompt order (empty: nothing).
        num_external: tokens claimed beyond ``num_computed`` (vLLM's ``get_num_new_matched_tokens``).
        num_prefix: ``P``, tokens before the first chunk.
        num_chunk_tokens: ``C``.
        num_recomputed: chunk tokens left to vLLM's forward (``R``, the policy's).
        save_prefix: the prefix's id, when the prefix is in no tier: this request is a plain prefill that
            stores its prefix, so the next link with it loads it.
        reason: why nothing is linked (``None`` when the plan links).
    """

    segments: tuple[LoadSpan, ...] = ()
    num_external: int = 0
    num_prefix: int = 0
    num_chunk_tokens: int = 0
    num_recomputed: int = 0
    save_prefix: str | None = None
    reason: str | None = None


def find_chunks(prompt: Sequence[int], chunks: Sequence[Sequence[int]]) -> int | None:
    """``P``: where the chunks' tokens, one after another, start in ``prompt`` with at least one token after
    them (the first such place); ``None`` when the prompt does not hold them so."""
    joined = [t for chunk in chunks for t in chunk]
    n, m = len(prompt), len(joined)
    if m == 0:
        return None
    first = joined[0]
    for p in range(0, n - m):  # p + m < n: a query token must follow
        if prompt[p] == first and list(prompt[p : p + m]) == joined:
            return p
    return None


def plan_link(
    prompt: Sequence[int],
    ids: Sequence[str],
    chunks: Sequence[Sequence[int]],
    *,
    start: int | None,
    num_computed: int,
    num_recomputed: int,
    prefix_id: str | None,
    prefix_stored: bool,
) -> ConnectorPlan:
    """The plan for a prompt that should hold ``chunks`` (``ids``' tokens) after a prefix.

    Args:
        start: ``find_chunks(prompt, chunks)``.
        num_computed: prompt tokens vLLM already holds (its prefix cache), block-aligned.
        num_recomputed: chunk tokens the policy leaves to vLLM (clamped to the chunks).
        prefix_id: the id the prefix ``prompt[:P]`` has as a chunk (``None``: no prefix, ``P == 0``).
        prefix_stored: whether a tier holds ``prefix_id``.
    """
    if start is None:
        return ConnectorPlan(
            reason="the prompt does not hold the chunks' tokens in the order named, followed by a query "
            "(send prompt_token_ids built by pic.vllm.client, or text whose tokenization keeps each document's tokens)"
        )
    num_chunk = sum(len(c) for c in chunks)
    recomputed = min(max(num_recomputed, 0), num_chunk)
    end = start + num_chunk - recomputed
    base = ConnectorPlan(num_prefix=start, num_chunk_tokens=num_chunk, num_recomputed=recomputed)
    if end <= num_computed:
        return replace(base, reason=None)  # vLLM's own cache already holds all pic would load
    segments: list[LoadSpan] = []
    if num_computed < start:
        if not prefix_stored:
            return replace(
                base,
                save_prefix=prefix_id,
                reason="the prompt's prefix (tokens before the first chunk) is in no tier yet: this request "
                "prefills it and stores it, and links from the next request with this prefix",
            )
        segments.append(LoadSpan(prefix_id, num_computed, num_computed, start - num_computed))
    position = start
    for cache_id, chunk in zip(ids, chunks, strict=True):
        lo, hi = max(position, num_computed), min(position + len(chunk), end)
        if hi > lo:
            segments.append(LoadSpan(cache_id, lo, lo - position, hi - lo))
        position += len(chunk)
    return replace(base, segments=tuple(segments), num_external=end - num_computed)
