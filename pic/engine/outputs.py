"""A sequence's outputs: the pieces of a step, and the ``Generation`` it ends with."""

from __future__ import annotations

import time

import torch

from pic.engine.generation import FinishReason, Generation, GenerationStats
from pic.engine.request import LinkOutput, RequestOutput
from pic.engine.sequence import Sequence, Status


def token_output(seq: Sequence, text: str, token: int) -> RequestOutput:
    """A step's output for a sequence that goes on."""
    return RequestOutput(request_id=seq.request_id, text=text, token_ids=(token,), finished=False)


def link_output(seq: Sequence, hidden: torch.Tensor) -> LinkOutput:
    """Park a sequence whose recompute pass ran (``PIC.link``), with its query's final hidden states
    ``hidden`` ``[num_query_tokens, hidden_size]``."""
    seq.query_hidden, seq.status = hidden, Status.PARKED
    result = seq.first_pass
    return LinkOutput(
        request_id=seq.request_id,
        layout=seq.layout,
        recomputed=result.recomputed,
        recomputed_by_layer=result.recomputed_by_layer,
        num_shared_blocks=seq.num_shared_blocks,
        num_private_blocks=seq.num_private_blocks,
        block_ids=tuple(seq.kv.blocks),
        query_hidden=hidden,
        probe=result.probe,
    )


def finish_output(
    seq: Sequence, why: FinishReason | Exception, *, text: str = "", token: int | None = None
) -> RequestOutput:
    """Mark the sequence finished (its blocks already freed) and build its last output."""
    tokens = () if token is None else (token,)
    if isinstance(why, Exception):
        seq.error = why
        out = RequestOutput(request_id=seq.request_id, text="", token_ids=tokens, finished=True, error=why)
    else:
        if seq.detokenizer is not None:
            text += seq.detokenizer.flush()
        seq.finish_reason = why
        seq.generation = _generation(seq, why)
        out = RequestOutput(
            request_id=seq.request_id, text=text, token_ids=tokens, finished=True, generation=seq.generation
        )
    seq.status = Status.FINISHED
    return out


def _generation(seq: Sequence, why: FinishReason) -> Generation:
    end = time.perf_counter()
    first = seq.first_token_s or end
    scheduled = seq.scheduled_s or end
    if seq.link_s is not None:  # Linked.generate: the link call, then the first token's step
        link_s = seq.link_s
        ttft_s = link_s + (first - (seq.resumed_s or first))
    else:
        link_s = (seq.linked_s or scheduled) - scheduled
        ttft_s = first - seq.arrival_s
    num_prompt = seq.num_prompt_tokens if seq.chunks is not None else 0
    num_recomputed = int(seq.first_pass.recomputed.sum()) if seq.first_pass else 0
    stats = GenerationStats(
        num_prompt_tokens=num_prompt,
        num_recomputed_tokens=num_recomputed,
        num_reused_tokens=num_prompt - num_recomputed,
        num_generated_tokens=len(seq.output_ids),
        link_s=link_s,
        ttft_s=ttft_s,
        decode_s=end - first,
        finish_reason=why,
        queue_s=scheduled - seq.arrival_s,
        num_preemptions=seq.num_preemptions,
    )
    text = seq.detokenizer.text if seq.detokenizer is not None else ""
    return Generation(text=text, token_ids=list(seq.output_ids), ttft_s=ttft_s, stats=stats)
