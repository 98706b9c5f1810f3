"""The vLLM connector's parts that need no vLLM: the link plan over token ids, the request parameters and
their salt, the client's prompts and reports, and the fingerprint of a checkpoint folder read without
loading it (equal to the loaded model's, on SmolLM2 and on tiny models saved here).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from transformers import LlamaForCausalLM

import pic
from pic.errors import InvalidInputError, PicError
from pic.ids import model_fingerprint
from pic.link.order import Order
from pic.link.policies import Auto
from pic.vllm.client import chat_link_prompt, compile_prompt, link_prompt, link_report
from pic.vllm.fingerprint import folder_fingerprint
from pic.vllm.params import CompileRequest, LinkRequest, VllmSuffix, link_salt, parse_params, parse_policy
from pic.vllm.plan import ConnectorPlan, LoadSpan, find_chunks, plan_link
from tests.models import TINY_FAMILIES, tiny_model
from tests.smollm2 import MESSAGES, encode

PREFIX = [1, 2, 3, 4]  # P = 4
CHUNKS = [[10, 11, 12, 13], [20, 21, 22, 23, 24, 25]]  # C = 10
IDS = ("a", "b")
QUERY = [30, 31]
PROMPT = PREFIX + CHUNKS[0] + CHUNKS[1] + QUERY


def plan(num_computed: int = 0, num_recomputed: int = 0, *, stored: bool = True, prefix=PREFIX) -> ConnectorPlan:
    """The plan for ``prefix + CHUNKS + QUERY``, checked to tile ``[num_computed, P + C - R)`` when it links."""
    prompt = prefix + CHUNKS[0] + CHUNKS[1] + QUERY
    start = find_chunks(prompt, CHUNKS)
    result = plan_link(prompt, IDS, CHUNKS, start=start, num_computed=num_computed, num_recomputed=num_recomputed,
                       prefix_id="pre" if prefix else None, prefix_stored=stored)  # fmt: skip
    assert_tiles(result, prompt, num_computed)
    return result


def assert_tiles(result: ConnectorPlan, prompt: list[int], num_computed: int) -> None:
    """The segments cover ``[num_computed, P + C - R)`` in order without gap, each with its stored tokens."""
    if result.num_external == 0:
        return
    end = result.num_prefix + result.num_chunk_tokens - result.num_recomputed
    assert result.num_external == end - num_computed
    position = num_computed
    stored = {"pre": prompt[: result.num_prefix], **dict(zip(IDS, CHUNKS, strict=True))}
    for seg in result.segments:
        assert seg.start == position and seg.num_tokens > 0
        tokens = stored[seg.cache_id][seg.offset : seg.offset + seg.num_tokens]
        assert prompt[seg.start : seg.start + seg.num_tokens] == tokens and len(tokens) == seg.num_tokens
        position += seg.num_tokens
    assert position == end


def test_find_chunks_finds_them_after_the_prefix():
    assert find_chunks(PROMPT, CHUNKS) == 4
    assert find_chunks([10, 11, 9, *PROMPT], CHUNKS) == 7  # a false start before the real place
    assert find_chunks(CHUNKS[0] + CHUNKS[1] + [30], CHUNKS) == 0


def test_find_chunks_needs_exact_tokens_in_order_then_a_query_token():
    assert find_chunks(PROMPT, [CHUNKS[0], [20, 21, 22, 99, 24, 25]]) is None
    assert find_chunks(PROMPT, CHUNKS[::-1]) is None
    assert find_chunks(PREFIX + CHUNKS[0] + CHUNKS[1], CHUNKS) is None  # the chunks end the prompt
    assert find_chunks(PREFIX + CHUNKS[0] + CHUNKS[1] + [7], CHUNKS) == 4


def test_find_chunks_takes_the_first_occurrence():
    joined = CHUNKS[0] + CHUNKS[1]
    assert find_chunks([5, *joined, 6, *joined, *QUERY], CHUNKS) == 1


def test_plan_from_scratch_loads_the_stored_prefix_then_each_chunk():
    result = plan(0)
    assert result.segments == (LoadSpan("pre", 0, 0, 4), LoadSpan("a", 4, 0, 4), LoadSpan("b", 8, 0, 6))
    assert (result.num_external, result.num_prefix, result.num_chunk_tokens, result.reason) == (14, 4, 10, None)
    assert result.save_prefix is None


def test_plan_after_a_vllm_hit_inside_the_prefix_starts_there():
    result = plan(2)
    assert result.segments == (LoadSpan("pre", 2, 2, 2), LoadSpan("a", 4, 0, 4), LoadSpan("b", 8, 0, 6))
    assert result.num_external == 12


def test_plan_after_a_vllm_hit_inside_a_chunk_needs_no_stored_prefix():
    result = plan(6, stored=False)
    assert result.segments == (LoadSpan("a", 6, 2, 2), LoadSpan("b", 8, 0, 6))
    assert (result.num_external, result.reason, result.save_prefix) == (8, None, None)


@pytest.mark.parametrize("num_computed", [0, 2])
def test_plan_leaves_the_recomputed_tail_of_the_last_chunk_to_vllm(num_computed):
    result = plan(num_computed, num_recomputed=2)
    assert result.segments[-1] == LoadSpan("b", 8, 0, 4)
    assert result.num_recomputed == 2 and result.num_external == 4 + 10 - 2 - num_computed


def test_plan_whose_policy_recomputes_whole_chunks():
    assert plan(0, 6).segments == (LoadSpan("pre", 0, 0, 4), LoadSpan("a", 4, 0, 4))
    assert plan(0, 10).segments == (LoadSpan("pre", 0, 0, 4),) and plan(0, 10).num_external == 4
    assert plan(2, 10).segments == (LoadSpan("pre", 2, 2, 2),)
    clamped = plan(0, 99)
    assert clamped.num_recomputed == 10 and clamped.num_external == 4
    assert plan(0, -3).num_recomputed == 0 and plan(0, -3).num_external == 14
    nothing = plan(4, 10)
    assert (nothing.segments, nothing.num_external, nothing.reason) == ((), 0, None)


def test_plan_without_a_stored_prefix_prefills_and_saves_it():
    result = plan(2, stored=False)
    assert (result.segments, result.num_external, result.save_prefix) == ((), 0, "pre")
    assert "prefix" in result.reason


def test_plan_without_a_prefix_links_the_chunks_from_zero():
    result = plan(0, stored=False, prefix=[])
    assert result.segments == (LoadSpan("a", 0, 0, 4), LoadSpan("b", 4, 0, 6))
    assert (result.num_external, result.reason, result.save_prefix) == (10, None, None)


@pytest.mark.parametrize("num_computed", [14, 16])
def test_plan_when_vllm_holds_everything_claims_nothing(num_computed):
    result = plan(num_computed)
    assert (result.segments, result.num_external, result.reason) == ((), 0, None)


def test_plan_for_a_prompt_without_the_chunks_says_why():
    result = plan_link(PROMPT, IDS, CHUNKS, start=None, num_computed=0, num_recomputed=0, prefix_id="pre",
                       prefix_stored=True)  # fmt: skip
    assert (result.segments, result.num_external) == ((), 0)
    assert "tokens" in result.reason


def test_parse_policy_reads_the_four_forms():
    assert parse_policy("naive") == VllmSuffix(0.0) and parse_policy("naive").name == "naive"
    assert parse_policy("full") == VllmSuffix(1.0) and parse_policy("full").name == "full"
    assert parse_policy("suffix:0.2").ratio == 0.2 and parse_policy("suffix:0.2").name == "suffix:0.2"
    auto = parse_policy("auto")  # pic's default, as vLLM runs it: whole chunks under a ceiling
    assert auto == VllmSuffix(0.05, whole=True, auto=Auto()) and auto.name == "auto:0.05"
    tenth = VllmSuffix(0.1, whole=True, auto=Auto(budget=0.1, max_share=0.6))
    assert parse_policy("auto:0.1,max_share=0.6") == tenth and parse_policy(tenth.name) == tenth


@pytest.mark.parametrize(
    "value", ["suffix:1.5", "suffix:-0.1", "suffix:x", "suffix:nan", "cacheblend:0.15", "auto:2", "autox", None]
)
def test_parse_policy_refuses_others_naming_them(value):
    with pytest.raises(InvalidInputError, match=re.escape(repr(value))):
        parse_policy(value)


def test_suffix_rounds_its_share_of_the_chunk_tokens():
    assert [VllmSuffix(0.2).num_recomputed([n]) for n in (10, 7, 8, 0)] == [2, 1, 2, 0]
    assert VllmSuffix(0.0).num_recomputed([50]) == 0 and VllmSuffix(1.0).num_recomputed([20, 30]) == 50
    assert VllmSuffix(0.2).num_recomputed([30, 40, 30]) == 20  # the last 20 tokens, inside the last chunk


def test_a_whole_suffix_takes_the_chunks_it_would_cut():
    whole = VllmSuffix(0.2, whole=True)
    assert whole.num_recomputed([30, 40, 30]) == 30  # the whole last chunk
    assert whole.num_recomputed([30, 40, 10]) == 50  # 16 tokens reach into the middle chunk: it comes whole
    assert whole.num_recomputed([100]) == 100 and VllmSuffix(0.001, whole=True).num_recomputed([100]) == 0
    assert parse_policy("suffix:0.2,whole=true") == whole and whole.name == "suffix:0.2,whole=true"
    assert parse_policy(whole.name) == whole  # the spelling the salt uses reads back


def test_auto_takes_whole_chunks_under_its_ceiling_and_cuts_over_it():
    auto = VllmSuffix(0.05, whole=True, auto=Auto(min_gain=1.0))  # the ceiling alone
    assert auto.num_recomputed([300, 300, 300]) == 300  # the last chunk whole: a third of the chunk tokens
    assert auto.num_recomputed([300, 500]) == 400  # the last chunk, 500 of 800, cut at half the chunk tokens
    assert auto.num_recomputed([10, 12]) == 11 and auto.num_recomputed([12, 10]) == 10
    default = parse_policy("auto")  # and a prompt too short to win: a plain prefill, as pic's engine runs it
    assert default.num_recomputed([300] * 4, 40) == 300 and default.num_recomputed([300] * 3, 40) == 900


@pytest.mark.parametrize("params", [None, {}, {"do_remote_prefill": True}, "pic"])
def test_parse_params_without_pic_is_none(params):
    assert parse_params(params) is None


def test_parse_params_reads_compile_and_link_requests():
    assert parse_params({"pic": {"compile": True}}) == CompileRequest()
    link = parse_params({"pic": {"ids": ["a", "b"]}, "other": 1})
    default = VllmSuffix(0.05, whole=True, auto=Auto())  # a request that names no policy: pic's default, auto
    assert link == LinkRequest(ids=("a", "b"), policy=default) and link.policy.name == "auto:0.05"
    assert parse_params({"pic": {"ids": ["a"], "policy": "naive"}}).policy == VllmSuffix(0.0)


@pytest.mark.parametrize(
    ("entry", "field"),
    [
        ({"ids": ["a"], "policies": "naive"}, "['pic']"),
        ("a", "['pic']"),
        ({"ids": []}, "['ids']"),
        ({"ids": ["a", 3]}, "['ids']"),
        ({"ids": "a"}, "['ids']"),
        ({"compile": False}, "['ids']"),
        ({"ids": ["a"], "policy": "smart"}, "'smart'"),
    ],
)
def test_parse_params_refuses_a_malformed_entry_naming_the_field(entry, field):
    with pytest.raises(InvalidInputError) as error:
        parse_params({"pic": entry})
    assert field in str(error.value)


def test_link_salt_differs_by_policy_and_order():
    salt = link_salt(["a", "b"], "naive")
    assert salt.startswith("pic-") and salt == link_salt(("a", "b"), "naive")
    assert len({salt, link_salt(["b", "a"], "naive"), link_salt(["a", "b"], "full"), link_salt(["ab"], "naive")}) == 4
    request = LinkRequest(ids=("a", "b"), policy=VllmSuffix(0.2))
    assert request.salt == link_salt(["a", "b"], "suffix:0.2")


LINKED = [("b", [5, 20, 21]), ("a", [5, 10, 11]), ("c", [5, 40, 41])]


def test_link_prompt_in_the_given_order():
    prompt = link_prompt(LINKED, [21, 5], prefix_ids=[1, 2], policy="naive", order="given")
    assert prompt.ids == ("b", "a", "c") and prompt.policy == "naive"
    assert prompt.prompt_token_ids == [1, 2, 5, 20, 21, 5, 10, 11, 5, 40, 41, 21, 5]


def test_link_prompt_by_relevance_puts_the_chunk_with_the_querys_rare_tokens_last():
    assert link_prompt(LINKED, [21, 21, 5]).order.order is Order.GIVEN  # the default: too short to win, as given
    prompt = link_prompt(LINKED, [21, 21, 5], policy="suffix:0.2")  # a suffix policy: the relevance order
    assert prompt.ids == ("a", "c", "b") and prompt.order.indices == (1, 2, 0)
    assert prompt.prompt_token_ids == [5, 10, 11, 5, 40, 41, 5, 20, 21, 21, 21, 5]
    assert prompt.kv_transfer_params["pic"]["order"] == "relevance"
    assert link_prompt(LINKED, [21, 21, 5], policy="naive").ids == ("b", "a", "c")  # naive, full: as given
    assert link_prompt(LINKED, [21, 21, 5], policy="suffix:0.2", relevance=[3, 2, 1]).ids == ("c", "a", "b")


@pytest.mark.parametrize(
    ("chunks", "query", "options"),
    [([], [1], {}), (LINKED, [], {}), (LINKED, [1], {"order": "random"}), (LINKED, [1], {"policy": "cacheblend"})],
)
def test_link_prompt_refuses_bad_input(chunks, query, options):
    with pytest.raises(InvalidInputError):
        link_prompt(chunks, query, **options)


def test_link_prompt_carries_the_salt_and_params_the_connector_checks():
    prompt = link_prompt(LINKED, [21], policy="full", order="given")
    order = {"order": "given"}
    salt, params = link_salt(["b", "a", "c"], "full"), {"pic": {"ids": ["b", "a", "c"], "policy": "full", **order}}
    assert prompt.tokens_prompt() == {"prompt_token_ids": prompt.prompt_token_ids, "cache_salt": salt}
    assert prompt.extra_args() == {"kv_transfer_params": params}
    assert prompt.openai_extra_body() == {"cache_salt": salt, "kv_transfer_params": params}
    assert parse_params(prompt.kv_transfer_params).salt == salt  # what the scheduler side compares


@pytest.mark.parametrize("policy", ["suffix:0.20", "suffix:0", "suffix:1"])
def test_link_prompt_salt_matches_the_connectors_for_any_spelling_of_a_policy(policy):
    prompt = link_prompt(LINKED, [21], policy=policy)
    assert parse_params(prompt.kv_transfer_params).salt == prompt.cache_salt


def test_chat_link_prompt_is_the_chat_template_around_the_documents(smollm2):
    doc = "The river Elbe flows into the North Sea.\n\n"
    prompt = chat_link_prompt(smollm2.tokenizer, [("d", encode(smollm2, doc))], MESSAGES, order="given")
    messages = [MESSAGES[0], {"role": "user", "content": doc + MESSAGES[1]["content"]}]
    expected = smollm2.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert smollm2.tokenizer.decode(prompt.prompt_token_ids) == expected and prompt.ids == ("d",)


def test_compile_prompt_with_and_without_a_bos():
    assert compile_prompt([7, 8], bos_token_id=1) == ([1, 7, 8], {"pic": {"compile": True}})
    tokens, params = compile_prompt((7, 8))
    assert tokens == [7, 8] and parse_params(params) == CompileRequest()


def test_link_report_raises_with_the_reason_unless_linked():
    refused = {"pic": {"linked": False, "reason": "the prefix is in no tier yet"}}
    with pytest.raises(PicError, match="the prefix is in no tier yet"):
        link_report(refused)
    assert link_report(refused, strict=False) == refused["pic"]
    assert link_report({"pic": {"linked": True, "num_loaded": 8}})["num_loaded"] == 8
    assert link_report({"pic": {"cache_id": "3f2a"}}) == {"cache_id": "3f2a"}
    for missing in (None, {}, {"other": 1}):
        with pytest.raises(PicError, match="PicConnector"):
            link_report(missing, strict=False)


def test_folder_fingerprint_is_smollm2s_loaded_fingerprint(smollm2):
    folder = smollm2.model.name_or_path
    assert folder_fingerprint(folder, torch.float32) == smollm2.fingerprint
    bfloat16 = folder_fingerprint(folder, torch.bfloat16)
    assert bfloat16 != smollm2.fingerprint
    assert bfloat16 == pic.PIC.from_pretrained("smollm2", dtype="bfloat16").fingerprint


def _tied_llama() -> torch.nn.Module:
    """A tiny Llama with tied embeddings and a hidden size under the sample (several rows per end)."""
    config = copy.deepcopy(TINY_FAMILIES["llama"][1])
    config.tie_word_embeddings, config.hidden_size, config.intermediate_size = True, 24, 40
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("build", [_tied_llama, lambda: tiny_model("qwen2")], ids=["tied-llama", "qwen2"])
def test_folder_fingerprint_is_the_saved_models(build, tmp_path):
    model = build()
    model.save_pretrained(tmp_path)
    assert folder_fingerprint(tmp_path, torch.float32) == model_fingerprint(model)
    assert folder_fingerprint(tmp_path, torch.bfloat16) == model_fingerprint(model.to(torch.bfloat16))
