"""Errors raised by pic.

Every public failure is a :class:`PicError` whose message names the offending value. A failed call
leaves every cached chunk intact: inputs are validated before any state changes.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable


class PicError(Exception):
    """Base class of every error pic raises on purpose."""


class InvalidInputError(PicError, ValueError):
    """An argument has a value pic cannot use (empty document, bad token id, bad sampling option)."""


class UnknownCacheIdError(PicError):
    """A cache id that the engine's store does not hold."""


class PolicyError(PicError, ValueError):
    """A policy spec that names no registered policy or gives it a bad argument, a policy class
    registered under a taken name, or a policy whose selection is malformed."""


class CompileOptionsMismatchError(PicError):
    """A chunk was compiled with other options than the linking policy needs."""


class ContextLengthError(PicError):
    """A chunk or a linked prompt is longer than the model's context."""


class ModelLoadError(PicError, OSError):
    """A model or tokenizer could not be loaded (no such folder, not in the Hugging Face cache while
    offline, not a causal LM); the message names the model."""


class UnsupportedModelError(PicError):
    """The model is not a supported rotary-embedding decoder."""


class NoEngineError(PicError):
    """A module-level function was called before ``pic.load``."""


class LinkedReleasedError(PicError):
    """A ``Linked`` request was used after it was generated from or released."""


class EngineClosedError(PicError):
    """The engine was closed (``PIC.close``) while a call waited on it, or before the call."""


class EngineStepError(PicError, RuntimeError):
    """Something raised inside the engine that was no request's own error (a bug, a device fault) in a step, its
    forward or sampling, or its store I/O: the work it stopped fails with it (the fault is ``__cause__``); the engine
    goes on serving, or, when its state no longer adds up after a failed step, closes (``EngineClosedError`` from
    then on). The server answers it as the fault it wraps: a 500."""

    @classmethod
    def of(cls, exc: Exception) -> PicError:
        """What a request that ``exc`` stopped gets: a ``PicError`` as it is, anything else as the error it caused."""
        if isinstance(exc, PicError):
            return exc
        error = cls(f"an engine step failed: {type(exc).__name__}: {first_line(exc)}")
        error.__cause__ = exc
        return error


class SequenceStateError(PicError):
    """A request's sequence inside the engine broke its state machine (a transition its status does not allow,
    or a status where its queue holds no such sequence): that request fails with it, the engine goes on."""


class MissingDependencyError(PicError, ImportError):
    """An optional dependency a feature needs is not installed (the message names the extra)."""


class StoreUnavailableError(PicError):
    """A store tier (Redis) could not be reached or failed; the message names its URL."""


class StoreFullError(PicError):
    """Compiled chunks have no room: the KV pool (the store's device tier) is full of blocks in use and
    pinned chunks, and no lower tier can take them."""


class KVPoolExhaustedError(StoreFullError):
    """The KV pool has fewer free and evictable blocks than a request or a compile call needs; the
    message gives both numbers. Nothing was taken."""


CALLER_ERRORS = (InvalidInputError, UnknownCacheIdError, PolicyError, CompileOptionsMismatchError, ContextLengthError)
"""The errors of a caller's own input: the caller gets them and can fix them, so the engine does not log them too
(at debug only; the server's access log has their status)."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none), for wrapping a
    third-party error into a ``PicError`` without its multi-line details."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def unknown_policy_hint(spec: str, known: Iterable[str] = ()) -> str:
    """What to add to ``unknown policy 'spec'``: when the spec is ``pic eval``'s syntax (``naive@context``,
    ``auto:0.05@context/relevance``: a policy, then how its chunks were compiled and ordered) rather than a policy,
    the Python calls that do the same; else the nearest of the ``known`` names, if one is near; else ``""``."""
    policy, at, how = spec.partition("@")
    policy, slash, order = policy.partition("/")
    if not (at or slash):
        near = difflib.get_close_matches(spec.partition(":")[0].strip().lower(), list(known), n=1)
        return f" (did you mean {near[0]!r}?)" if near else ""
    context, _, order = how.partition("/") if at else ("", "", order)
    steps = []
    if context.strip() == "context":
        steps.append("compile the chunks in context (pic.compile(docs, context=engine.chat_context(messages)), or "
                     "engine.link_chat(ids, messages, documents=docs), which does it)")  # fmt: skip
    steps.append(f"link with policy={policy.strip()!r}" + (f", order={order.strip()!r}" if order.strip() else ""))
    return f" ('@context' and '/order' are `pic eval`'s syntax, not a policy's: in Python {', then '.join(steps)})"


SHOWN_ID_CHARS = 32
"""The most characters of an id an error or a log line shows: a cache id's whole length."""


