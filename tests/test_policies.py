"""Policies: spec strings, recompute sets on hand-built layouts, CacheBlend against a reference
top-r computed from transformers' own V, and the limits where each policy is Full Recompute."""

from __future__ import annotations

import pytest
import torch

import pic
from pic.kv import ChunkKV
from pic.link import lay_out
from pic.policies import MEPIC, CacheBlend, FullRecompute, LegoLink, LegoLinkZero, Naive
from tests.conftest import make_engine
from tests.models import DOCS, PREFIX, QUERY, model

TOL = 1e-4


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("naive", Naive()),
        ("full", FullRecompute()),
        ("legolink:8", LegoLink(k=8)),
        ("legolink", LegoLink(k=16)),
        ("legolink0", LegoLinkZero(extra_bos=3)),
        ("legolink0:5", LegoLinkZero(extra_bos=5)),
        ("cacheblend:0.3", CacheBlend(ratio=0.3)),
        ("cacheblend:0.3,check_layer=2", CacheBlend(ratio=0.3, check_layer=2)),
        (" MEPIC ", MEPIC()),
    ],
)
def test_spec_strings(spec, expected):
    policy = pic.policies.resolve(spec)
    assert policy == expected
    assert pic.policies.resolve(policy.spec) == policy  # the spec round-trips


@pytest.mark.parametrize(
    "spec, named",
    [
        ("legolink:-1", "'legolink'.*k=-1.*greater than or equal to 0.*spec argument '-1'"),
        ("legolink:many", "'many'"),
        ("cacheblend:1.5", "ratio=1.5.*less than or equal to 1.*'1.5'"),
        ("cacheblend:0.1,layer=2", "layer"),
        ("cacheblend:0.1,0.2", "'0.2'"),
        ("mepic:3", "'mepic' does not take the argument '3'"),
    ],
)
def test_bad_spec_arguments(spec, named):
    with pytest.raises(pic.PolicyError, match=named):
        pic.policies.resolve(spec)


def _layout(chunk_lengths, *, num_prefix=0, num_query=3, block_size=8):
    chunks = [
        ChunkKV(f"c{i}", torch.arange(n) + 10, torch.empty(0), torch.empty(0), pic.CompileOptions())
        for i, n in enumerate(chunk_lengths)
    ]
    return lay_out(prefix=[3] * num_prefix, chunks=chunks, query=[4] * num_query, block_size=block_size)


def _indices(policy, layout) -> list[int]:
    return policy.recompute_mask(layout).nonzero().squeeze(1).tolist()


# Chunks of 5, 19 and 7 tokens in blocks of 8, then 3 query tokens. Without a prefix:
#   chunk 0: tokens 0..4,   slots 3..7   (3 padding)
#   chunk 1: tokens 5..23,  slots 13..31 (5 padding): its first block holds tokens 5, 6, 7
#   chunk 2: tokens 24..30, slots 33..39 (1 padding): its first block holds all 7 tokens
#   query:   tokens 31..33, slots 40..42
# With a 2-token prefix (tokens 0, 1 in slots 6, 7) everything shifts by 2 tokens and 8 slots, and
# chunk 0 no longer starts the prompt: its first block (slots 11..15) holds all its 5 tokens; the
# query is tokens 33..35.
_R = lambda a, b: list(range(a, b + 1))  # noqa: E731
HAND_BUILT = [
    (Naive(), 0, [31, 32, 33]),
    (FullRecompute(), 0, _R(0, 33)),
    (LegoLink(k=4), 0, [5, 6, 7, 8, 24, 25, 26, 27, 31, 32, 33]),
    (LegoLink(k=10), 0, _R(5, 14) + _R(24, 33)),
    (LegoLink(k=0), 0, [31, 32, 33]),
    (MEPIC(), 0, [5, 6, 7] + _R(24, 33)),
    (LegoLinkZero(), 0, [31, 32, 33]),
    (Naive(), 2, [0, 1, 33, 34, 35]),
    (LegoLink(k=4), 2, [0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 26, 27, 28, 29, 33, 34, 35]),
    (MEPIC(), 2, _R(0, 9) + _R(26, 35)),
]


