"""Which tokens of a prompt are separators: the punctuation and line breaks that end a sentence or a clause.

SepLLM (Chen et al., ICML 2025, arXiv 2412.12094) found that attention concentrates on separator tokens, which
summarize the segment they end. A probe over linked chunks says the same on both real models measured here
(docs/policies.md): of the chunk tokens a query attends to most, 44% on Qwen2.5-Coder-0.5B and 35% on SmolLM2
are sentence ends, and each chunk's first token is nearly always among them. So a policy can find the tokens a
probe would, without running one (``pic.link.policies.anchors``).

A token is a separator when its text, as the tokenizer decodes it alone, ends (trailing spaces aside) with one of
``STRONG`` (sentence ends, line breaks) or ``WEAK`` (clause ends). Token ids are classified as they are first
met and remembered, so a tokenizer of 150K tokens costs nothing at start-up.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Sequence

import torch

STRONG = ".!?\n"
WEAK = ",;:"


class Kind(enum.IntEnum):
    """A token's separator kind (higher: a stronger end)."""

    NONE = 0
    WEAK = 1
    STRONG = 2


class Separators:
    """The separator kind of token ids under ``tokenizer`` (anything with ``decode(list[int]) -> str``), memoized.

    Thread-safe: the engine's thread and a caller's may ask at once."""

    def __init__(self, tokenizer: object) -> None:
        self._decode = tokenizer.decode
        self._kinds: dict[int, Kind] = {}
        self._lock = threading.Lock()

    def kinds(self, token_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """``[T]`` int8, the ``Kind`` of each token id of ``token_ids`` (``[T]`` int64)."""
        ids = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
        with self._lock:
            for token in set(ids) - self._kinds.keys():
                self._kinds[token] = kind_of(self._decode([token]))
            return torch.tensor([self._kinds[t] for t in ids], dtype=torch.int8)


def kind_of(text: str) -> Kind:
    """The separator kind of a token's text."""
    end = text.rstrip(" ")[-1:]
    if not end:
        return Kind.NONE
    return Kind.STRONG if end in STRONG else Kind.WEAK if end in WEAK else Kind.NONE
