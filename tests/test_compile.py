"""compile: content-addressed ids, no repeated work, and cached KV that is K before RoPE."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import pic
from pic.compile import ChunkPrefill
from tests.conftest import make_engine
from tests.models import tiny_model, tokenizer

DOCS = ["Tom had a big red ball.", "Lily loved to sing every morning.", "The cat sat on the mat."]


def test_ids_are_content_addresses():
    a, b = make_engine("llama"), make_engine("llama")  # two engines, same weights: same ids
    assert a.compile(DOCS) == b.compile(DOCS)
    assert len(set(a.compile(DOCS))) == len(DOCS)
    other = pic.PIC(tiny_model("llama", seed=1), tokenizer())  # same config, other weights
    assert set(other.compile(DOCS)).isdisjoint(a.compile(DOCS))
    no_bos = make_engine("llama", add_bos=False)
    assert set(no_bos.compile(DOCS)).isdisjoint(a.compile(DOCS))


def test_compiling_again_does_no_work(monkeypatch):
    engine = make_engine("stories260K")
    calls = []
    real = ChunkPrefill.start
    monkeypatch.setattr(ChunkPrefill, "start", lambda self, *a: calls.append(self.token_ids) or real(self, *a))
    first = engine.compile([DOCS[0], DOCS[1], DOCS[0]])
    assert first[0] == first[2] and len(calls) == 2
    assert engine.compile(DOCS) == [first[0], first[1], engine.compile(DOCS[2])[0]]
    assert len(calls) == 3 and len(engine.store.ids()) == 3


def test_cached_kv_is_nope_k_of_the_chunk_alone():
    """The stored K, rotated at positions 0..L-1, and V equal transformers' own cache of the chunk."""
    engine = make_engine("qwen3")
    (cid,) = engine.compile(DOCS[1])
    chunk = engine.store.get(cid)
    model = engine.model
    with torch.no_grad():
        cache = model(chunk.token_ids[None], use_cache=True).past_key_values
    with engine.paused() as core:
        cos, sin = core.runner.rope(torch.arange(chunk.num_tokens))
    for layer in range(engine.spec.num_layers):
        k_nope = chunk.k[layer].transpose(0, 1)[None]  # [1, Hkv, L, D]
        _, k_rot = apply_rotary_pos_emb(k_nope, k_nope, cos[None], sin[None])
        assert (k_rot - cache.layers[layer].keys).abs().max() <= 1e-5
        assert (chunk.v[layer].transpose(0, 1)[None] - cache.layers[layer].values).abs().max() <= 1e-5


def test_extra_bos_tokens_are_prefilled_then_dropped():
    engine = make_engine("llama")
    (cid,) = engine.compile(DOCS[0], policy=_extra_bos_policy())
    chunk = engine.store.get(cid)
    bos = tokenizer().bos_token_id
    content = tokenizer()(DOCS[0], add_special_tokens=False).input_ids
    assert chunk.token_ids.tolist() == [bos, *content] and chunk.options.num_extra_bos == 2
    with torch.no_grad():
        full = engine.model(torch.tensor([[bos, bos, bos, *content]]), use_cache=True).past_key_values
    assert (chunk.v[0].transpose(0, 1) - full.layers[0].values[0, :, 2:]).abs().max() <= 1e-5


def _extra_bos_policy() -> pic.policies.Policy:
    class TwoExtraBos(pic.policies.Naive):
        name = "two-extra-bos"

        def compile_options(self, base):
            return base.model_copy(update={"num_extra_bos": 2})

    return TwoExtraBos()


@pytest.mark.parametrize("progress, shown", [(None, False), (True, True)])
def test_progress_bar(capsys, progress, shown):
    make_engine("stories260K").compile(DOCS, progress=progress)
    assert ("pic compile" in capsys.readouterr().err) is shown


def test_many_documents_show_progress(capsys):
    docs = [f"Tom had {n} red balls." for n in range(10)]
    assert len(set(make_engine("stories260K").compile(docs))) == 10
    assert "pic compile: 100%" in capsys.readouterr().err


def test_tokenizer_without_bos():
    """Qwen-style tokenizers have no BOS: chunks get none, and extra-BOS policies are refused."""
    no_bos = copy.deepcopy(tokenizer())
    no_bos.bos_token = None  # as a Qwen tokenizer reports it
    engine = pic.PIC(tiny_model("qwen2"), no_bos)
    assert engine.compile_options() == pic.CompileOptions(add_bos=False)
    (cid,) = engine.compile(DOCS[0])
    assert engine.store.get(cid).token_ids.tolist() == tokenizer()(DOCS[0], add_special_tokens=False).input_ids
    with pytest.raises(pic.PolicyError, match="'two-extra-bos' needs extra BOS tokens"):
        engine.compile(DOCS[0], policy=_extra_bos_policy())
