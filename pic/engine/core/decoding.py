"""``Decoder``: a generating sequence's token (sampled by the executor) appended, detokenized, checked against the
ways a generation ends (``Sampled``: the scheduler acts on it); and what a sequence puts out, made from its state: a
link's result (``link_output``), its last output with the ``Generation`` it ends with (``finish_output``, called
once, as it flushes the detokenizer's held-back text). No tensor is read here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from pic.engine.core.detokenizer import Detokenizer
from pic.engine.core.sequence import Decoding, Sequence, Status
from pic.engine.generation import FinishReason, Generation, GenerationStats
from pic.engine.request import LinkOutput, RequestOutput
from pic.sampling import SamplingParams


@dataclass(frozen=True)
class Sampled:
    """One sequence's token of a step (``None``: none was, ``max_new_tokens=0``), the text it adds (a stop
    string's text excluded), and why the generation ends with it (``None``: it goes on)."""

    seq: Sequence
    token: int | None
    text: str
    finish: FinishReason | None


class Decoder:
    """``generator``: a seeded generation's own generator (``Executor.generator``); ``max_context``: the model's."""

    def __init__(
        self,
        tokenizer: object,
        *,
        eos_token_ids: frozenset[int],
        max_context: int,
        generator: Callable[[int | None], object],
    ) -> None:
        self.tokenizer, self.eos_token_ids, self.max_context = tokenizer, eos_token_ids, max_context
        self._generator = generator

    def start(self, params: SamplingParams) -> Decoding:
        """A generation's state: its detokenizer, and its own generator when seeded."""
        return Decoding(Detokenizer(self.tokenizer, stop=params.stop), self._generator(params.seed))

    def append(self, seq: Sequence, token: int | None) -> Sampled:
        """``seq``'s token of this step (``None``: none was sampled, a generation of ``max_new_tokens=0``) appended,
        and whether the generation ends with it."""
        if token is None:
            assert seq.sampling.max_new_tokens == 0, f"no token sampled for request {seq.request_id}"
            return Sampled(seq, None, "", FinishReason.LENGTH)
        seq.append(token)
        if token in self.eos_token_ids:
            return Sampled(seq, token, "", FinishReason.EOS)
        text = seq.decoding.detokenizer.add(token)
        if seq.decoding.detokenizer.stopped:
            reason = FinishReason.STOP
        elif len(seq.output_ids) >= seq.sampling.max_new_tokens:
            reason = FinishReason.LENGTH
        elif seq.num_prompt_tokens + len(seq.output_ids) >= self.max_context:
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
        num_private_blocks=blocks.num_private, block_ids=tuple(blocks.kv.blocks.tolist()),
        query_hidden=seq.query_hidden, probe=result.probe, policy=link.policy, order=link.chunk_order,
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


def _recomputed_whole(layout, order, first_pass) -> tuple[int, ...]:
    """The caller's indices of the chunks a link's first pass recomputed whole (none before it ran)."""
    if layout is None or order is None or first_pass is None:
        return ()
    return layout.recomputed_whole(first_pass.recomputed, order.indices)


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
        policy=seq.link.policy.spec if seq.link.layout is not None else None,
        recomputed_whole=_recomputed_whole(seq.link.layout, seq.link.chunk_order, first_pass),
    )  # fmt: skip
    text = seq.decoding.detokenizer.text if seq.decoding is not None else ""
    return Generation(text=text, token_ids=list(seq.output_ids), ttft_s=ttft_s, stats=stats)
