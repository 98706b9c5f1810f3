"""Full Recompute must reproduce transformers exactly: logits and greedy generations.

Acceptance (issue 2): every supported family and the real stories260K, chunks linked in any order,
with and without a prefix, at block sizes 4, 16 and 64 (padding is invisible); one chunk under
Naive equals Full Recompute.

The models run on ``PIC_TEST_DEVICE`` in ``PIC_TEST_DTYPE`` (tests/device.py, where the tolerances are).
On the CPU in float32 "exactly" means logits within ``TOL`` and the same greedy tokens as ``generate``. On
CUDA, and in bfloat16, greedy near-ties within the rounding error may flip: see ``assert_near_hf``.
"""

from __future__ import annotations

import pytest
import torch

import pic
from tests.conftest import make_target_engine
from tests.device import target, tolerances
from tests.models import DOCS, PREFIX, QUERY, target_model

NUM_NEW = 32
TOLERANCES = tolerances()
TOL = TOLERANCES.logits


def hf_reference(
    family: str, input_ids: torch.Tensor, num_query: int, *, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """transformers' own logits at the query positions, its greedy continuation and, per generated token,
    the top-2 margin of the logits it was chosen from (on the test device, in the test dtype or ``dtype``)."""
    hf = target_model(family, dtype=dtype)
    ids = input_ids.to(target().device)[None]
    with torch.no_grad():
        logits = hf(ids).logits[0, -num_query:]
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NUM_NEW,
            do_sample=False,
            pad_token_id=2,
            output_logits=True,
            return_dict_in_generate=True,
        )
    top2 = torch.stack(out.logits)[:, 0].float().topk(2, dim=-1).values
    return logits.float(), out.sequences[0, ids.shape[1] :].tolist(), top2[:, 0] - top2[:, 1]


def assert_matches_hf(family: str, linked) -> None:
    if not TOLERANCES.exact_greedy:
        return assert_near_hf(family, linked)
    ref_logits, ref_tokens, _ = hf_reference(family, linked.input_ids, linked.logits.shape[0])
    assert linked.logits.shape == ref_logits.shape
    assert (linked.logits - ref_logits).abs().max().item() <= TOL
    assert linked.generate(max_new_tokens=NUM_NEW).token_ids == ref_tokens


def assert_near_hf(family: str, linked) -> None:
    """Logits and greedy tokens against transformers' float32 run on the device (CUDA, or bfloat16).

    Logits: within ``bound`` (in bfloat16: the tolerance scaled by transformers' own bfloat16 error on this
    prompt). Tokens: equal to ``generate``'s up to the first step whose top-2 margin is under ``2 * bound``,
    where an error of ``bound`` per logit could flip the choice (bfloat16 ties exactly at the first tokens
    of the tiny models; in float32, qwen3 has a margin of 4e-5). Every token is also checked on pic's own
    continuation: transformers over the prompt and pic's tokens scores each of pic's greedy choices at most
    ``2 * bound`` below its best, which holds whenever pic's logits stay within ``bound`` of transformers'.
    """
    num_query, prompt = linked.logits.shape[0], linked.input_ids.shape[0]
    truth, truth_tokens, margins = hf_reference(family, linked.input_ids, num_query, dtype=torch.float32)
    hf_error = 0.0
    if target().dtype != torch.float32:
        own, _, _ = hf_reference(family, linked.input_ids, num_query)
        hf_error = (own - truth).abs().max().item()
    bound = TOLERANCES.bound(hf_error)
    assert linked.logits.shape == truth.shape
    assert (linked.logits - truth).abs().max().item() <= bound
    generation = linked.generate(max_new_tokens=NUM_NEW)
    tokens = generation.token_ids
    assert generation.stats.finish_reason in (pic.FinishReason.LENGTH, pic.FinishReason.EOS)
    assert len(tokens) == NUM_NEW or generation.stats.finish_reason is pic.FinishReason.EOS
    clear = next((i for i, m in enumerate(margins.tolist()) if m < 2 * bound), len(margins))
    assert tokens[:clear] == truth_tokens[:clear]
    ids = torch.cat((linked.input_ids, torch.tensor(tokens, dtype=torch.long))).to(target().device)
    with torch.no_grad():
        steps = target_model(family, dtype=torch.float32)(ids[None]).logits[0, prompt - 1 : -1]  # [len(tokens), V]
    chosen = steps.gather(1, ids[prompt:, None])[:, 0]
    assert (steps.max(-1).values - chosen).max().item() <= 2 * bound


@pytest.mark.parametrize("block_size", [4, 16, 64])
@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1)])
@pytest.mark.parametrize("prefix", ["", PREFIX])
def test_full_recompute_matches_transformers(family, block_size, order, prefix):
    engine = make_target_engine(family, block_size=block_size)
    ids = engine.compile(list(DOCS))
    linked = engine.link([ids[i] for i in order], QUERY, prefix=prefix, policy="full")
    assert linked.num_recomputed == linked.input_ids.shape[0]
    # The linked prompt is the segments' tokens in order, each chunk with its own BOS.
    bos = engine.tokenizer.bos_token_id
    assert (linked.input_ids == bos).sum().item() == len(order) + bool(prefix)
    assert_matches_hf(family, linked)


def test_one_chunk_naive_equals_full(family):
    engine = make_target_engine(family)
    (cid,) = engine.compile(DOCS[1])
    naive = engine.link([cid], QUERY, policy="naive")
    full = engine.link([cid], QUERY, policy="full")
    assert naive.num_recomputed == full.logits.shape[0] < full.num_recomputed
    assert torch.equal(naive.input_ids, full.input_ids)
    if not TOLERANCES.exact_greedy:  # the chunk's KV came from another forward: other shapes, other rounding
        assert_near_hf(family, naive)
        assert_near_hf(family, full)
        return
    assert (naive.logits - full.logits).abs().max().item() <= TOL
    assert naive.generate(max_new_tokens=NUM_NEW).token_ids == full.generate(max_new_tokens=NUM_NEW).token_ids


def test_naive_differs_from_full_with_several_chunks():
    """The oracle tests would pass vacuously if cached KV were ignored; Naive must actually reuse it."""
    engine = make_target_engine("stories260K")
    ids = engine.compile(list(DOCS))
    naive = engine.link(ids, QUERY, policy="naive")
    full = engine.link(ids, QUERY, policy="full")
    # More than rounding could explain (float32 on the CPU: 1e-3, as ever); they differ by 1.7 here.
    assert (naive.logits - full.logits).abs().max().item() > max(1e-3, 10 * TOL)


def test_token_ids_linked_like_text():
    """Chunks and queries given as token ids link exactly like the same text."""
    engine = make_target_engine("stories260K")
    tok = engine.tokenizer
    as_text = engine.link(engine.compile(list(DOCS)), QUERY, prefix=PREFIX)
    token_docs = [tok(d, add_special_tokens=False).input_ids for d in DOCS]
    as_ids = engine.link(
        engine.compile(token_docs),
        tok(QUERY, add_special_tokens=False).input_ids,
        prefix=tok(PREFIX, add_special_tokens=False).input_ids,
    )
    assert torch.equal(as_text.input_ids, as_ids.input_ids)
    assert torch.equal(as_text.logits, as_ids.logits)
