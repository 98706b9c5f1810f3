"""What a user hands the engine (``Request``) and what a step hands back (``RequestOutput``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pic.compile import TextOrTokens, cache_id_list, encode
from pic.errors import InvalidInputError
from pic.link import Generation, SamplingParams, policies


class Request:
    """One generation: link ``cache_ids`` with ``query`` (after ``prefix``) under ``policy``, then generate.

    The prompt is ``prefix + chunk_1 + ... + chunk_n + query``, as in ``PIC.link``; the sampling options
    are ``Linked.generate``'s (``SamplingParams``). A request's output does not depend on what it is
    batched with: seeded sampling uses the request's own generator.

    Raises:
        InvalidInputError: cache ids that are not strings, a bad sampling option.
        PolicyError: an unknown policy spec.
    """

    def __init__(
        self,
        cache_ids: Sequence[str],
        query: TextOrTokens,
        *,
        prefix: TextOrTokens = "",
        policy: str | policies.Policy | None = None,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
    ) -> None:
        self.cache_ids = cache_id_list(cache_ids)
        self.query, self.prefix = query, prefix
        self.policy = None if policy is None else policies.resolve(policy)
        self.sampling = SamplingParams(
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop
        )

    def __repr__(self) -> str:
        return f"Request(num_chunks={len(self.cache_ids)}, query={self.query!r}, policy={self.policy}, {self.sampling})"


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request.

    Attributes:
        request_id: the id ``Engine.add_request`` returned.
        text: text that became final in this step (the pieces of a request concatenate to its text).
        token_ids: tokens sampled in this step (0 or 1).
        finished: the request is done (finished, failed or aborted) and its blocks are freed.
        generation: the whole result, once finished (``None`` when it failed).
        error: why the request failed (``PicError``: an unknown cache id, a prompt longer than the
            context, a pool that can never hold it ...), else ``None``.
    """

    request_id: int
    text: str
    token_ids: tuple[int, ...]
    finished: bool
    generation: Generation | None = None
    error: Exception | None = None


def prompt_ids(
    request: Request, tokenizer: object, *, vocab_size: int, bos_token_id: int | None
) -> tuple[list[int], list[int]]:
    """The request's prefix and query token ids. The BOS (``None``: none) goes first: on the prefix, or
    on the query when there is neither a prefix nor a chunk (a chunk brings its own).

    Raises:
        InvalidInputError: an empty query, a bad token id.
    """
    query_ids = encode(tokenizer, request.query, what="query", vocab_size=vocab_size)
    prefix_ids = encode(tokenizer, request.prefix, what="prefix", vocab_size=vocab_size)
    if not query_ids:
        raise InvalidInputError(f"query {request.query!r} has no tokens; link needs at least one query token")
    if bos_token_id is not None and (prefix_ids or not request.cache_ids):
        (prefix_ids if prefix_ids else query_ids).insert(0, bos_token_id)
    return prefix_ids, query_ids