@pytest.mark.parametrize("policy, num_prefix, expected", HAND_BUILT, ids=lambda v: str(v))
def test_recompute_sets_on_hand_built_layouts(policy, num_prefix, expected):
    layout = _layout([5, 19, 7], num_prefix=num_prefix)
    assert _indices(policy, layout) == expected


def test_legolink0_asks_for_extra_bos_at_compile_time():
    base = pic.CompileOptions()
    assert LegoLinkZero(extra_bos=2).compile_options(base) == pic.CompileOptions(num_extra_bos=2)
    assert LegoLink(k=4).compile_options(base) == base


def _link_logits(engine, policy, *, prefix="", order=(0, 1, 2)):
    ids = engine.compile(list(DOCS), policy=policy)
    with engine.link([ids[i] for i in order], QUERY, prefix=prefix, policy=policy) as linked:
        return linked.logits, linked


@pytest.mark.parametrize("prefix", ["", PREFIX])
def test_policies_at_their_limit_are_full_recompute(family, prefix):
    """Acceptance 1: CacheBlend with ratio 1, LegoLink with k >= every chunk, MEPIC with a block
    larger than every chunk all equal Full Recompute."""
    engine = make_engine(family, block_size=64)
    longest = max(c.num_tokens for c in (engine.store.get(i) for i in engine.compile(list(DOCS))))
    for order in [(0, 1, 2), (2, 0, 1)]:
        full, _ = _link_logits(engine, "full", prefix=prefix, order=order)
        for policy in (CacheBlend(ratio=1.0), LegoLink(k=longest), MEPIC()):
            logits, linked = _link_logits(engine, policy, prefix=prefix, order=order)
            first = linked.layout.chunks[0]
            exact = first.num_tokens if first.token_start == 0 and not policy.is_dynamic else 0  # left as cached
            assert linked.num_recomputed == linked.input_ids.shape[0] - exact, policy
            assert (logits - full).abs().max() <= TOL, (policy, order)


def test_cacheblend_selects_the_reference_top_r():
    """The tokens CacheBlend keeps after the check layer are the top-r chunk tokens by squared L2
    distance between transformers' own V of the whole prompt and the chunks' cached V."""
    family, ratio, check_layer = "llama", 0.25, 1
    engine = make_engine(family)
    ids = engine.compile(list(DOCS))
    linked = engine.link(ids[::-1], QUERY, prefix=PREFIX, policy=CacheBlend(ratio=ratio, check_layer=check_layer))
    layout = linked.layout
    with torch.no_grad():
        cache = model(family)(linked.input_ids[None], use_cache=True).past_key_values
    fresh_v = cache.layers[check_layer].values[0].transpose(0, 1)  # [T, Hkv, D]
    cached_v = torch.zeros_like(fresh_v)
    for seg in layout.chunks:
        cached_v[seg.tokens] = engine.store.get(seg.cache_id).v[check_layer]
    score = (fresh_v - cached_v).square().sum(dim=(1, 2)).masked_fill(~layout.cached, -1.0)
    num_chunk_tokens = int(layout.cached.sum())
    top = score.topk(round(ratio * num_chunk_tokens)).indices
    expected = ~layout.cached
    expected[top] = True
    assert torch.equal(linked.recomputed, expected)
    num_total, num_kept = linked.input_ids.shape[0], int(expected.sum())
    assert linked.recomputed_by_layer == (num_total, num_total) + (num_kept,) * (engine.spec.num_layers - 2)
    linked.release()


def test_cacheblend_check_layer_beyond_the_model(stories):
    ids = stories.compile(list(DOCS))
    with pytest.raises(pic.PolicyError, match="check_layer=5 but the model has 5 layers"):
        stories.link(ids, QUERY, policy="cacheblend:0.2,check_layer=5")


