"""``regions``: lexical ranking (BM25 over token ids), the windows it takes and in which order, the budget, a
retriever's relevance through ``link`` and over the engine, and the probe-ranked variant."""

from __future__ import annotations

import math

import pytest
import torch

import pic
from pic.kv import ChunkKV
from pic.link import lay_out
from pic.link.order import bm25
from pic.policies import Regions
from tests.models import DOCS, PREFIX, QUERY


def _chunks(chunks: list[list[int]]) -> list[ChunkKV]:
    empty = torch.empty(0)
    return [ChunkKV(f"c{i}", torch.tensor(ids), empty, empty, pic.CompileOptions()) for i, ids in enumerate(chunks)]


def _layout(chunks: list[list[int]], query: list[int], *, relevance=None, **options):
    return lay_out(prefix=[7, 7], chunks=_chunks(chunks), query=query, block_size=4, relevance=relevance, **options)


def test_bm25_by_hand():
    units = [[1, 2, 2, 3], [4, 5], [2, 6, 6, 6]]
    scores = bm25([2, 6, 9], units)
    mean_len = 10 / 3

    def term(n_docs_with: int, count: int, length: int) -> float:
        idf = math.log(1 + (3 - n_docs_with + 0.5) / (n_docs_with + 0.5))
        return idf * count * 2.2 / (count + 1.2 * (0.25 + 0.75 * length / mean_len))

    assert scores[0] == pytest.approx(term(2, 2, 4))
    assert scores[1] == 0.0
    assert scores[2] == pytest.approx(term(2, 1, 4) + term(1, 3, 4))


def test_regions_takes_the_best_window_of_the_best_chunk_then_the_rest_of_it():
    # Three chunks of 12 tokens; the query shares tokens 50 and 51 with chunk 1, in its second window.
    chunks = [list(range(10, 22)), [30, 31, 32, 33, 50, 51, 34, 35, 36, 37, 38, 39], list(range(60, 72))]
    layout = _layout(chunks, [50, 51, 90])
    starts = [seg.token_start for seg in layout.chunks]  # 2, 14, 26
    chosen = Regions(budget=0.25, window=4, heads=0).select(layout)  # 9 of 36 chunk tokens
    expected = torch.zeros(layout.num_tokens, dtype=torch.bool)
    expected[starts[1] + 4 : starts[1] + 12] = True  # its best window (offsets 4-7), then the one after it
    expected[starts[1]] = True  # and the 9th token: the window before, in part (no query token: from its start)
    assert torch.equal(chosen, expected)
    more = Regions(budget=0.5, window=4, heads=0).select(layout)  # 18: then the window before it, then chunk 0
    expected[starts[1] : starts[1] + 4] = True
    expected[starts[0] : starts[0] + 6] = True  # chunk 0 shares nothing: its first window (ties go first), then 2
    assert torch.equal(more, expected)
    # A window the budget ends in is taken from its first token the query has.
    tail = _layout([list(range(10, 22)), [30, 31, 32, 33, 34, 35, 50, 51, 36, 37, 38, 39]], [50, 51])
    part = Regions(budget=0.125, window=8, heads=0).select(tail)  # 3 tokens of an 8-token window
    assert part.nonzero().flatten().tolist() == [tail.chunks[1].token_start + o for o in (6, 7, 8)]


def test_regions_budget_heads_and_limits():
    chunks = [list(range(10, 23)), list(range(30, 45)), list(range(50, 60))]  # 13, 15, 10 tokens
    layout = _layout(chunks, [35, 36])
    num_chunk = 38
    for budget in (0.0, 0.1, 0.25, 0.5, 0.9):
        chosen = Regions(budget=budget, window=4, heads=1).select(layout)
        assert int((chosen & layout.cached).sum()) <= int(budget * num_chunk)
    heads = Regions(budget=0.1, window=4, heads=1).select(layout)
    assert all(heads[seg.token_start] for seg in layout.chunks)  # behind a prefix every chunk is a later chunk
    assert not Regions(budget=0.05, heads=2).select(layout).any()  # the heads alone exceed the budget
    whole = Regions(budget=1.0, window=64, heads=0).select(layout)
    assert torch.equal(whole, layout.cached)
    # Windows align to the chunk's end, as its front-padded blocks do: a 13-token chunk is 1 + 4 + 4 + 4.
    first = Regions(budget=1.0, window=4, heads=0).select(_layout([chunks[0]], [15]))
    assert first.sum() == 13


def test_relevance_given_replaces_the_lexical_ranking():
    chunks = [list(range(10, 22)), [50, 51] + list(range(30, 40)), list(range(60, 72))]
    lexical = _layout(chunks, [50, 51])
    given = _layout(chunks, [50, 51], relevance=[0.1, 0.2, 0.9])
    policy = Regions(budget=0.34, window=4, heads=0)  # 12 of 36 tokens: one chunk
    assert policy.select(lexical)[lexical.chunks[1].tokens].all()
    chosen = policy.select(given)
    assert chosen[given.chunks[2].tokens].all() and not chosen[given.chunks[1].tokens].any()
    assert [seg.relevance for seg in given.chunks] == [0.1, 0.2, 0.9]


def test_the_query_ranks_without_its_generated_tokens():
    chunks = [list(range(10, 22)), list(range(30, 42))]
    prompt = _layout(chunks, [31, 32])
    preempted = _layout(chunks, [31, 32, 11, 12, 13], num_generated=3)
    assert preempted.query_ids == [31, 32]
    policy = Regions(budget=0.3, window=4, heads=0)
    assert torch.equal(policy.select(preempted)[: prompt.num_tokens - 2], policy.select(prompt)[:-2])


def test_relevance_through_the_engine(stories):
    ids = stories.compile(list(DOCS))
    with pytest.raises(pic.InvalidInputError, match="relevance has 2 scores for 3 cache ids"):
        stories.link(ids, QUERY, relevance=[1.0, 2.0])
    with pytest.raises(pic.InvalidInputError, match="finite numbers"):
        stories.link(ids, QUERY, relevance=[1.0, float("nan"), 0.0])
    best_last = stories.link(ids, QUERY, prefix=PREFIX, policy="regions:0.3,window=4", relevance=[0.0, 0.0, 1.0])
    best_first = stories.link(ids, QUERY, prefix=PREFIX, policy="regions:0.3,window=4", relevance=[1.0, 0.0, 0.0])
    last, first = best_last.layout.chunks[2], best_first.layout.chunks[0]
    assert best_last.recomputed[last.tokens].sum() > best_first.recomputed[last.tokens].sum()
    assert best_first.recomputed[first.tokens].sum() > best_last.recomputed[first.tokens].sum()
    assert stories.link(ids, QUERY, policy="regions", relevance=[3, 2, 1]).layout.chunks[0].relevance == 3.0
    best_last.release()
    best_first.release()


def test_probe_ranked_regions_run_a_probe(stories):
    ids = stories.compile(list(DOCS))
    with stories.link(ids, QUERY, prefix=PREFIX, policy="regions:0.3,rank=probe") as linked:
        assert linked.probe is not None
        layout = linked.layout
        assert int((linked.recomputed & layout.cached).sum()) <= int(0.3 * int(layout.cached.sum()))
    with stories.link(ids, QUERY, prefix=PREFIX, policy="regions:0.3") as linked:
        assert linked.probe is None  # lexical ranking needs no probe
