"""``anchors``: each chunk's head and its separators (sentence ends first), most relevant chunk first, within the
budget; separators read from the tokenizer's text of each token."""

from __future__ import annotations

import pytest
import torch

import pic
from pic.link.separators import Kind, Separators, kind_of
from pic.policies import Anchors

DOCS = ["The river Elbe flows into the North Sea. It is long.\n", "Hamburg has a port. Ships arrive, daily.\n",
        "Berlin is the capital, and it is big."]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "kind"),
    [(".", Kind.STRONG), (".\n", Kind.STRONG), ("\n\n", Kind.STRONG), ("?  ", Kind.STRONG), (",", Kind.WEAK),
     (";", Kind.WEAK), (" the", Kind.NONE), ("", Kind.NONE), ("   ", Kind.NONE), ("3.5x", Kind.NONE)],
)  # fmt: skip
def test_separator_kinds(text, kind):
    assert kind_of(text) is kind


def test_separators_are_memoized_per_token_id():
    calls = []

    class Tokenizer:
        def decode(self, ids):
            calls.append(ids)
            return {1: ".", 2: " cat", 3: ","}[ids[0]]

    seps = Separators(Tokenizer())
    assert seps.kinds(torch.tensor([1, 2, 3, 1, 2])).tolist() == [2, 0, 1, 2, 0]
    assert seps.kinds([3, 3, 1]).tolist() == [1, 1, 2] and len(calls) == 3


def _chosen(linked) -> list[str]:
    tokens = [linked._engine.tokenizer.decode([int(t)]) for t in linked.input_ids]
    return [t for t, r, c in zip(tokens, linked.recomputed, linked.layout.cached, strict=True) if r and c]


def test_heads_then_sentence_ends_of_the_most_relevant_chunk_first():
    engine = pic.PIC.from_pretrained()  # stories260K: its tokenizer spells "." and "\n" as tokens of their own
    ids = engine.compile(DOCS)
    with engine.link(ids, "Which sea does the Elbe flow into?", prefix="Read:", policy="anchors:1.0") as linked:
        layout = linked.layout
        kinds = layout.separators
        assert kinds is not None and int((kinds == Kind.STRONG).sum()) >= 5 and int((kinds == Kind.WEAK).sum()) >= 2
        # a whole budget takes every chunk token: heads, separators, then the words before them
        assert bool(linked.recomputed[layout.cached].all())
    num_chunk = int(layout.cached.sum())
    heads = [seg.token_start for seg in layout.chunks]
    strong = (kinds == Kind.STRONG) & layout.cached
    budget = (len(heads) + int(strong.sum())) / num_chunk
    with engine.link(
        ids, "Which sea does the Elbe flow into?", prefix="Read:", policy=Anchors(budget=budget)
    ) as linked:
        chosen = linked.recomputed & linked.layout.cached
        assert int(chosen.sum()) == int(budget * num_chunk)
        assert all(chosen[h] for h in heads) and bool(chosen[strong].all())  # heads and every sentence end
    # a budget of the heads and one separator: the separator is the most relevant chunk's last (the Elbe's)
    one = (len(heads) + 1) / num_chunk + 1e-9
    with engine.link(ids, "Which sea does the Elbe flow into?", prefix="Read:", policy=Anchors(budget=one)) as linked:
        chosen = (linked.recomputed & linked.layout.cached).nonzero().flatten().tolist()
        elbe = linked.layout.chunks[0]
        extra = [i for i in chosen if i not in heads]
        assert len(extra) == 1 and elbe.token_start < extra[0] < elbe.token_start + elbe.num_tokens
        assert extra[0] == max(i for i in range(elbe.token_start, elbe.token_start + elbe.num_tokens) if strong[i])


def test_outside_an_engine_it_needs_the_separators():
    from pic.kv import ChunkKV
    from pic.link import lay_out

    empty = torch.empty(0)
    chunk = ChunkKV("c", torch.tensor([5, 6, 7]), empty, empty, pic.CompileOptions())
    layout = lay_out(prefix=[1], chunks=[chunk], query=[2], block_size=4)
    with pytest.raises(pic.PolicyError, match="need the layout's separators"):
        Anchors().select(layout)
