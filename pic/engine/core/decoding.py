"""``Decoder``: one sampled token per generating sequence from its final hidden state, detokenized, checked
against the ways a generation ends. It says how each sequence goes on (``Sampled``); the engine core acts on it.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from pic.engine.core.detokenizer import Detokenizer
from pic.engine.core.sequence import Decoding, Sequence
from pic.engine.generation import FinishReason
from pic.engine.sampling import SamplingParams, sample_rows, seeded_generator
from pic.model import ModelRunner


@dataclass(frozen=True)
class Sampled:
    """One sequence's token of a step.

    Attributes:
        seq: the sequence (its ``output_ids`` end with ``token``, unless ``token`` is ``None``).
        token: the token sampled; ``None`` when none was (``max_new_tokens=0``).
        text: the text it adds (a stop string's text excluded).
        finish: why the generation ends with it, or ``None``: it goes on.
    """

    seq: Sequence
    token: int | None
    text: str
    finish: FinishReason | None


class Decoder:
    """Args:
    runner: the model (its LM head).
    tokenizer: for incremental detokenization.
    eos_token_ids: tokens that end a generation.
    """

    def __init__(self, runner: ModelRunner, tokenizer: object, *, eos_token_ids: frozenset[int]) -> None:
        self.runner, self.tokenizer, self.eos_token_ids = runner, tokenizer, eos_token_ids

    def start(self, params: SamplingParams) -> Decoding:
        """A generation's state: its detokenizer, and its own generator when seeded."""
        generator = None if params.seed is None else seeded_generator(params.seed, self.runner.spec.device)
        return Decoding(Detokenizer(self.tokenizer, stop=params.stop), generator)

    def sample(self, rows: Seq[tuple[Sequence, torch.Tensor]]) -> list[Sampled]:
        """One token for each ``(sequence, final hidden state [hidden_size])``, appended to the sequence."""
        done = [Sampled(seq, None, "", FinishReason.LENGTH) for seq, _ in rows if seq.sampling.max_new_tokens == 0]
        rows = [(seq, h) for seq, h in rows if seq.sampling.max_new_tokens > 0]
        if not rows:
            return done
        decode = all(seq.output_ids for seq, _ in rows)  # every row follows a decode step
        logits = self.runner.logits(torch.stack([h for _, h in rows]), decode=decode)  # [B, vocab_size] float32
        generators = [seq.decoding.generator for seq, _ in rows]
        tokens = sample_rows(logits, [seq.sampling for seq, _ in rows], generators)
        return done + [self._append(seq, token) for (seq, _), token in zip(rows, tokens, strict=True)]

    def _append(self, seq: Sequence, token: int) -> Sampled:
        """Record a sampled token; say whether it ends the generation."""
        seq.append(token)
        if token in self.eos_token_ids:
            return Sampled(seq, token, "", FinishReason.EOS)
        text = seq.decoding.detokenizer.add(token)
        if seq.decoding.detokenizer.stopped:
            reason = FinishReason.STOP
        elif len(seq.output_ids) >= seq.sampling.max_new_tokens:
            reason = FinishReason.LENGTH
        elif seq.num_prompt_tokens + len(seq.output_ids) >= self.runner.spec.max_context:
            reason = FinishReason.CONTEXT
        else:
            reason = None
        return Sampled(seq, token, text, reason)

    @staticmethod
    def flush(seq: Sequence) -> str:
        """The text a finished generation's detokenizer still holds."""
        return seq.decoding.detokenizer.flush() if seq.decoding is not None else ""