def shown_id(cache_id: object) -> str:
    """An id as errors and log lines show it: ``repr`` of it when it is at most ``SHOWN_ID_CHARS`` characters,
    else of its first 32 and its length (``'abcd…' (7340032 characters)``). A client sends ids (a path, a body's
    ``cache_ids``), so an unknown one of 7 MB would otherwise be echoed whole in its 404 and logged whole for every
    request that sends it."""
    if isinstance(cache_id, str):
        if len(cache_id) <= SHOWN_ID_CHARS:
            return repr(cache_id)
        return f"{cache_id[:SHOWN_ID_CHARS] + '…'!r} ({len(cache_id)} characters)"
    text = repr(cache_id)
    return text if len(text) <= SHOWN_ID_CHARS else f"{text[:SHOWN_ID_CHARS]}… ({len(text)} characters)"


def cache_id_hint(cache_id: object) -> str:
    """`` (8 characters: a cache id is 32 hex digits, ...)`` for hex digits that cannot be a whole cache id (a prefix
    of one, as pages print them cut short); ``""`` for anything else. Of a longer one, ``shown_id`` gives the length
    already."""
    if not isinstance(cache_id, str) or not re.fullmatch(r"[0-9a-f]+", cache_id) or len(cache_id) == 32:
        return ""
    count = f"{len(cache_id)} characters: " if len(cache_id) < SHOWN_ID_CHARS else ""
    return f" ({count}a cache id is 32 hex digits, the whole id compile returned)"


def linked_too_long(num_tokens: int, context: int, model: str, segments) -> ContextLengthError:
    """The error for a linked prompt longer than the model's context, naming the fix: fewer or shorter chunks,
    starting with the largest, named by their whole ids (``segments``: the layout's, each with ``num_tokens`` and, for
    a chunk, its ``cache_id``), or a shorter query and prefix."""
    chunks = sorted(((s.num_tokens, s.cache_id) for s in segments if getattr(s, "cache_id", None)), reverse=True)
    rest = num_tokens - sum(n for n, _ in chunks)
    head = f"linked prompt has {num_tokens} tokens, more than the {context}-token context of {model} "
    if rest >= context:
        return ContextLengthError(f"{head}({num_tokens - context} over): the query and prefix alone have {rest} "
                                  "tokens; shorten them")  # fmt: skip
    sizes = {cache_id: n for n, cache_id in chunks}  # a chunk linked twice is named once, with its count
    times = {cache_id: sum(c == cache_id for _, c in chunks) for cache_id in sizes}
    largest = ", ".join(
        f"{cache_id} {sizes[cache_id]} tokens" + (f" (linked {times[cache_id]} times)" * (times[cache_id] > 1))
        for cache_id in sorted(sizes, key=lambda cache_id: -sizes[cache_id])[:3]
    )
    return ContextLengthError(
        f"{head}({num_tokens - context} over): link fewer or shorter chunks ({len(chunks)} chunk"
        f"{'s' * (len(chunks) != 1)}, {num_tokens - rest} tokens; the largest: {largest}) or a shorter query and "
        f"prefix ({rest} tokens)"
    )
