"""APE and compile in context: the merged attention against APE's own two-part formula, chunk KV compiled after a
context against transformers, ids, refusals, parallel positions, and APE requests batched with others."""

from __future__ import annotations

import hashlib
import math

import msgpack
import pytest
import torch

import pic
from pic.attention.ape import ContextScaling, ape_attention
from pic.attention.rope import apply_rope
from pic.ids import KV_FORMAT_VERSION, chunk_id
from tests.conftest import make_engine
from tests.models import DOCS, QUERY, model

CONTEXT = "Once upon a time, in a small town,"


def _ape_reference(q, k, v, allowed, context, temperature, scale, scaling):
    """APE's ``llama_attention_prefill_query``: attention over the context (scores / T) and over the rest,
    each normalised alone, merged by softmax([S * T * lse_context, lse_other]), per sequence, head and row."""
    b, hq, n, d = q.shape
    group = hq // k.shape[1]
    out = torch.zeros(b, hq, n, d, dtype=torch.float64)
    for i in range(b):
        for h in range(hq):
            kk, vv = k[i, h // group].double(), v[i, h // group].double()
            for r in range(n):
                s = (q[i, h, r].double() @ kk.T) * scaling
                ctx, oth = allowed[i, r] & context[i], allowed[i, r] & ~context[i]
                parts, lses = [], []
                if ctx.any():
                    w = torch.softmax(s[ctx] / temperature, 0)
                    parts.append(w @ vv[ctx])
                    lses.append(torch.logsumexp(s[ctx] / temperature, 0) * scale * temperature)
                if oth.any():
                    parts.append(torch.softmax(s[oth], 0) @ vv[oth])
                    lses.append(torch.logsumexp(s[oth], 0))
                weights = torch.softmax(torch.stack(lses), 0)
                out[i, h, r] = sum(wt * p for wt, p in zip(weights, parts, strict=True))
    return out


def test_ape_attention_is_apes_two_part_merge():
    torch.manual_seed(0)
    b, hq, hkv, n, s, d = 2, 4, 2, 3, 10, 8
    q, k, v = torch.randn(b, hq, n, d), torch.randn(b, hkv, s, d), torch.randn(b, hkv, s, d)
    allowed = torch.rand(b, n, s) > 0.2
    allowed[:, :, 0] = True  # every row sees some key
    context = torch.zeros(b, s, dtype=torch.bool)
    context[:, 2:7] = True
    scalings = [ContextScaling(0.7, 0.8), None]
    got = ape_attention(q, k, v, allowed, context, scalings, scaling=d**-0.5)
    expected0 = _ape_reference(q[:1], k[:1], v[:1], allowed[:1], context[:1], 0.7, 0.8, d**-0.5)
    expected1 = _ape_reference(q[1:], k[1:], v[1:], allowed[1:], context[1:], 1.0, 1.0, d**-0.5)
    assert torch.allclose(got[:1].double(), expected0, atol=1e-5)
    assert torch.allclose(got[1:].double(), expected1, atol=1e-5)
    plain = torch.softmax((q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * d**-0.5 + (~allowed[:, None]) * -1e9, -1)
    assert torch.allclose(got[1:], (plain @ v.repeat_interleave(2, 1))[1:], atol=1e-5)  # no scaling: plain


@pytest.mark.parametrize("family", ("llama", "qwen3", "stories260K"))
def test_chunks_compiled_in_context_hold_what_transformers_computes_there(family):
    engine = make_engine(family)
    (cid,) = engine.compile([DOCS[0]], context=CONTEXT)
    chunk = engine.store.get(cid)
    context_ids = engine.tokenizer(CONTEXT, add_special_tokens=False).input_ids
    bos = [engine.bos_token_id] if engine.config.add_bos else []
    assert chunk.options.context == tuple(bos + context_ids)  # a context starts a prompt: after the BOS
    sequence = [*chunk.options.context, *chunk.token_ids.tolist()]
    with torch.no_grad():
        cache = model(family)(torch.tensor([sequence]), use_cache=True).past_key_values
    start, m = len(chunk.options.context), model(family)
    positions = torch.arange(start, len(sequence))
    cos, sin = m.model.rotary_emb(chunk.v, positions[None])
    for layer in range(engine.spec.num_layers):
        keys, values = cache.layers[layer].keys[0, :, start:], cache.layers[layer].values[0, :, start:]  # [H, L, D]
        assert torch.allclose(chunk.v[layer], values.transpose(0, 1), atol=1e-5)
        rotated = apply_rope(chunk.k[layer][None], cos, sin)[0]  # the cache's NoPE K at the context's positions
        assert torch.allclose(rotated, keys.transpose(0, 1), atol=1e-5)


def test_context_is_part_of_the_id_and_no_context_keeps_the_old_ids(stories):
    plain = stories.compile(list(DOCS))
    in_context = stories.compile(list(DOCS), context=CONTEXT)
    other = stories.compile(list(DOCS), context="The end.")
    assert len(set(plain) | set(in_context) | set(other)) == 9
    assert stories.compile(list(DOCS), context=CONTEXT) == in_context  # no work the second time
    tokens = stories.tokenizer(DOCS[0], add_special_tokens=False).input_ids
    options = {"add_bos": True, "num_extra_bos": 0}  # the record ids hashed before contexts existed
    old = hashlib.sha256(msgpack.packb([KV_FORMAT_VERSION, stories.fingerprint, options, tokens])).hexdigest()[:32]
    assert plain[0] == old == chunk_id(stories.fingerprint, tokens, pic.CompileOptions())
    with pytest.raises(pic.InvalidInputError, match="context '' has no tokens"):
        stories.compile(list(DOCS), context="")


def test_policies_link_chunks_compiled_in_context(stories):
    ids = stories.compile(list(DOCS), context=CONTEXT)
    for policy in ("naive", "regions", "prophetkv", "full"):
        with stories.link(ids, QUERY, prefix=CONTEXT, policy=policy) as linked:
            assert linked.input_ids.shape[0] > 0
    full_in_context = stories.link(ids, QUERY, prefix=CONTEXT, policy="full").logits
    full_alone = stories.link(stories.compile(list(DOCS)), QUERY, prefix=CONTEXT, policy="full").logits
    assert torch.equal(full_in_context, full_alone)  # Full Recompute recomputes the context's effect away
    with pytest.raises(pic.CompileOptionsMismatchError, match="needs chunks compiled in context"):
        stories.link(stories.compile(list(DOCS)), QUERY, policy="ape")
    with pytest.raises(pic.CompileOptionsMismatchError, match="legolink0:3"):
        stories.link(ids, QUERY, policy="legolink0")


def test_ape_positions_scaling_and_its_limit(stories):
    ids = stories.compile(list(DOCS), context=CONTEXT)
    with stories.link(ids, QUERY, prefix=CONTEXT, policy="ape") as linked:
        layout = linked.layout
        start = layout.segments[0].num_tokens
        longest = max(seg.num_tokens for seg in layout.chunks)
        for seg in layout.chunks:
            assert layout.positions[seg.tokens].tolist() == list(range(start, start + seg.num_tokens))
        assert layout.positions[layout.query.tokens][0] == start + longest
        assert linked.num_recomputed == layout.num_tokens - int(layout.cached.sum())
        ape = linked.logits
    with stories.link(ids, QUERY, prefix=CONTEXT, policy="naive") as naive:
        assert not torch.allclose(naive.logits, ape, atol=1e-3)
        plain = stories.link(ids, QUERY, prefix=CONTEXT, policy="ape:1.0,scale=1.0,parallel=false")
        assert torch.allclose(plain.logits, naive.logits, atol=1e-4, rtol=0)  # T = S = 1 in order: Naive
        plain.release()


def test_ape_requests_batch_with_others(stories):
    ids = stories.compile(list(DOCS), context=CONTEXT)
    requests = [
        pic.Request(ids[i:] + ids[:i], QUERY, prefix=CONTEXT, policy=policy, max_new_tokens=8)
        for i, policy in enumerate(["ape", "naive", "ape:0.5,scale=0.8", "regions", "ape:0.9,parallel=false"])
    ]
    together = stories.generate_many(requests)
    alone = [stories.generate_many([r])[0] for r in requests]
    assert [g.token_ids for g in together] == [g.token_ids for g in alone]
    assert together[0].stats.num_generated_tokens == 8 and not math.isnan(together[0].ttft_s)


def test_ape_needs_the_torch_backend():
    pytest.importorskip("triton", reason="the Triton backend needs triton (pip install 'pic-kv[triton]')")
    engine = make_engine("stories260K", attention_backend="triton")
    ids = engine.compile(list(DOCS), context=CONTEXT)
    with pytest.raises(pic.PolicyError, match="torch attention backend only.*'triton'"):
        engine.link(ids, QUERY, prefix=CONTEXT, policy="ape")
