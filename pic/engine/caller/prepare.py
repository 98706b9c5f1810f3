"""What a caller's thread does before the engine sees its call: resolve options, validate, tokenize, address.

All of it is pure (the tokenizer is only read), so it runs in the caller's thread and a bad input fails
there, before any command reaches the engine and without touching its state.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from pic.compile import TextOrTokens, encode, encode_documents, max_token_chars
from pic.config import CompileOptions, PICConfig
from pic.engine.request import NewRequest, OutputSink, Request
from pic.engine.sampling import SamplingParams
from pic.errors import ContextLengthError, InvalidInputError, PolicyError
from pic.ids import chunk_id
from pic.link import policies
from pic.model import ModelSpec


def compile_options(
    policy: policies.Policy, *, add_bos: bool, bos_token_id: int | None, context: Sequence[int] = ()
) -> CompileOptions:
    """The options chunks are compiled with for ``policy`` (part of their cache ids), after ``context``.

    Raises:
        PolicyError: a policy that needs extra BOS tokens with a tokenizer that has none.
    """
    options = policy.compile_options(CompileOptions(add_bos=add_bos, context=tuple(context)))
    if bos_token_id is None:  # no BOS to add: normalise so ids do not depend on the flag
        if options.num_extra_bos:
            raise PolicyError(f"policy {policy.spec!r} needs extra BOS tokens but the tokenizer has no BOS token")
        options = options.model_copy(update={"add_bos": False})
    return options


@dataclass(frozen=True)
class Documents:
    """A ``compile`` call's documents: ``ids``, one per document (repeats included), and each distinct
    chunk's content ``tokens`` under its id."""

    ids: list[str]
    tokens: dict[str, list[int]]


def documents(
    tokenizer: object,
    docs: TextOrTokens | Sequence[TextOrTokens],
    *,
    options: CompileOptions,
    spec: ModelSpec,
    fingerprint: str,
    max_chars: int | None = None,
) -> Documents:
    """Each document's content tokens and cache id.

    Raises:
        InvalidInputError: no documents, an empty document, a bad token id, bytes.
        ContextLengthError: a document that leaves no room for its BOS tokens and a query token.
    """
    token_lists = encode_documents(tokenizer, docs, vocab_size=spec.vocab_size, max_chars=max_chars)
    most = spec.max_context - options.add_bos - max(1, options.num_dropped)
    for i, tokens in enumerate(token_lists):
        if len(tokens) > most:
            raise ContextLengthError(
                f"document {i} has {len(tokens)} tokens; at most {most} fit the {spec.max_context}-token context "
                f"of {spec.architecture} with its {options.add_bos + options.num_extra_bos} BOS tokens, "
                f"{len(options.context)} context tokens and at least one query token; split it into smaller chunks"
            )
    ids = [chunk_id(fingerprint, tokens, options) for tokens in token_lists]
    return Documents(ids=ids, tokens=dict(zip(ids, token_lists, strict=True)))


def prompt_ids(
    request: Request, tokenizer: object, *, vocab_size: int, bos_token_id: int | None, max_chars: int | None = None
) -> tuple[list[int], list[int]]:
    """The request's prefix and query token ids. The BOS (``None``: none) goes first: on the prefix, or
    on the query when there is neither a prefix nor a chunk (a chunk brings its own).

    Raises:
        InvalidInputError: a query of no tokens once tokenized, a bad token id.
    """
    query_ids = encode(tokenizer, request.query, what="query", vocab_size=vocab_size, max_chars=max_chars)
    prefix_ids = encode(tokenizer, request.prefix, what="prefix", vocab_size=vocab_size, max_chars=max_chars)
    if not query_ids:
        raise InvalidInputError(f"query {request.query!r} has no tokens; link needs at least one query token")
    if bos_token_id is not None and (prefix_ids or not request.cache_ids):
        (prefix_ids if prefix_ids else query_ids).insert(0, bos_token_id)
    return prefix_ids, query_ids


class Preparer:
    """Turns a caller's request into the ``NewRequest`` the engine's thread runs: policy resolved, compile
    options derived, prompt tokenized, id assigned (shared by ``Engine`` and its ``Stepper``).

    Args:
        tokenizer, spec: the model's tokenizer and shapes.
        config: the engine's options (``add_bos`` resolved).
        bos_token_id: the tokenizer's BOS (``None``: none).
    """

    def __init__(self, tokenizer: object, spec: ModelSpec, *, config: PICConfig, bos_token_id: int | None) -> None:
        self.tokenizer, self.spec, self.config, self.bos_token_id = tokenizer, spec, config, bos_token_id
        self.default_policy = policies.resolve(config.default_policy)
        # Longer text cannot fit the context, so it is refused untokenized (twice the bound: a normalizer may
        # compose characters, "e" + U+0301 -> "é", before the tokens are counted).
        self.max_chars = 2 * spec.max_context * max_token_chars(tokenizer)
        self._ids = itertools.count()

    def policy(self, policy: str | policies.Policy | None) -> policies.Policy:
        return self.default_policy if policy is None else policies.resolve(policy)

    def compile_options(
        self, policy: str | policies.Policy | None, *, context: TextOrTokens | None = None
    ) -> CompileOptions:
        context_ids = () if context is None else self.context_ids(context)
        return compile_options(
            self.policy(policy), add_bos=self.config.add_bos, bos_token_id=self.bos_token_id, context=context_ids
        )

    def context_ids(self, context: TextOrTokens) -> list[int]:
        """The token ids of a compile context: text tokenized without special tokens, after the BOS when the
        engine starts prompts with one (a context is a prompt's start, as a prefix is).

        Raises:
            InvalidInputError: an empty context, a bad token id or text.
        """
        ids = encode(self.tokenizer, context, what="context", vocab_size=self.spec.vocab_size, max_chars=self.max_chars)
        if not ids:
            raise InvalidInputError(f"context {context!r:.80} has no tokens; leave it out to compile without one")
        if self.config.add_bos and self.bos_token_id is not None and ids[0] != self.bos_token_id:
            ids.insert(0, self.bos_token_id)
        return ids

    def new_request(
        self, request: Request, *, sink: OutputSink, sampling: SamplingParams | None, paced: bool = False
    ) -> NewRequest:
        """``request`` as the engine's thread runs it, its outputs going to ``sink``.

        Raises:
            InvalidInputError: an empty query, a bad token id or text.
            PolicyError: as ``compile_options``.
        """
        prefix_ids, query_ids = prompt_ids(
            request,
            self.tokenizer,
            vocab_size=self.spec.vocab_size,
            bos_token_id=self.bos_token_id if self.config.add_bos else None,
            max_chars=self.max_chars,
        )
        policy = self.default_policy if request.policy is None else request.policy  # (resolved by ``Request``)
        return NewRequest(
            request_id=next(self._ids), cache_ids=list(request.cache_ids), prefix_ids=prefix_ids, query_ids=query_ids,
            policy=policy, order=request.order, relevance=request.relevance,
            compile_options=compile_options(policy, add_bos=self.config.add_bos, bos_token_id=self.bos_token_id),
            sampling=sampling, sink=sink, paced=paced,
        )  # fmt: skip
