"""Incremental detokenization with stop strings, for streaming a batched engine's generations.

Re-decoding a whole generation after every token costs O(n) per token, O(n^2) per generation, and a batched engine
pays that once per sequence per step. Decoding one token at a time is not right either: sentencepiece drops the
leading space of the first token of a decode, and byte-fallback or byte-level tokenizers split one character over
several tokens. So, as vLLM does, each step decodes a short window twice, ``tokens[prefix:read]`` and
``tokens[prefix:]``, and emits the difference: both decodes see the same first token, so its leading-space handling
cancels out, and the offsets only advance once the window's text no longer ends in an incomplete character
("\ufffd").

Known differences from ``tokenizer.decode(all_tokens, skip_special_tokens=True)``, all in text the full decode
renders as U+FFFD anyway (invalid UTF-8 produced by the model):

- Hugging Face's ``ByteFallback`` decoder replaces *every* byte of a run of byte tokens with U+FFFD once the run is
  invalid, even the bytes of characters that were complete earlier in the run. Those characters were already
  emitted here, and pieces are final, so they stay.
- A window still ending in U+FFFD after ``_MAX_PENDING`` tokens is emitted as it is, which bounds the work per
  token; if invalid bytes end in a character that the next tokens complete, the U+FFFD already emitted for its
  first bytes stays.
- A tokenizer with ``clean_up_tokenization_spaces=True`` may remove a space that was already emitted.
"""

from __future__ import annotations

from typing import Any

# A window still ending in U+FFFD after this many tokens holds invalid UTF-8, not a character in progress (one takes
# at most 4 bytes; 6 leaves room for skipped special tokens): emit it rather than let the window, and the work, grow.
_MAX_PENDING = 6


class Detokenizer:
    """Turns one generation's tokens into final text pieces, one token at a time: every piece :meth:`add` and
    :meth:`flush` return is final, so a caller can stream them. Text is held back while it ends in an incomplete
    character or while its tail could still grow into a stop string. The generation stops once its text holds a stop
    string, and the text is cut right before the earliest occurrence (see :meth:`_find_stop`)."""

    def __init__(self, tokenizer: Any, *, stop: tuple[str, ...] = (), skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(s for s in stop if s)  # "" would match before any text
        self._hold = max((len(s) for s in self._stop), default=1) - 1  # chars a stop string could still need
        self._tokens: list[int] = []
        self._prefix = 0  # start of the decode window: context for the first token's spacing
        self._read = 0  # tokens before this are decoded into text already
        self._held = ""  # decoded text not yet returned: the tail a stop string could start in
        self._pieces: list[str] = []
        self._stopped = False
        self._flushed = False

    @property
    def stopped(self) -> bool:
        """True once the text reached a stop string; the text is cut before it."""
        return self._stopped

    @property
    def text(self) -> str:
        """The final text so far: every piece :meth:`add` and :meth:`flush` returned, in order."""
        return "".join(self._pieces)

    def add(self, token_id: int) -> str:
        """Feeds one generated token (not EOS) and returns the text it made final, often ""."""
        if self._stopped or self._flushed:
            raise RuntimeError("Detokenizer.add() after the generation stopped or was flushed")
        self._tokens.append(token_id)
        return self._push(self._decode_new(final=False))

    def flush(self) -> str:
        """Ends the generation: returns the text still held back, incomplete characters included."""
        if self._flushed:
            return ""
        self._flushed = True
        if self._stopped:
            return ""
        piece = self._push(self._decode_new(final=True))
        return piece if self._stopped else piece + self._emit(len(self._held))

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_new(self, *, final: bool) -> str:
        """The text the tokens after ``_read`` add, or "" while it may still end mid-character."""
        before = self._decode(self._tokens[self._prefix : self._read])
        after = self._decode(self._tokens[self._prefix :])
        incomplete = after.endswith("\ufffd") and len(self._tokens) - self._read < _MAX_PENDING
        if len(after) <= len(before) or (incomplete and not final):
            return ""  # nothing new yet (e.g. a skipped special token), or a character in progress
        self._prefix, self._read = self._read, len(self._tokens)
        return after[len(before) :]

    def _push(self, new: str) -> str:
        """Appends decoded text, cuts it at a stop string, and returns what can no longer change."""
        start = max(0, len(self._held) - self._hold)  # a new match must end in ``new``
        self._held += new
        cut = self._find_stop(start)
        if cut is not None:
            self._held, self._stopped = self._held[:cut], True
            return self._emit(cut)
        return self._emit(len(self._held) - self._hold)

    def _find_stop(self, start: int) -> int | None:
        """Where to cut: the earliest start among the stop strings complete when the first one completes. Generation
        stops as soon as the text holds a stop string, so one that starts earlier but would end later does not
        count: that keeps the cut independent of how the text splits into tokens."""
        found = [(i, i + len(s)) for s in self._stop if (i := self._held.find(s, start)) >= 0]
        first_end = min((end for _, end in found), default=None)
        return None if first_end is None else min(i for i, end in found if end <= first_end)

    def _emit(self, count: int) -> str:
        """Returns the first ``count`` held chars as a final piece."""
        if count <= 0:
            return ""
        piece, self._held = self._held[:count], self._held[count:]
        self._pieces.append(piece)
        return piece
