"""``Decoder``: what happens to a step's hidden states: the second passes of query-aware policies, then one
sampled token per generating sequence, detokenized, checked against the ways a generation ends."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from pic.engine.detokenizer import Detokenizer
from pic.engine.generation import FinishReason
from pic.engine.kv_manager import KVManager
from pic.engine.outputs import token_output
from pic.engine.request import RequestOutput
from pic.engine.sampling import SamplingParams, sample_rows, seeded_generator
from pic.engine.sequence import Sequence
from pic.errors import PicError
from pic.model import ModelRunner

log = logging.getLogger("pic")

Finish = Callable[..., RequestOutput]  # (seq, why, *, text=, token=) -> its last output


class Decoder:
    """Args:
    runner: the model (its LM head, and the second passes' forward).
    tokenizer: for incremental detokenization.
    eos_token_ids: tokens that end a generation.
    finish: ends a sequence (frees its blocks) and returns its last output (``EngineCore._finish``).
    """

    def __init__(
        self, runner: ModelRunner, tokenizer: object, *, eos_token_ids: frozenset[int], finish: Finish
    ) -> None:
        self.runner, self.tokenizer, self.eos_token_ids, self._finish = runner, tokenizer, eos_token_ids, finish

    def start(self, seq: Sequence, params: SamplingParams) -> None:
        """Set up a sequence's generation: its detokenizer, and its own generator when seeded."""
        seq.detokenizer = Detokenizer(self.tokenizer, stop=params.stop)
        if params.seed is not None:
            seq.generator = seeded_generator(params.seed, self.runner.spec.device)

    def second_passes(
        self, kv: KVManager, prefills: list[Sequence], hidden: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[tuple[Sequence, Exception]]]:
        """After a forward that ran probes (query-aware policies): each policy chooses from its probe, and one
        more forward runs the second passes together; their hidden states replace the probes'. Returns the
        hidden states and the sequences whose policy failed on its probe (a malformed choice, an exception of
        its own), with why."""
        probed, failed = [], []
        for i, seq in enumerate(prefills):
            if seq.pass_.is_probe:
                try:
                    kv.after_probe(seq)
                    probed.append(i)
                except Exception as exc:  # a policy's own bug fails its request, not the batch
                    if not isinstance(exc, PicError):
                        log.exception("pic: policy %r failed on its probe", seq.policy.spec)
                    failed.append((seq, exc))
        if not probed:
            return hidden, failed
        second = self.runner.forward([prefills[i].pass_.seq_input() for i in probed])
        hidden = list(hidden)
        for i, h in zip(probed, second, strict=True):
            hidden[i] = h
        return hidden, failed

    def sample_and_append(self, rows: Seq[tuple[Sequence, torch.Tensor]]) -> list[RequestOutput]:
        """One token for each ``(sequence, final hidden state [hidden_size])``; the step's outputs."""
        outputs = [self._finish(seq, FinishReason.LENGTH) for seq, _ in rows if seq.sampling.max_new_tokens == 0]
        rows = [(seq, h) for seq, h in rows if not seq.is_finished]
        if not rows:
            return outputs
        decode = all(seq.output_ids for seq, _ in rows)  # every row follows a decode step
        logits = self.runner.logits(torch.stack([h for _, h in rows]), decode=decode)  # [B, vocab_size] float32
        tokens = sample_rows(logits, [seq.sampling for seq, _ in rows], [seq.generator for seq, _ in rows])
        return outputs + [self._append(seq, token) for (seq, _), token in zip(rows, tokens, strict=True)]

    def _append(self, seq: Sequence, token: int) -> RequestOutput:
        """Record a sampled token; finish the sequence when it ends the generation."""
        seq.first_token_s = seq.first_token_s or time.perf_counter()
        seq.output_ids.append(token)
        if token in self.eos_token_ids:
            return self._finish(seq, FinishReason.EOS, token=token)
        text = seq.detokenizer.add(token)
        if seq.detokenizer.stopped:
            reason = FinishReason.STOP
        elif len(seq.output_ids) >= seq.sampling.max_new_tokens:
            reason = FinishReason.LENGTH
        elif seq.num_prompt_tokens + len(seq.output_ids) >= self.runner.spec.max_context:
            reason = FinishReason.CONTEXT
        else:
            out = token_output(seq, text, token)
            seq.sink.put(out)
            return out
        return self._finish(seq, reason, text=text, token=token)
