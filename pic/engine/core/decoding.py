"""``Decoder``: one sampled token per generating sequence from its final hidden state, detokenized, checked against
the ways a generation ends (``Sampled``: the scheduler acts on it); and what a sequence puts out, made from its
state: a link's result (``link_output``), its last output with the ``Generation`` it ends with (``finish_output``,
called once, as it flushes the detokenizer's held-back text).
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from pic.engine.core.detokenizer import Detokenizer
from pic.engine.core.sequence import Decoding, Sequence, Status
from pic.engine.generation import FinishReason, Generation, GenerationStats
from pic.engine.request import LinkOutput, RequestOutput
from pic.engine.sampling import SamplingParams, sample_rows, seeded_generator
from pic.model import ModelRunner


@dataclass(frozen=True)
class Sampled:
    """One sequence's token of a step (``None``: none was, ``max_new_tokens=0``), the text it adds (a stop
    string's text excluded), and why the generation ends with it (``None``: it goes on)."""

    seq: Sequence
    token: int | None
    text: str
    finish: FinishReason | None


class Decoder:
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


def link_output(seq: Sequence) -> LinkOutput:
    """What ``PIC.link`` gets for a parked sequence."""
    result, link, blocks = seq.link.first_pass, seq.link, seq.blocks
    return LinkOutput(
        request_id=seq.request_id, layout=link.layout, recomputed=result.recomputed,
        recomputed_by_layer=result.recomputed_by_layer, num_shared_blocks=blocks.num_shared,
        num_private_blocks=blocks.num_private, block_ids=tuple(blocks.kv.blocks), query_hidden=seq.query_hidden,
        probe=result.probe, policy=link.policy, order=link.chunk_order,
    )  # fmt: skip


def finish_output(seq: Sequence, *, text: str = "", token: int | None = None) -> RequestOutput:
    """The last output of a finished sequence: its ``text`` and ``token`` of this step, and the generation (or the
    error it failed with); a generation's detokenizer is flushed."""
    assert seq.status is Status.FINISHED, seq
    tokens = () if token is None else (token,)
    if seq.error is not None:
        return RequestOutput(request_id=seq.request_id, text="", token_ids=tokens, finished=True, error=seq.error)
    text += seq.decoding.detokenizer.flush() if seq.decoding is not None else ""
    generation = _generation(seq)
    return RequestOutput(request_id=seq.request_id, text=text, token_ids=tokens, finished=True, generation=generation)


def _generation(seq: Sequence) -> Generation:
    end, times = time.perf_counter(), seq.times
    first = times.first_token_s or end
    scheduled = times.scheduled_s or end
    if times.link_s is not None:  # Linked.generate: the link call, then the first token's step
        link_s = times.link_s
        ttft_s = link_s + (first - (times.resumed_s or first))
    else:
        link_s = (times.linked_s or scheduled) - scheduled
        ttft_s = first - times.arrival_s
    num_prompt = seq.num_prompt_tokens if seq.fetch.chunks is not None else 0
    first_pass = seq.link.first_pass
    num_recomputed = int(first_pass.recomputed.sum()) if first_pass else 0
    stats = GenerationStats(
        num_prompt_tokens=num_prompt, num_recomputed_tokens=num_recomputed,
        num_reused_tokens=num_prompt - num_recomputed, num_generated_tokens=len(seq.output_ids), link_s=link_s,
        ttft_s=ttft_s, decode_s=end - first, finish_reason=seq.finish_reason, queue_s=scheduled - times.arrival_s,
        num_preemptions=seq.num_preemptions, chunk_order=seq.link.chunk_order,
    )  # fmt: skip
    text = seq.decoding.detokenizer.text if seq.decoding is not None else ""
    return Generation(text=text, token_ids=list(seq.output_ids), ttft_s=ttft_s, stats=stats)
