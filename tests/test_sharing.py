"""Chunk blocks shared between live requests: one physical copy of every clean chunk block, private
copies of the blocks a request writes, identical outputs however the blocks are shared, nothing read
from slots a request did not write (NaN-poisoned), eviction and promotion, pinning under pressure."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

import pic
from tests.conftest import make_engine
from tests.kv_invariants import check_engine_pool
from tests.models import DOCS, PREFIX, QUERY, model, tokenizer

NUM_NEW = 12
TOL = 1e-5
STATIC = ["mepic", "legolink:16", "naive", "full"]
OTHER_QUERY = "The cat and the ball were"
POOL_TOKENS = 1024  # 64 blocks of 16: room for several requests, small enough to poison quickly


def engine_for(family: str, **config) -> pic.PIC:
    return make_engine(family, kv_pool_tokens=POOL_TOKENS, **config)


def link_first(engine: pic.PIC, ids: list[str], policy: str) -> pic.Linked:
    """Every chunk, a prefix and the query."""
    return engine.link(ids, QUERY, prefix=PREFIX, policy=policy)


def link_second(engine: pic.PIC, ids: list[str], policy: str) -> pic.Linked:
    """The same chunks in another order, no prefix, another query: other recomputed tokens."""
    return engine.link([ids[2], ids[0], ids[1]], OTHER_QUERY, policy=policy)


def chunk_blocks(linked: pic.Linked) -> dict[int, tuple[str, int]]:
    """Request block index -> (cache id, index among the chunk's canonical blocks), from the layout."""
    bs = linked.layout.block_size
    blocks = {}
    for seg in linked.layout.chunks:
        start = seg.slot_start - seg.num_padding
        assert start % bs == 0 and (seg.num_padding + seg.num_tokens) % bs == 0 and seg.num_padding < bs
        for j in range((seg.num_padding + seg.num_tokens) // bs):
            blocks[start // bs + j] = (seg.cache_id, j)
    return blocks


def dirty_blocks(linked: pic.Linked) -> set[int]:
    """Request blocks holding a recomputed chunk token (a static policy recomputes them in every layer)."""
    layout = linked.layout
    return set((layout.slots[linked.recomputed & layout.cached] // layout.block_size).tolist())


def canonical(engine: pic.PIC) -> dict[str, list[int]]:
    with engine.paused() as core:
        return {cid: chunk.block_ids for cid, chunk in core.pool.chunks.items()}


def assert_at_rest(engine: pic.PIC, num_chunks: int = len(DOCS)) -> None:
    """No live request: no private block, no shared reference; the chunks resident and evictable."""
    stats = engine.kv_stats()
    assert stats.num_private_blocks == 0 and stats.num_shared_block_refs == 0 and stats.num_used_blocks == 0
    assert stats.num_resident_chunks == num_chunks
    assert stats.num_evictable_blocks == stats.num_resident_chunk_blocks == sum(map(len, canonical(engine).values()))
    assert stats.num_available_blocks == stats.num_blocks
    check_engine_pool(engine, {})


def live_refs(*requests: pic.Linked) -> dict[int, int]:
    return dict(Counter(b for r in requests for b in r.block_ids))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


@pytest.mark.parametrize("policy", STATIC)
def test_live_requests_map_clean_chunk_blocks_to_one_copy(family, policy):
    engine = engine_for(family)
    ids = engine.compile(list(DOCS))
    chunk_of = canonical(engine)
    all_canonical = {b for blocks in chunk_of.values() for b in blocks}
    requests = [link_first(engine, ids, policy), link_first(engine, ids, policy), link_second(engine, ids, policy)]
    assert canonical(engine) == chunk_of  # linking resident chunks moves nothing

    private: list[int] = []
    for linked in requests:
        table, chunks, dirty = linked.block_ids, chunk_blocks(linked), dirty_blocks(linked)
        bs = linked.layout.block_size
        assert len(table) == -(-linked.layout.num_slots // bs) and len(chunks) == sum(map(len, chunk_of.values()))
        clean = [i for i in chunks if i not in dirty]
        for i, block in enumerate(table):
            if i in chunks and i not in dirty:  # mapped as it is: the chunk's canonical block
                cid, j = chunks[i]
                assert block == chunk_of[cid][j], (i, block, cid, j)
            else:  # prefix, query, or a chunk block holding a recomputed token: the request's own
                assert block not in all_canonical, (i, block)
                private.append(block)
        assert linked.num_shared_blocks == len(clean) and linked.num_private_blocks == len(table) - len(clean)
        if policy == "naive":
            assert len(clean) == len(chunks)
        elif policy == "full":
            assert not clean
        else:
            assert 0 < len(clean) < len(chunks)  # some blocks of each kind
    assert len(private) == len(set(private)), "two requests (or two table entries) share a private block"

    stats = engine.kv_stats()
    assert stats.num_shared_block_refs == sum(r.num_shared_blocks for r in requests)
    assert stats.num_private_blocks == sum(r.num_private_blocks for r in requests) == len(private)
    check_engine_pool(engine, live_refs(*requests))
    for linked in requests:
        linked.release()
    assert_at_rest(engine)


def reference(engine: pic.PIC, ids: list[str], policy: str, link) -> tuple[torch.Tensor, list[int], pic.Linked]:
    linked = link(engine, ids, policy)
    logits = linked.logits.clone()
    return logits, linked.generate(max_new_tokens=NUM_NEW).token_ids, linked


@pytest.mark.parametrize("policy", [*STATIC, "cacheblend:0.15"])
@pytest.mark.parametrize("family", ["stories260K", "qwen2", "mistral"])
def test_outputs_are_the_same_alone_shared_and_private(family, policy):
    engine = engine_for(family)
    ids = engine.compile(list(DOCS))
    chunk_of = canonical(engine)
    all_canonical = {b for blocks in chunk_of.values() for b in blocks}
    alone = [reference(engine, ids, policy, link) for link in (link_first, link_second)]
    # Streamed text is compared with streamed text: a random model's byte tokens can decode differently
    # as a whole than piece by piece (the tokenizer's byte fallback), whatever the blocks.
    alone_texts = [
        "".join(link(engine, ids, policy).stream(max_new_tokens=NUM_NEW)) for link in (link_first, link_second)
    ]
    assert_at_rest(engine)

    # Shared: both live at once, decoding interleaved token by token.
    first, second = link_first(engine, ids, policy), link_second(engine, ids, policy)
    if policy.startswith("cacheblend"):  # a dynamic policy writes every chunk token in its early layers
        assert first.num_shared_blocks == second.num_shared_blocks == 0
        assert not set(first.block_ids + second.block_ids) & all_canonical
    elif policy != "full":
        assert set(first.block_ids) & set(second.block_ids) & all_canonical  # they do share blocks
    for linked, (logits, _, _) in zip((first, second), alone, strict=True):
        assert max_diff(linked.logits, logits) <= TOL
    streams = [first.stream(max_new_tokens=NUM_NEW), second.stream(max_new_tokens=NUM_NEW)]
    texts = ["", ""]
    while streams[0] or streams[1]:
        for k, stream in enumerate(streams):
            piece = next(stream, None) if stream else None
            if piece is None:
                streams[k] = None
            else:
                texts[k] += piece
    assert texts == alone_texts
    assert_at_rest(engine)

    # Both live again, generating one after the other: the same tokens.
    first, second = link_first(engine, ids, policy), link_second(engine, ids, policy)
    assert second.generate(max_new_tokens=NUM_NEW).token_ids == alone[1][1]
    assert first.generate(max_new_tokens=NUM_NEW).token_ids == alone[0][1]
    assert_at_rest(engine)

    # Private mode: every request its own copy of every chunk block, the same outputs.
    private = engine_for(family, share_chunk_blocks=False)
    assert private.compile(list(DOCS)) == ids
    private_canonical = {b for blocks in canonical(private).values() for b in blocks}
    requests = [link_first(private, ids, policy), link_second(private, ids, policy)]
    for linked, (logits, _, shared) in zip(requests, alone, strict=True):
        assert linked.num_shared_blocks == 0 and not set(linked.block_ids) & private_canonical
        assert (
            linked.num_private_blocks
            == len(linked.block_ids)
            == -(-linked.layout.num_slots // linked.layout.block_size)
        )
        assert torch.equal(linked.recomputed, shared.recomputed)
        assert max_diff(linked.logits, logits) <= TOL
    check_engine_pool(private, live_refs(*requests))
    assert [r.generate(max_new_tokens=NUM_NEW).token_ids for r in requests] == [t for _, t, _ in alone]
    assert_at_rest(private)


def poison(engine: pic.PIC, blocks) -> None:
    """NaN in every slot of ``blocks``, K and V, every layer."""
    index = torch.tensor(sorted(blocks), dtype=torch.long)
    with engine.paused() as core:
        core.cache.k[:, index] = float("nan")
        core.cache.v[:, index] = float("nan")


def non_chunk_blocks(engine: pic.PIC) -> set[int]:
    in_chunks = {b for blocks in canonical(engine).values() for b in blocks}
    return set(range(engine.kv_stats().num_blocks)) - in_chunks


WHOLE = "suffix:0.05,whole=true"  # the last document recomputed whole: its blocks rewritten, not copied


@pytest.mark.parametrize("policy", ["mepic", "cacheblend:0.15", "naive", "full", WHOLE])
@pytest.mark.parametrize("family", ["stories260K", "mistral"])
def test_nan_in_free_blocks_never_reaches_the_outputs(family, policy):
    clean = engine_for(family)  # another engine, never poisoned
    clean_ids = clean.compile(list(DOCS))
    expected_logits, expected_tokens, _ = reference(clean, clean_ids, policy, link_first)
    assert torch.isfinite(expected_logits).all()

    engine = engine_for(family)
    ids = engine.compile(list(DOCS))
    logits, tokens, _ = reference(engine, ids, policy, link_first)  # its blocks are freed with stale KV
    assert max_diff(logits, expected_logits) <= TOL and tokens == expected_tokens

    for shared_with in (None, link_second):  # alone, then beside another live request
        poisoned = non_chunk_blocks(engine)  # stale and never-used blocks alike
        poison(engine, poisoned)
        other = shared_with(engine, ids, policy) if shared_with else None
        linked = link_first(engine, ids, policy)
        own = [b for b in linked.block_ids if b in poisoned]
        assert own and len(own) == linked.num_private_blocks  # its private blocks are poisoned ones
        assert torch.isfinite(linked.logits).all() and max_diff(linked.logits, expected_logits) <= TOL
        assert linked.generate(max_new_tokens=NUM_NEW).token_ids == expected_tokens  # decode blocks too
        if other is not None:
            other.release()
    assert_at_rest(engine)


@pytest.mark.parametrize("policy", [WHOLE, "suffix:0.3"])
def test_a_block_recomputed_whole_takes_no_copy(family, policy):
    """A static policy's pass writes every token it selects in every layer before anything reads the slot: a
    dirty block all of whose chunk tokens it recomputes is private but takes no copy of the canonical KV (the
    outputs with free blocks poisoned: the test above); a block recomputed in part is copied."""
    engine = engine_for(family)
    ids = engine.compile(list(DOCS))
    copied: list[int] = []
    with engine.paused() as core:
        copy = core.cache.copy_blocks
        core.cache.copy_blocks = lambda src, dst: (copied.extend(src), copy(src, dst))[1]
    linked = link_first(engine, ids, policy)
    layout, bs = linked.layout, linked.layout.block_size
    cached = layout.slots[layout.cached] // bs
    recomputed = layout.slots[linked.recomputed & layout.cached] // bs
    tokens, rewritten = Counter(cached.tolist()), Counter(recomputed.tolist())
    whole = {b for b, n in rewritten.items() if n == tokens[b]}
    partial = dirty_blocks(linked) - whole
    assert whole if policy == WHOLE else partial  # (each case has the kind it tests)
    assert sorted(copied) == sorted(c for b, c in enumerate(canonical_of(linked, engine)) if b in partial)
    linked.release()
    assert_at_rest(engine)


def canonical_of(linked: pic.Linked, engine: pic.PIC) -> list[int]:
    """Each request block's canonical block (-1: not a chunk block)."""
    blocks, chunks = chunk_blocks(linked), canonical(engine)
    num = max(blocks) + 1
    return [chunks[blocks[b][0]][blocks[b][1]] if b in blocks else -1 for b in range(num)]


def test_nan_in_the_padding_of_canonical_blocks_is_never_read(family):
    engine = engine_for(family)
    ids = engine.compile(list(DOCS))
    policies = ["mepic", "legolink:16", "naive", "full", "cacheblend:0.15"]
    expected = [reference(engine, ids, policy, link)[:2] for policy in policies for link in (link_first, link_second)]
    bs = engine.config.block_size
    num_padded = 0
    with engine.paused() as core:
        for chunk in core.pool.chunks.values():
            padding = len(chunk.block_ids) * bs - chunk.info.num_tokens
            core.cache.k[:, chunk.block_ids[0], :padding] = float("nan")  # front padding
            core.cache.v[:, chunk.block_ids[0], :padding] = float("nan")
            num_padded += padding > 0
    assert num_padded == len(DOCS)
    cases = itertools.product(policies, (link_first, link_second))
    for (policy, link), (logits, tokens) in zip(cases, expected, strict=True):
        linked = link(engine, ids, policy)
        assert torch.isfinite(linked.logits).all() and max_diff(linked.logits, logits) <= TOL, policy
        assert linked.generate(max_new_tokens=NUM_NEW).token_ids == tokens, policy
    assert_at_rest(engine)


SMALL_POOL = 16  # blocks of 16 tokens; DOCS compile into 2 + 3 + 1 blocks


def small_engine(**store) -> pic.PIC:
    config = pic.PICConfig(kv_pool_tokens=SMALL_POOL * 16, block_size=16)
    return pic.PIC(model("stories260K"), tokenizer(), config=config, store=pic.StoreConfig(**store))


def long_query(num_blocks: int) -> list[int]:
    """Query token ids that, after the BOS ``link`` adds, fill exactly ``num_blocks`` blocks."""
    return [3 + i % 500 for i in range(num_blocks * 16 - 1)]


def evict_everything(engine: pic.PIC) -> None:
    with engine.link([], long_query(SMALL_POOL), policy="full") as linked:
        assert len(linked.block_ids) == SMALL_POOL
    stats = engine.kv_stats()
    assert stats.num_resident_chunks == 0 and stats.num_evicted_chunks == len(DOCS) and stats.num_used_blocks == 0


def test_an_evicted_chunk_comes_back_from_the_cpu_tier():
    engine = small_engine(cpu_bytes=None)
    ids = engine.compile(list(DOCS))
    assert [engine.store.lookup(cid) for cid in ids] == [("device", "cpu")] * len(ids)
    expected = [reference(engine, ids, "mepic", link)[:2] for link in (link_first, link_second)]
    old = canonical(engine)
    evict_everything(engine)
    assert [engine.store.lookup(cid) for cid in ids] == [("cpu",)] * len(ids)
    poison(engine, range(SMALL_POOL))  # promotion must write every slot it reads

    first = link_first(engine, ids, "mepic")  # promoted into fresh canonical blocks
    new = canonical(engine)
    assert set(new) == set(ids) and [engine.store.lookup(cid) for cid in ids] == [("device", "cpu")] * len(ids)
    assert all(len(new[cid]) == len(old[cid]) for cid in ids)
    second = link_second(engine, ids, "mepic")  # resident now: mapped, not promoted again
    assert canonical(engine) == new
    for linked in (first, second):
        chunks, dirty = chunk_blocks(linked), dirty_blocks(linked)
        assert all(linked.block_ids[i] == new[cid][j] for i, (cid, j) in chunks.items() if i not in dirty)
    check_engine_pool(engine, live_refs(first, second))
    for linked, (logits, tokens) in zip((first, second), expected, strict=True):
        assert torch.isfinite(linked.logits).all() and max_diff(linked.logits, logits) <= TOL
        assert linked.generate(max_new_tokens=NUM_NEW).token_ids == tokens
    assert_at_rest(engine)


def test_an_evicted_chunk_without_a_lower_tier_is_compiled_again():
    engine = small_engine()
    ids = engine.compile(list(DOCS))
    logits, tokens, _ = reference(engine, ids, "mepic", link_first)
    evict_everything(engine)
    assert not set(canonical(engine)) & set(ids)  # no tier holds them: the engine has their tokens
    linked = link_first(engine, ids, "mepic")  # compiles them again, then links
    assert set(canonical(engine)) == set(ids)
    assert max_diff(linked.logits, logits) <= TOL
    assert linked.generate(max_new_tokens=NUM_NEW).token_ids == tokens
    assert_at_rest(engine)


def test_a_pinned_chunk_survives_pool_pressure():
    engine = small_engine()
    ids = engine.compile(list(DOCS))
    sizes = {cid: len(blocks) for cid, blocks in canonical(engine).items()}
    pinned = ids[1]
    logits, tokens, _ = reference(engine, [pinned], "mepic", lambda e, i, p: e.link(i, QUERY, policy=p))
    engine.store.pin(pinned)
    assert engine.kv_stats().num_used_blocks == sizes[pinned]
    room = SMALL_POOL - sizes[pinned]

    with engine.link([], long_query(room), policy="naive") as big:  # every block but the pinned chunk's
        assert set(canonical(engine)) == {pinned} and engine.kv_stats().num_evicted_chunks == 2
        before = engine.kv_stats()
        assert before.num_available_blocks == 0
        with pytest.raises(pic.KVPoolExhaustedError, match=r"needs \d+ blocks of 16 tokens but 0 of 16"):
            engine.link([pinned], QUERY, policy="mepic")  # its own chunk is there, but no private block
        assert engine.kv_stats() == before
        check_engine_pool(engine, live_refs(big))
    before = engine.kv_stats()
    with pytest.raises(pic.KVPoolExhaustedError, match=f"needs {room + 1} blocks of 16 tokens but {room} of 16"):
        engine.link([], long_query(room + 1), policy="naive")
    assert engine.kv_stats() == before and engine.store.lookup(pinned) == ("device",)
    check_engine_pool(engine, {})

    linked = engine.link([pinned], QUERY, policy="mepic")  # the pinned chunk still serves links
    num_chunk_blocks = len(canonical(engine)[pinned])  # it starts the prompt: nothing recomputed
    assert linked.num_shared_blocks == num_chunk_blocks and max_diff(linked.logits, logits) <= TOL
    assert linked.generate(max_new_tokens=NUM_NEW).token_ids == tokens

    engine.store.unpin(pinned)
    with engine.link([], long_query(room + 1), policy="naive"):  # now it is evicted like any other
        assert not canonical(engine) and engine.store.lookup(pinned) == ()
    check_engine_pool(engine, {})


@pytest.mark.parametrize("policy", ["naive", "legolink0", "cacheblend:0.15"])
def test_a_chunk_linked_twice_in_one_prompt(policy):
    shared, private = engine_for("stories260K"), engine_for("stories260K", share_chunk_blocks=False)
    ids = shared.compile(list(DOCS), policy=policy)
    assert private.compile(list(DOCS), policy=policy) == ids
    cids = [ids[0], ids[1], ids[0]]
    linked, expected = shared.link(cids, QUERY, policy=policy), private.link(cids, QUERY, policy=policy)
    refs = live_refs(linked)
    if policy == "naive":  # both copies of the chunk map its canonical blocks: two references each
        assert all(refs[b] == 2 for b in canonical(shared)[ids[0]])
    check_engine_pool(shared, refs)
    assert max_diff(linked.logits, expected.logits) <= TOL
    assert linked.generate(max_new_tokens=NUM_NEW).token_ids == expected.generate(max_new_tokens=NUM_NEW).token_ids
    assert_at_rest(shared)


def test_expiring_a_chunk_in_use_leaves_its_blocks_to_the_live_request():
    engine = engine_for("stories260K")
    ids = engine.compile(list(DOCS))
    logits, tokens, _ = reference(engine, ids, "naive", link_first)
    live = link_first(engine, ids, "naive")  # maps every chunk block
    old = canonical(engine)[ids[1]]
    assert engine.store.expire(ids[1]) and ids[1] not in canonical(engine)
    check_engine_pool(engine, live_refs(live))
    assert engine.kv_stats().num_private_blocks == live.num_private_blocks + len(old)  # the request's alone now
    with pytest.raises(pic.UnknownCacheIdError):
        link_first(engine, ids, "naive")
    assert engine.compile(list(DOCS)) == ids
    assert not set(canonical(engine)[ids[1]]) & set(old)  # compiled again into other blocks
    again = link_first(engine, ids, "naive")
    check_engine_pool(engine, live_refs(live, again))
    for linked in (live, again):
        assert max_diff(linked.logits, logits) <= TOL
        assert linked.generate(max_new_tokens=NUM_NEW).token_ids == tokens
    assert_at_rest(engine)
