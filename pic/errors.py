"""Errors raised by pic.

Every public failure is a :class:`PicError` whose message names the offending value. A failed call
leaves every cached chunk intact: inputs are validated before any state changes.
"""

from __future__ import annotations


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


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none), for wrapping a
    third-party error into a ``PicError`` without its multi-line details."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
