"""Sampling, stop strings, EOS, context limit, streaming, and the request's lifetime."""

from __future__ import annotations

import gc
import time

import pytest
import torch

import pic
from tests.conftest import make_engine

DOCS = ["Tom had a big red ball. He liked to kick it.", "Lily loved to sing every morning."]
QUERY = "One day, Tom and Lily"


@pytest.fixture
def engine() -> pic.PIC:
    return make_engine("stories260K")


def fresh(engine: pic.PIC, **kw) -> pic.Linked:
    return engine.link(engine.compile(DOCS), QUERY, **kw)


def test_stream_pieces_make_the_generated_text(engine):
    out = fresh(engine).generate(max_new_tokens=40)
    pieces = list(fresh(engine).stream(max_new_tokens=40))
    assert len(pieces) > 5 and "".join(pieces) == out.text
    assert out.text == engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert out.stats.finish_reason is pic.FinishReason.LENGTH and len(out.token_ids) == 40


def test_seeded_sampling_is_reproducible(engine):
    runs = [fresh(engine).generate(max_new_tokens=24, temperature=1.0, seed=s).token_ids for s in (7, 7, 8)]
    assert runs[0] == runs[1] != runs[2]


def test_top_k_1_and_tiny_top_p_are_greedy(engine):
    greedy = fresh(engine).generate(max_new_tokens=24).token_ids
    assert fresh(engine).generate(max_new_tokens=24, temperature=1.5, top_k=1, seed=0).token_ids == greedy
    assert fresh(engine).generate(max_new_tokens=24, temperature=1.5, top_p=1e-6, seed=0).token_ids == greedy


@pytest.mark.parametrize(
    "options",
    [{"temperature": 5e-324}, {"temperature": 1e-45}, {"temperature": 1e-38, "seed": 3},
     {"temperature": 0.8, "top_p": 1e-300, "top_k": 1}, {"temperature": 1.0, "top_p": 5e-324}],
)  # fmt: skip
def test_a_vanishing_temperature_or_top_p_is_greedy_not_token_0(engine, options):
    """Issue 33: logits divided by 5e-324 overflow to inf (a NaN softmax), and float32 rounds a top_p of
    1e-300 to 0: both sampled token id 0 at every step. They mean greedy."""
    greedy = fresh(engine).generate(max_new_tokens=12).token_ids
    assert set(greedy) != {0}
    assert fresh(engine).generate(max_new_tokens=12, **options).token_ids == greedy
    assert pic.SamplingParams(**options).temperature == 0.0


def test_stop_string(engine):
    text = fresh(engine).generate(max_new_tokens=40).text
    stop = text[10:14]
    out = fresh(engine).generate(max_new_tokens=40, stop=[stop, "never appears"])
    assert out.text == text[: text.index(stop)]
    assert out.stats.finish_reason is pic.FinishReason.STOP
    assert "".join(fresh(engine).stream(max_new_tokens=40, stop=stop)) == out.text


def test_eos_ends_generation():
    first = fresh(make_engine("stories260K")).generate(max_new_tokens=3).token_ids[0]
    out = fresh(make_engine("stories260K", eos_token_ids=(first,))).generate(max_new_tokens=10)
    assert out.token_ids == [first] and out.text == ""
    assert out.stats.finish_reason is pic.FinishReason.EOS


def test_generation_stops_at_the_context(engine):
    ids = engine.compile("The dog ran to the park and played with a ball all day long.")
    linked = engine.link(ids * 20, QUERY, policy="naive")
    assert linked.input_ids.shape[0] > 450
    room = engine.spec.max_context - linked.input_ids.shape[0]
    out = linked.generate(max_new_tokens=room + 50)
    assert len(out.token_ids) == room and out.stats.finish_reason is pic.FinishReason.CONTEXT


def test_stats(engine):
    start = time.perf_counter()
    linked = fresh(engine, policy="naive")
    linked_at = time.perf_counter()
    out = linked.generate(max_new_tokens=8)
    end = time.perf_counter()
    s = out.stats
    assert s.num_prompt_tokens == linked.input_ids.shape[0] == s.num_recomputed_tokens + s.num_reused_tokens
    assert (
        s.num_recomputed_tokens
        == linked.num_recomputed
        == len(engine.tokenizer(QUERY, add_special_tokens=False).input_ids)
    )
    # each timing lies inside the wall-clock interval of what it measures
    assert s.link_s <= linked_at - start and s.link_s + s.decode_s <= end - start
    assert s.link_s <= s.ttft_s == out.ttft_s <= s.link_s + (end - linked_at)
    assert s.num_generated_tokens == 8


