"""Turning user input (text or token ids) into validated token-id lists."""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable, Mapping, Sequence

import torch

from pic.errors import ContextLengthError, InvalidInputError
from pic.text import check_encodable

TextOrTokens = str | Sequence[int] | torch.Tensor


def encode(tokenizer, value: TextOrTokens, *, what: str, vocab_size: int, max_chars: int | None = None) -> list[int]:
    """Token ids of ``value``: text is tokenized without special tokens, ids are checked.

    Args:
        what: how to name the value in errors (``"document 3"``, ``"query"``).

    Raises:
        InvalidInputError: a value that is neither text nor a list of ints (bytes included: pic does
            not guess their encoding), or an id outside the vocab.
    """
    if isinstance(value, (bytes, bytearray, memoryview)):
        raise InvalidInputError(
            f"{what} is {type(value).__name__} ({_short(bytes(value))}); pass text (decode it first, "
            f"e.g. value.decode('utf-8')) or a list of token ids"
        )
    if isinstance(value, str):
        if max_chars is not None and len(value) > max_chars:
            raise ContextLengthError(
                f"{what} has {len(value)} characters, more than the {max_chars} that any prompt fitting the "
                f"model's context can hold (refused without tokenizing it); split or shorten it"
            )
        check_encodable(value, what)
        return list(tokenizer(value, add_special_tokens=False, verbose=False)["input_ids"])  # pic says it, if too long
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.dtype.is_floating_point:
            raise InvalidInputError(
                f"{what} is a tensor of shape {tuple(value.shape)} and dtype {value.dtype}; expected 1-D token ids"
            )
        value = value.tolist()
    if not isinstance(value, Sequence) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise InvalidInputError(f"{what} is {_short(value)}; expected a string or a list of token ids")
    bad = [t for t in value if not 0 <= t < vocab_size]
    if bad:
        raise InvalidInputError(f"{what} has token id {bad[0]}, outside the vocabulary [0, {vocab_size})")
    return list(value)


def tokenizer_adds_bos(tokenizer: object) -> bool:
    """Whether ``tokenizer`` starts its own encodings with its BOS token (``add_special_tokens=True``),
    i.e. whether the model's prompts begin with one: Llama's and Mistral's tokenizers do; ChatML models'
    (SmolLM2, Qwen), whose template opens every message with ``<|im_start|>``, do not, even when that
    token is their ``bos_token``."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    ids = tokenizer("a")["input_ids"]
    return bool(ids) and ids[0] == bos


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def encode_documents(tokenizer, docs: object, *, vocab_size: int, max_chars: int | None = None) -> list[list[int]]:
    """Token ids of every document of ``docs``: one text, one tensor of ids, or an iterable of texts
    or token-id lists (not one flat list of ints: that would be ambiguous).

    Raises:
        InvalidInputError: no documents, an empty or malformed document (named by index).
    """
    if isinstance(docs, (str, torch.Tensor, bytes, bytearray, memoryview)):
        docs = [docs]
    if isinstance(docs, Iterable) and not isinstance(docs, Mapping):
        docs = list(docs)
    if not isinstance(docs, list) or not docs:
        raise InvalidInputError(f"docs is {_short(docs)}; expected a non-empty list of documents")
    lists = []
    for i, doc in enumerate(docs):
        tokens = encode(tokenizer, doc, what=f"document {i}", vocab_size=vocab_size, max_chars=max_chars)
        if not tokens:
            raise InvalidInputError(f"document {i} ({_short(doc)}) has no tokens")
        lists.append(tokens)
    return lists


def max_token_chars(tokenizer: object) -> int:
    """The most characters one token of ``tokenizer`` stands for (its longest vocabulary entry; byte-level
    and sentencepiece vocabularies spell a token with at least as many characters as it decodes to).
    ``max_context * max_token_chars`` characters therefore hold more tokens than the context: text longer
    than that is refused before the (slow, memory-hungry) tokenizer sees it."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return max((len(token) for token in vocab), default=64)


class SharedTokenizer:
    """A tokenizer any number of threads may use at once: each call runs under one lock.

    The engine tokenizes in its callers' threads and detokenizes in its own; a Hugging Face fast tokenizer
    is one Rust object that refuses concurrent use (``RuntimeError: Already borrowed``) or, worse, may
    interleave state such as truncation settings. Calls are short, so one lock costs nothing measurable.
    Everything else (attributes, ``chat_template``) reads and writes through to ``wrapped``.
    """

    def __init__(self, tokenizer: object) -> None:
        object.__setattr__(self, "wrapped", tokenizer)
        object.__setattr__(self, "_lock", threading.RLock())

    def __getattr__(self, name: str) -> object:
        attr = getattr(self.wrapped, name)
        if not callable(attr) or isinstance(attr, type):
            return attr

        @functools.wraps(attr)
        def locked(*args: object, **kwargs: object) -> object:
            with self._lock:
                return attr(*args, **kwargs)

        return locked

    def __setattr__(self, name: str, value: object) -> None:
        setattr(self.wrapped, name, value)

    def __call__(self, *args: object, **kwargs: object) -> object:
        with self._lock:
            return self.wrapped(*args, **kwargs)

    def __len__(self) -> int:
        return len(self.wrapped)

    def __repr__(self) -> str:
        return f"SharedTokenizer({self.wrapped!r})"
