"""The issue's forgery read as answers, on SmolLM2 and a real disk folder: a chunk under the id of a document saying
the Elbe flows into the North Sea, holding the KV of one saying the Black Sea (its checksum recomputed, so every
unkeyed check passes). Sent inline again, the North Sea document is answered "Black Sea" by a server that trusts
the folder, and "North Sea" by one with the fleet's store key (which refuses the forgery and compiles the document
again). tests/test_forgery.py holds the other forgeries, on Redis too, compared by KV."""

from __future__ import annotations

import pytest

import pic
from tests.smollm2 import smollm2  # noqa: F401  (the session's model)
from tests.test_forgery import KEY, Disk, World, _other_kv

NORTH = "The river Elbe rises in the Czech Republic and flows into the North Sea near Cuxhaven.\n"
BLACK = "The river Elbe rises in the Czech Republic and flows into the Black Sea near Odessa.\n"  # as many tokens
OTHER = "Hamburg has a large port on the Elbe, and many ships arrive there every day.\n"
PREFIX = "Read the documents, then answer.\n\n"
QUERY = "Question: Into which sea does the Elbe flow?\nAnswer: The Elbe flows into the"
# a question closer to OTHER's words: auto recomputes OTHER whole and links NORTH's chunk as it is stored
NEAR_OTHER = (
    "Question: Many ships arrive every day at the large port of Hamburg on the Elbe. Into which sea does the Elbe "
    "flow?\nAnswer: The Elbe flows into the"
)


def _engine(base: pic.PIC, store: pic.StoreConfig) -> pic.PIC:
    return pic.PIC(base.model, base.tokenizer, config=pic.PICConfig(kv_pool_tokens=4096), store=store)


def _answer(engine: pic.PIC, policy: str, docs: list[str], query: str) -> str:
    """What a server answers a completion with ``docs`` sent inline: compiled (or found), then linked."""
    ids = engine.compile(docs)
    return engine.link(ids, query, prefix=PREFIX, policy=policy).generate(max_new_tokens=4).text


# naive over the forged chunk alone; auto with a second document that the question ranks first (what the issue's
# probe ran: with the forged chunk ranked most relevant, auto recomputes it whole and the forged KV reaches no answer),
# without its floor on the gain (two short documents: the default runs Full Recompute, which reads no cached KV)
@pytest.mark.parametrize(
    ("policy", "docs", "query"),
    [("naive", [NORTH], QUERY), ("auto:0.05,min_gain=1.0", [NORTH, OTHER], NEAR_OTHER)],
    ids=["naive", "auto"],
)
def test_the_black_sea_forgery_is_answered_only_without_the_key(smollm2, tmp_path, policy, docs, query, caplog):  # noqa: F811
    disk = Disk(tmp_path / "chunks")
    with _engine(smollm2, disk.config(KEY)) as writer:
        ids = dict(zip(("north", "black"), writer.compile([NORTH, BLACK]), strict=True))
        assert "North Sea" in _answer(writer, policy, docs, query)  # the honest answer
        world = World(disk, writer.fingerprint, ids)
    _other_kv(world)  # the forger, without the key: BLACK's KV under NORTH's id, checksum recomputed
    with _engine(smollm2, disk.config(None)) as trusting:  # a server that trusts the folder as it is
        assert "Black Sea" in _answer(trusting, policy, docs, query)
    _other_kv(world)  # (the trusting server wrote nothing back: the forgery is still there)
    with caplog.at_level("WARNING", logger="pic"), _engine(smollm2, disk.config(KEY)) as keyed:
        assert "North Sea" in _answer(keyed, policy, docs, query)
    assert any(ids["north"] in record.getMessage() for record in caplog.records)  # refused, and said so