def test_blocks_are_returned(engine):
    free = engine.kv_stats().num_available_blocks
    fresh(engine).generate(max_new_tokens=40)  # decoding appended blocks; all are freed
    assert engine.kv_stats().num_available_blocks == free
    with fresh(engine) as linked:
        assert engine.kv_stats().num_available_blocks < free
    assert engine.kv_stats().num_available_blocks == free
    linked = fresh(engine)
    del linked
    gc.collect()
    assert engine.kv_stats().num_available_blocks == free
    stream = fresh(engine).stream(max_new_tokens=40)
    next(stream)
    stream.close()  # abandoning a stream releases the request too
    assert engine.kv_stats().num_available_blocks == free


def test_kv_pool_exhausted_mid_generation_keeps_the_tokens():
    """Running out of blocks while decoding ends the generation with what it has, and says why. Naive copies
    no chunk block, so the free slots after the prompt are the free blocks and the rest of the query's block."""
    engine = make_engine("stories260K", kv_pool_tokens=96, block_size=16, default_policy="naive")
    with fresh(engine) as probe:
        room = engine.kv_stats().num_available_blocks * 16 + len(probe.block_ids) * 16 - probe.layout.num_slots
    reference = fresh(make_engine("stories260K", default_policy="naive")).generate(max_new_tokens=room + 1).token_ids
    out = fresh(engine).generate(max_new_tokens=100)
    assert out.stats.finish_reason is pic.FinishReason.KV_POOL
    assert out.token_ids == reference and len(out.token_ids) == room + 1  # the last one needed no slot
    assert out.text == engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert "".join(fresh(engine).stream(max_new_tokens=100)) == out.text  # the stream ends cleanly
    assert engine.kv_stats().num_available_blocks == engine.kv_stats().num_blocks


def test_the_embedded_model_stops_at_the_end_of_a_story(stories):
    """stories260K ends a story with BOS (id 1): its generation config lists it as an EOS token, so pic
    and transformers' own generate both stop there."""
    assert stories.eos_token_ids == {1, 2}
    linked = stories.link([], "Once upon a time", policy="full")
    out = linked.generate(max_new_tokens=400)
    assert out.stats.finish_reason is pic.FinishReason.EOS and out.token_ids[-1] == 1
    assert len(out.token_ids) < 400 and "Once upon a time" not in out.text  # no second story
    with torch.no_grad():
        hf = stories.model.generate(linked.input_ids[None], max_new_tokens=400, do_sample=False)
    assert hf[0, linked.input_ids.shape[0] :].tolist() == out.token_ids


def test_generate_together_is_each_alone(engine):
    """Linked requests decoded together (batched steps) get what each gets alone, sampling included."""
    from pic.engine import generate_together

    ids = engine.compile(DOCS)
    links = [
        lambda: engine.link(ids, QUERY, policy="full"),
        lambda: engine.link(ids[::-1], QUERY, policy="naive"),
        lambda: engine.link(ids, "Lily", policy="legolink:4"),
    ]
    for options in ({}, {"temperature": 0.9, "seed": 3}):
        alone = [link().generate(20, **options).token_ids for link in links]
        core = engine.stepper()
        steps_before = core.num_steps
        together = generate_together([link() for link in links], 20, **options)
        assert [g.token_ids for g in together] == alone
        assert core.num_steps - steps_before < sum(len(t) for t in alone) / 2  # shared decode steps
    assert generate_together([]) == []


def test_generate_together_refuses_before_starting_any(engine):
    from pic.engine import generate_together

    ids = engine.compile(DOCS)
    used, unused = engine.link(ids, QUERY), engine.link(ids, QUERY)
    used.generate(4)
    with pytest.raises(pic.LinkedReleasedError, match="already generated from or released"):
        generate_together([unused, used], 4)
    with pytest.raises(pic.InvalidInputError, match="temperature"):
        generate_together([unused], 4, temperature=-1.0)
    assert len(generate_together([unused], 4)[0].token_ids) == 4  # neither failure started it
    other = make_engine("stories260K")
    with pytest.raises(pic.InvalidInputError, match="one engine, got requests of 2"):
        generate_together([engine.link(ids, QUERY), other.link(other.compile(DOCS), QUERY)], 4)


def test_seeds_do_not_alias_every_2_to_the_32(engine):
    """Issue 21, item 10: the CPU generator keeps 32 bits of a seed; seeds 5, 5 + 2**32 and 5 + 2**40 once
    gave the same text. Each seed still gives the same text every time."""
    ids = engine.compile(list(DOCS))

    def text(seed: int) -> list[int]:
        return engine.link(ids, QUERY).generate(24, temperature=1.0, seed=seed).token_ids

    got = [text(s) for s in (5, 5 + 2**32, 5 + 2**40, 2**64 - 1)]
    assert len({tuple(t) for t in got}) == 4
    assert text(5 + 2**40) == got[2] and text(2**64 - 1) == got[3]
