"""A sequence's outputs: the pieces of a step, and the ``Generation`` it ends with. Pure functions of the
sequence's state (they change nothing)."""

from __future__ import annotations

import time

from pic.engine.core.sequence import Sequence, Status
from pic.engine.generation import FinishReason, Generation, GenerationStats
from pic.engine.request import LinkOutput, RequestOutput


def token_output(seq: Sequence, text: str, token: int) -> RequestOutput:
    """A step's output for a sequence that goes on."""
    return RequestOutput(request_id=seq.request_id, text=text, token_ids=(token,), finished=False)


def link_output(seq: Sequence) -> LinkOutput:
    """What ``PIC.link`` gets for a parked sequence: its layout, what its pass recomputed, its query's
    final hidden states."""
    result = seq.link.first_pass
    return LinkOutput(
        request_id=seq.request_id,
        layout=seq.link.layout,
        recomputed=result.recomputed,
        recomputed_by_layer=result.recomputed_by_layer,
        num_shared_blocks=seq.blocks.num_shared,
        num_private_blocks=seq.blocks.num_private,
        block_ids=tuple(seq.blocks.kv.blocks),
        query_hidden=seq.query_hidden,
        probe=result.probe,
        policy=seq.policy,
        order=seq.link.chunk_order,
    )


def finish_output(seq: Sequence, *, text: str = "", token: int | None = None) -> RequestOutput:
    """The last output of a finished sequence: its ``text`` and ``token`` of this step, and the generation
    (or the error it failed with)."""
    assert seq.status is Status.FINISHED, seq
    tokens = () if token is None else (token,)
    if seq.error is not None:
        return RequestOutput(request_id=seq.request_id, text="", token_ids=tokens, finished=True, error=seq.error)
    generation = _generation(seq, seq.finish_reason)
    return RequestOutput(request_id=seq.request_id, text=text, token_ids=tokens, finished=True, generation=generation)


def _generation(seq: Sequence, why: FinishReason) -> Generation:
    end, times = time.perf_counter(), seq.times
    first = times.first_token_s or end
    scheduled = times.scheduled_s or end
    if times.link_s is not None:  # Linked.generate: the link call, then the first token's step
        link_s = times.link_s
        ttft_s = link_s + (first - (times.resumed_s or first))
    else:
        link_s = (times.linked_s or scheduled) - scheduled
        ttft_s = first - times.arrival_s
    num_prompt = seq.num_prompt_tokens if seq.chunks is not None else 0
    first_pass = seq.link.first_pass
    num_recomputed = int(first_pass.recomputed.sum()) if first_pass else 0
    stats = GenerationStats(
        num_prompt_tokens=num_prompt,
        num_recomputed_tokens=num_recomputed,
        num_reused_tokens=num_prompt - num_recomputed,
        num_generated_tokens=len(seq.output_ids),
        link_s=link_s,
        ttft_s=ttft_s,
        decode_s=end - first,
        finish_reason=why,
        queue_s=scheduled - times.arrival_s,
        num_preemptions=seq.num_preemptions,
        chunk_order=seq.link.chunk_order,
    )
    text = seq.decoding.detokenizer.text if seq.decoding is not None else ""
    return Generation(text=text, token_ids=list(seq.output_ids), ttft_s=ttft_s, stats=stats)
