"""Bad input gets a PicError naming the value, and the store keeps every chunk it had."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import pic
from pic.config import CompileOptions
from pic.link.policies import registry
from tests.conftest import make_engine
from tests.models import model, tokenizer

DOCS = ["Tom had a red ball.", "Lily liked to sing."]


@pytest.fixture
def engine() -> pic.PIC:
    return make_engine("stories260K")


def assert_store_intact(engine: pic.PIC, ids: list[str], *, linkable: list[str] | None = None) -> None:
    """The store holds exactly ``ids``, no blocks leaked, and the (default-option) chunks still link."""
    assert sorted(engine.store.ids()) == sorted(ids)
    assert engine.kv_stats().num_available_blocks == engine.kv_stats().num_blocks
    assert engine.link(ids if linkable is None else linkable, "One day,").generate(max_new_tokens=4).token_ids


def test_unknown_cache_id(engine):
    ids = engine.compile(DOCS)
    with pytest.raises(pic.UnknownCacheIdError, match="'deadbeef'"):
        engine.link([ids[0], "deadbeef"], "One day,")
    assert_store_intact(engine, ids)


@pytest.mark.parametrize(
    "docs, named", [([], r"\[\]"), ("", "document 0"), ([DOCS[0], ""], "document 1"), (["   "], "document 0")]
)
def test_empty_documents(engine, docs, named):
    ids = engine.compile(DOCS)
    with pytest.raises(pic.InvalidInputError, match=named):
        engine.compile(docs)
    assert_store_intact(engine, ids)


@pytest.mark.parametrize("bad, named", [([[1, 2, 99999]], "99999"), ([[1, 2.5]], "document 0"), ([7], "document 0")])
def test_bad_token_ids(engine, bad, named):
    ids = engine.compile(DOCS)
    with pytest.raises(pic.InvalidInputError, match=named):
        engine.compile(bad)
    assert_store_intact(engine, ids)


def test_empty_query(engine):
    ids = engine.compile(DOCS)
    with pytest.raises(pic.InvalidInputError, match="query"):
        engine.link(ids, "")
    assert_store_intact(engine, ids)


def test_linked_prompt_longer_than_context(engine):
    ids = engine.compile(DOCS)
    long_doc = " ".join(["The dog ran to the park and played with a ball."] * 30)
    (long_id,) = engine.compile(long_doc[: len(long_doc) // 2])
    with pytest.raises(pic.ContextLengthError, match=r"linked prompt has \d+ tokens.*512-token context"):
        engine.link([long_id, long_id, *ids], "One day,")
    with pytest.raises(pic.ContextLengthError, match="document 0"):
        engine.compile(long_doc * 2)
    assert_store_intact(engine, [*ids, long_id])


def test_non_rope_model_refused():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=512))
    with pytest.raises(pic.UnsupportedModelError, match="GPT2LMHeadModel.*'gpt2'.*no rotary"):
        pic.PIC(gpt2, tokenizer())


class NeedsExtraBos(pic.policies.Naive):
    """A policy whose chunks need one extra leading BOS at compile time."""

    name = "test-extra-bos"

    def compile_options(self, base: CompileOptions) -> CompileOptions:
        return base.model_copy(update={"num_extra_bos": 1})


@pytest.fixture
def extra_bos_policy(monkeypatch):
    """``NeedsExtraBos`` registered for one test (a policy left in the registry shows up in later tests' lists)."""
    monkeypatch.setitem(registry._POLICIES, NeedsExtraBos.name, NeedsExtraBos)


def test_chunk_compiled_with_other_options(engine, extra_bos_policy):
    ids = engine.compile(DOCS)
    with pytest.raises(pic.CompileOptionsMismatchError, match=f"{ids[0]}.*test-extra-bos"):
        engine.link(ids, "One day,", policy="test-extra-bos")
    extra_ids = engine.compile(DOCS, policy="test-extra-bos")
    assert set(extra_ids).isdisjoint(ids)  # the options are part of the id
    assert engine.link(extra_ids, "One day,", policy="test-extra-bos").num_recomputed > 0
    assert_store_intact(engine, ids + extra_ids, linkable=ids)


@pytest.mark.parametrize("spec, named", [("nope", "'nope'"), ("naive:3", "'3'"), (42, "42")])
def test_unknown_policy(engine, spec, named):
    ids = engine.compile(DOCS)
    with pytest.raises(pic.PolicyError, match=named):
        engine.link(ids, "One day,", policy=spec)
    assert_store_intact(engine, ids)


@pytest.mark.parametrize(
    "options, named",
    [
        ({"temperature": -1.0}, "temperature=-1.0"),
        ({"top_p": 0.0}, "top_p=0.0"),
        ({"stop": [""]}, "stop"),
        ({"max_new_tokens": -2}, "max_new_tokens=-2"),
    ],
)
def test_bad_sampling_options(engine, options, named):
    linked = engine.link(engine.compile(DOCS), "One day,")
    with pytest.raises(pic.InvalidInputError, match=named):
        linked.generate(**options)
    assert linked.generate(max_new_tokens=2).token_ids  # the request is still usable


def test_generate_twice_is_an_error(engine):
    linked = engine.link(engine.compile(DOCS), "One day,")
    linked.generate(max_new_tokens=2)
    with pytest.raises(pic.LinkedReleasedError):
        linked.generate(max_new_tokens=2)


def test_module_functions_need_an_engine(monkeypatch):
    monkeypatch.setattr(pic, "_default_engine", None)
    with pytest.raises(pic.NoEngineError, match="pic.load"):
        pic.compile(DOCS)
    with pytest.raises(pic.NoEngineError, match="pic.load"):
        pic.link(["0" * 32], "One day,")
    with pytest.raises(pic.NoEngineError, match="pic.load"):
        pic.link_chat([], [{"role": "user", "content": "Hi."}])


def test_bad_device_and_dtype():
    with pytest.raises(pic.InvalidInputError, match="'float8'"):
        pic.load(dtype="float8")
    with pytest.raises(pic.InvalidInputError, match="'gpu0'"):
        pic.load(device="gpu0")


def test_pool_exhausted_frees_nothing_it_did_not_take():
    engine = make_engine("stories260K", kv_pool_tokens=64, block_size=16)
    ids = engine.compile(DOCS)
    with pytest.raises(pic.KVPoolExhaustedError, match=r"needs \d+ blocks of 16 tokens but the pool has 4"):
        engine.link(ids * 4, "One day,", policy="full")  # (auto would share the repeated chunks' blocks)
    with pytest.raises(pic.KVPoolExhaustedError, match=r"needs 3 blocks of 16 tokens but 2 of 4 are available"):
        engine.link(ids, "One day,", policy="full")  # its own 2 chunk blocks are not available to it
    stats = engine.kv_stats()
    assert stats.num_available_blocks == 4 and stats.num_resident_chunk_blocks == 2  # evictable, still there
    assert [engine.store.lookup(i) for i in ids] == [("device",), ("device",)]
    assert torch.is_tensor(engine.link(ids, "One day,", policy="naive").logits)  # the cached chunks serve


def test_malformed_policy_selection(engine):
    class Sloppy(pic.policies.Naive):
        name = "test-sloppy"

        def select(self, layout):
            return [True] * layout.num_tokens

    ids = engine.compile(DOCS)
    with pytest.raises(pic.PolicyError, match="'test-sloppy'.*bool tensor of shape"):
        engine.link(ids, "One day,", policy=Sloppy())
    assert_store_intact(engine, ids)


def test_policy_name_clash():
    class Impostor(pic.policies.Naive):
        name = "full"

    with pytest.raises(pic.PolicyError, match="'full' is already taken by FullRecompute"):
        pic.policies.register(Impostor)


def test_empty_eos_list_means_no_eos():
    engine = make_engine("stories260K", eos_token_ids=())
    assert engine.eos_token_ids == frozenset()
    assert len(engine.link(engine.compile(DOCS), "One day,").generate(max_new_tokens=300).token_ids) == 300


@pytest.mark.parametrize("bad", [[b"Tom"], b"Tom", [bytearray(b"Tom")], ["Tom", memoryview(b"x")]])
def test_bytes_are_refused_not_read_as_token_ids(engine, bad):
    ids = engine.compile(DOCS)
    with pytest.raises(pic.InvalidInputError, match="is (bytes|bytearray|memoryview).*decode it first"):
        engine.compile(bad)
    with pytest.raises(pic.InvalidInputError, match="query is bytes"):
        engine.link(ids, b"One day,")
    assert_store_intact(engine, ids)


@pytest.mark.parametrize("bad", [None, 42, [None], [b"abc"], [[1, 2]]])
def test_cache_ids_of_the_wrong_type(engine, bad):
    ids = engine.compile(DOCS)
    with pytest.raises(pic.InvalidInputError, match="cache_ids is .*expected a list of cache ids"):
        engine.link(bad, "One day,")
    assert_store_intact(engine, ids)


def test_documents_may_come_from_any_iterable(engine):
    assert engine.compile(d for d in DOCS) == engine.compile(DOCS) == engine.compile(tuple(DOCS))


def test_a_document_must_leave_room_for_a_query(engine):
    """A chunk that fills the context with its BOS could be compiled but never linked: refused."""
    context = engine.spec.max_context
    with pytest.raises(pic.ContextLengthError, match=f"document 0 has {context - 1} tokens; at most {context - 2}"):
        engine.compile([[300] * (context - 1)])
    (cid,) = engine.compile([[300] * (context - 2)])
    assert engine.link([cid], [301], policy="naive").input_ids.shape[0] == context
    with pytest.raises(pic.ContextLengthError, match=f"at most {context - 4} fit"):  # 3 extra BOS + its own
        engine.compile([[300] * (context - 3)], policy="legolink0")


def test_unavailable_device():
    with pytest.raises(pic.InvalidInputError, match="device 'cuda:99' is not available on this machine"):
        pic.load(device="cuda:99")
    if not torch.cuda.is_available():
        with pytest.raises(pic.InvalidInputError, match="device 'cuda' is not available on this machine"):
            pic.load(device="cuda")


@pytest.mark.parametrize("name", ["/nonexistent/model", "./no-such-folder"])
def test_missing_model_folder(name):
    with pytest.raises(pic.ModelLoadError, match=f"cannot load model '{name}': no such folder") as caught:
        pic.load(name)
    assert isinstance(caught.value, OSError)


def test_model_not_in_the_offline_cache(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty cache
    with pytest.raises(pic.ModelLoadError, match="cannot load model 'nobody/no-such-model'.*HF_HUB_OFFLINE"):
        pic.load("nobody/no-such-model")


@pytest.mark.parametrize(
    "options, named",
    [
        ({"temperature": 1.0, "seed": 2**70}, "seed=1180591620717411303424"),
        ({"temperature": 1.0, "seed": -1}, "seed=-1"),
        ({"temperature": float("inf")}, "temperature=inf.*finite"),
        ({"top_p": float("nan")}, "top_p=nan"),
        ({"max_new_tokens": "10"}, "max_new_tokens='10'.*valid integer"),
        ({"max_new_tokens": 10.0}, "max_new_tokens=10.0"),
        ({"top_k": True}, "top_k=True"),
        ({"stop": [1]}, "stop"),
    ],
)
def test_sampling_options_are_strict(engine, options, named):
    linked = engine.link(engine.compile(DOCS), "One day,")
    with pytest.raises(pic.InvalidInputError, match=named):
        linked.generate(**options)
    assert linked.generate(max_new_tokens=2, temperature=1, seed=2**64 - 1).token_ids  # still usable


@pytest.mark.parametrize(
    "make, error, named",
    [
        (lambda: pic.PICConfig(block_size=0), pic.InvalidInputError, "block_size=0"),
        (lambda: pic.PICConfig(blok_size=3), pic.InvalidInputError, "'blok_size' \\(did you mean 'block_size'\\?\\)"),
        (lambda: pic.PICConfig(block_size="16"), pic.InvalidInputError, "block_size='16'"),
        (lambda: pic.PICConfig(eos_token_ids=[-1]), pic.InvalidInputError, "eos_token_ids"),
        (lambda: pic.StoreConfig(redis_url="http://x"), pic.InvalidInputError, "redis_url='http://x'"),
        (lambda: pic.StoreConfig(redis_timeout_s=float("inf")), pic.InvalidInputError, "redis_timeout_s=inf"),
        (lambda: pic.policies.LegoLink(k=-1), pic.PolicyError, "'legolink': k=-1"),
        (lambda: pic.policies.LegoLink(k="16"), pic.PolicyError, "k='16'"),
        (lambda: pic.policies.CacheBlend(ratio=2), pic.PolicyError, "ratio=2"),
        (lambda: pic.policies.MEPIC(size=3), pic.PolicyError, "unknown field 'size'"),
    ],
)
def test_config_and_policy_errors_are_pic_errors(make, error, named):
    with pytest.raises(error, match=named) as caught:
        make()
    assert isinstance(caught.value, pic.PicError) and isinstance(caught.value, ValueError)


def test_config_accepts_what_it_documents():
    assert pic.PICConfig(eos_token_ids=[1, 2]).eos_token_ids == (1, 2)
    assert pic.policies.CacheBlend(ratio=1).ratio == 1.0  # an int where a float is expected is fine
    assert pic.policies.resolve("legolink:8") == pic.policies.LegoLink(k=8)  # spec strings are parsed


def test_kv_pool_larger_than_memory():
    named = r"kv_pool_tokens=1000000000000 \(62500000000 blocks .* needs 1.1 PiB but cpu has .* free"
    with pytest.raises(pic.InvalidInputError, match=named):
        make_engine("stories260K", kv_pool_tokens=10**12)


def test_gpt_neox_is_named_a_rope_model_with_another_layout():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(
        num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32, vocab_size=512
    )
    with pytest.raises(pic.UnsupportedModelError, match="'gpt_neox'.*is a RoPE model whose layer layout"):
        pic.PIC(GPTNeoXForCausalLM(config), tokenizer())


def test_nonsense_arguments_are_refused_with_the_value_named(engine):
    """Issue 21, items 7 and 9: each of these was accepted, ignored or a raw exception."""
    ids = engine.compile(list(DOCS))
    with pytest.raises(pic.InvalidInputError, match="no tokens"):
        pic.Request(ids, "")  # refused when built, as the README says
    with pytest.raises(pic.InvalidInputError, match=r"requests\[0\] is 'x'"):
        engine.generate_many(["x"])
    with pytest.raises(pic.InvalidInputError, match="request id 'x' is not an int"):
        engine.stepper().abort("x")
    with pytest.raises(pic.InvalidInputError, match="request id 'x' is not an int"):
        engine.abort("x")
    with pytest.raises(pic.InvalidInputError, match="cache id 123 is not a string"):
        engine.store.pin(123)
    with pytest.raises(pic.PolicyError, match="k given twice"):
        pic.policies.resolve("legolink:16,k=4")
    with pytest.raises(pic.InvalidInputError, match="add_generation_prompt is 'yes'"):
        engine.chat_segments([{"role": "user", "content": "hi"}], add_generation_prompt="yes")
    assert engine.kv_stats().num_used_blocks == 0 and sorted(engine.store.ids()) == sorted(ids)


@pytest.mark.parametrize(
    ("call", "named"),
    [
        (lambda e, ids: e.compile(["lone \ud800"]), "document 0 holds '\\\\ud800' at character 5"),
        (lambda e, ids: e.link(ids, "One \udfff day"), "query holds '\\\\udfff' at character 4"),
        (lambda e, ids: e.link(ids, "One day", prefix="\ud800"), "prefix holds '\\\\ud800' at character 0"),
        (
            lambda e, ids: e.link_chat(
                ids, [{"role": "system", "content": "ok"}, {"role": "user", "content": "a\ud800"}]
            ),
            "messages\\[1\\].content holds '\\\\ud800' at character 1",
        ),
    ],
    ids=["compile", "query", "prefix", "chat"],
)
def test_lone_surrogates_name_the_field(call, named):
    """Issue 21, item 1: text that is not valid Unicode was transformers' raw TypeError; now an
    ``InvalidInputError`` naming the field and the character, with every cached chunk kept."""
    from tests.test_chat import CHATML, chat_tokenizer

    engine = pic.PIC(model("stories260K"), chat_tokenizer(CHATML))
    ids = engine.compile(DOCS)
    with pytest.raises(pic.InvalidInputError, match=named):
        call(engine, ids)
    assert_store_intact(engine, ids)


def _string_calls(engine: pic.PIC, ids: list[str]) -> dict[str, object]:
    """Every call that takes a list of documents, cache ids or requests, each given one string instead."""
    from pic.vllm.client import link_prompt

    messages = [{"role": "user", "content": "Who had a ball?"}]
    return {
        "link": lambda: engine.link(ids[0], "One day,"),
        "link_chat cache_ids": lambda: engine.link_chat(ids[0], messages),
        "link_chat documents": lambda: engine.link_chat([], messages, documents="Tom had a red ball."),
        "Request": lambda: pic.Request(ids[0], "One day,"),
        "link_many": lambda: engine.link_many("requests"),
        "generate_many": lambda: engine.generate_many("requests"),
        "relevance": lambda: engine.link(ids, "One day,", relevance="12"),
        "vllm link_prompt": lambda: link_prompt("chunks", [5]),
    }


@pytest.mark.parametrize(
    ("call", "named"),
    [
        ("link", "cache_ids"),
        ("link_chat cache_ids", "cache_ids"),
        ("link_chat documents", "documents"),
        ("Request", "cache_ids"),
        ("link_many", "requests"),
        ("generate_many", "requests"),
        ("relevance", "relevance"),
        ("vllm link_prompt", "chunks"),
    ],
)
def test_a_string_where_a_list_is_expected_is_refused(call, named):
    """Issue 51, item 2: ``link_chat(ids, messages, documents="one string")`` compiled one document per
    character (35 chunks). Every parameter that takes a list refuses one string, naming itself and saying to pass
    a list; nothing is compiled or held."""
    from tests.test_chat import CHATML, chat_tokenizer

    engine = pic.PIC(model("stories260K"), chat_tokenizer(CHATML))
    ids = engine.compile(DOCS)
    with pytest.raises(
        pic.InvalidInputError, match=rf"^{named} is a string \(.*\), not a list: pass a list of .*\[.*\] for one\)"
    ):
        _string_calls(engine, ids)[call]()
    assert_store_intact(engine, ids)


def test_compile_still_takes_one_string_as_one_document(engine):
    """``compile("text")`` is one document, as documented (the one place a string stands for a list)."""
    assert engine.compile(DOCS[0]) == engine.compile([DOCS[0]]) and len(engine.compile(DOCS[0])) == 1


def test_what_repr_shows_are_attributes(engine):
    """Issue 51, item 7: ``repr(Linked)`` showed ``num_chunks`` and ``num_tokens``, which were no attributes
    (``linked.num_chunks`` raised AttributeError). Every ``name=value`` the reprs of ``Linked`` and ``Request``
    show is an attribute holding that value."""
    import re

    ids = engine.compile(DOCS)
    request = pic.Request(ids, "One day,", max_new_tokens=2)
    with engine.link(ids, "One day,", policy="naive") as linked:
        for obj in (linked, request):
            top = repr(obj).split(", sampling=")[0]  # Request's sampling: a SamplingParams, its own repr
            shown = dict(re.findall(r"(\w+)=('[^']*'|[\w.]+)", top))
            assert "num_chunks" in shown and len(shown) >= 3, repr(obj)
            assert (obj is linked) or repr(obj.sampling) in repr(obj)
            for name, value in shown.items():
                actual = getattr(obj, name)
                actual = getattr(actual, "spec", getattr(getattr(actual, "order", None), "value", actual))
                assert str(actual) == value.strip("'") or repr(actual) == value, (name, value, actual)