def test_legolink0_links_only_chunks_compiled_for_it(stories):
    plain = stories.compile(list(DOCS))
    with pytest.raises(pic.CompileOptionsMismatchError, match="legolink0:3.*compile it with"):
        stories.link(plain, QUERY, policy="legolink0")
    ids = stories.compile(list(DOCS), policy="legolink0")
    assert set(ids).isdisjoint(plain)
    assert all(stories.store.get(i).options.num_extra_bos == 3 for i in ids)
    with stories.link(ids, QUERY, prefix=PREFIX, policy="legolink0") as linked:
        layout = linked.layout
        assert linked.num_recomputed == layout.segments[0].num_tokens + layout.query.num_tokens
        assert not linked.recomputed[layout.cached].any()


class _DropAfter(pic.policies.Policy):
    """A dynamic policy: run every token through the first ``num_layers`` layers, then only what must run."""

    name = "test-drop-after"
    num_layers: int = 0

    def select(self, layout):
        return torch.ones(layout.num_tokens, dtype=torch.bool)

    def after_layer(self, step):
        return torch.full((step.num_tokens,), step.layer + 1 < self.num_layers)


def test_dynamic_policy_hook(stories):
    ids = stories.compile(list(DOCS))
    full, _ = _link_logits(stories, "full", prefix=PREFIX)
    assert _DropAfter().is_dynamic and not LegoLink().is_dynamic
    logits, kept_all = _link_logits(stories, _DropAfter(num_layers=stories.spec.num_layers), prefix=PREFIX)
    assert (logits - full).abs().max() <= TOL
    with stories.link(ids, QUERY, prefix=PREFIX, policy=_DropAfter(num_layers=1)) as linked:
        num_uncached = int((~linked.layout.cached).sum())  # prefix and query are never dropped
        assert linked.recomputed_by_layer == (linked.input_ids.shape[0],) + (num_uncached,) * 4
        assert torch.equal(linked.recomputed, ~linked.layout.cached)
        assert (linked.logits - full).abs().max() > 1e-3  # the dropped tokens' cached KV is used


def test_malformed_dynamic_selection(stories):
    class Sloppy(_DropAfter):
        name = "test-sloppy-hook"

        def after_layer(self, step):
            return torch.ones(step.num_tokens + 1, dtype=torch.bool)

    ids = stories.compile(list(DOCS))
    with pytest.raises(pic.PolicyError, match=r"'test-sloppy-hook:0'.*after_layer\(\) must return a bool tensor"):
        stories.link(ids, QUERY, policy=Sloppy())
    assert stories.kv_stats().num_available_blocks == stories.kv_stats().num_blocks


@pytest.mark.parametrize("num_ids", [7, 15, 16, 31, 32, 33, 100])
def test_chunk_sizes_at_which_head_policies_start_reusing(num_ids):
    """Issue 21, item 11, as the policies' docs state it: behind a prefix, a chunk of L tokens (its BOS
    included) reuses ``L - ((L - 1) % 16 + 1)`` under mepic (nothing up to one 16-token block) and
    ``max(0, L - 16)`` under legolink:16; naive reuses all of it."""
    engine = make_engine("stories260K")
    docs = [[(7 * i) % 400 + 5 for i in range(num_ids)], [(11 * i) % 400 + 5 for i in range(num_ids)]]
    ids = engine.compile(docs)
    length = num_ids + 1  # the chunk's BOS
    expected = {"mepic": length - ((length - 1) % 16 + 1), "legolink:16": max(0, length - 16), "naive": length}
    for policy, per_chunk in expected.items():
        stats = engine.link(ids, QUERY, prefix=PREFIX, policy=policy).generate(max_new_tokens=1).stats
        assert stats.num_reused_tokens == 2 * per_chunk, (policy, stats)
