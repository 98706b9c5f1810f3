"""Forged and altered chunks in the shared tiers, refused with the fleet's store key (issue 63, "What to build" 4).

Anyone who can write the Redis or the disk folder a fleet shares could put another document's KV under an id: the
entries' checksum is unkeyed, so a forger recomputes it. With ``StoreConfig.store_key`` every entry carries
HMAC tags over its metadata and its payload (``pic.store.auth``), and an entry that fails them is a logged miss,
dropped from its tier, never served. Each case below starts from a fleet's honest entries (written by an engine
with the key), forges or alters one through the backend itself (a real redis-server, a real folder), and reads it
through the public API (``pic.PIC`` with the embedded stories260K model): the read is a logged miss (caplog), the
entry is gone, and a link falls back to an ``UnknownCacheIdError`` (an engine that never saw the document) or a
recompile whose KV is exactly a fresh compile's, never the forged one.
"""

from __future__ import annotations

import dataclasses
import logging
import struct
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest
import torch
import xxhash

import pic
from pic.config import CompileOptions
from pic.ids import chunk_id
from pic.kv import ChunkKV
from pic.store import disk_file, serde
from pic.store.auth import StoreKey
from tests.models import model, tokenizer

KEY = b"the fleet's store key, 32 bytes!"
OTHER_KEY = b"another fleet's store key: 32 b!"
NORTH = "The river Elbe flows into the North Sea."
BLACK = "The river Elbe flows into the big Black Sea."  # as many tokens as NORTH: its KV has NORTH's shape
THIRD = "Tom and Lily played with a red ball in the park."
DOCS = {"north": NORTH, "black": BLACK, "third": THIRD}
QUERY = " Where does the river Elbe flow? It flows into the"
PART_BYTES = 4096  # several parts per chunk (stories260K: 20 KiB of K per chunk here)
DISK_BYTES = 64 * 2**20


def engine(store: pic.StoreConfig | None = None, family: str = "stories260K") -> pic.PIC:
    return pic.PIC(model(family), tokenizer(), store=store)


@dataclasses.dataclass
class Entry:
    """One stored chunk as its backend holds it: the metadata record (unpacked, or ``raw`` bytes) and the parts."""

    meta: dict
    parts: list[bytes]
    raw: bytes | None = None

    def packed(self) -> bytes:
        return self.raw if self.raw is not None else msgpack.packb(self.meta)


class Redis:
    """A fleet's Redis: entries at ``pic:{fingerprint}:{id}:meta`` and ``...:part:{i}``."""

    name = "redis"

    def __init__(self, url: str, client) -> None:
        self.url, self.client = url, client

    def config(self, key: bytes | None) -> pic.StoreConfig:
        return pic.StoreConfig(redis_url=self.url, part_bytes=PART_BYTES, store_key=key)

    def _keys(self, fp: str, cid: str) -> tuple[str, str]:
        return f"pic:{fp}:{cid}:meta", f"pic:{fp}:{cid}:part:"

    def load(self, fp: str, cid: str) -> Entry:
        meta_key, part = self._keys(fp, cid)
        raw = self.client.get(meta_key)
        parts, i = [], 0
        while (value := self.client.get(f"{part}{i}")) is not None:
            parts.append(value)
            i += 1
        return Entry(msgpack.unpackb(raw), parts)

    def save(self, fp: str, cid: str, entry: Entry) -> None:
        self.delete(fp, cid)
        meta_key, part = self._keys(fp, cid)
        for i, value in enumerate(entry.parts):
            self.client.set(f"{part}{i}", value)
        self.client.set(meta_key, entry.packed())

    def delete(self, fp: str, cid: str) -> None:
        meta_key, part = self._keys(fp, cid)
        self.client.delete(meta_key, *(f"{part}{i}" for i in range(64)))

    def exists(self, fp: str, cid: str) -> bool:
        return bool(self.client.exists(self._keys(fp, cid)[0]))


class Disk:
    """A fleet's disk folder: ``{root}/{fingerprint}/{id}.kv`` (magic, metadata length, metadata, payload)."""

    name = "disk"

    def __init__(self, root: Path) -> None:
        self.root = root

    def config(self, key: bytes | None) -> pic.StoreConfig:
        return pic.StoreConfig(disk_path=str(self.root), disk_bytes=DISK_BYTES, part_bytes=PART_BYTES, store_key=key)

    def _path(self, fp: str, cid: str) -> Path:
        return self.root / fp / f"{cid}{disk_file.SUFFIX}"

    def load(self, fp: str, cid: str) -> Entry:
        data = self._path(fp, cid).read_bytes()
        start = len(disk_file.MAGIC) + 8
        (length,) = struct.unpack("<Q", data[len(disk_file.MAGIC) : start])
        meta = msgpack.unpackb(data[start : start + length])
        payload, step = data[start + length :], meta["part_bytes"]
        return Entry(meta, [payload[i : i + step] for i in range(0, len(payload), step)])

    def save(self, fp: str, cid: str, entry: Entry) -> None:
        meta = entry.packed()
        self._path(fp, cid).write_bytes(disk_file.MAGIC + struct.pack("<Q", len(meta)) + meta + b"".join(entry.parts))

    def delete(self, fp: str, cid: str) -> None:
        self._path(fp, cid).unlink(missing_ok=True)

    def exists(self, fp: str, cid: str) -> bool:
        return self._path(fp, cid).exists()


@dataclasses.dataclass
class World:
    """A backend holding the fleet's honest entries of ``DOCS`` (written with ``KEY``), and their ids."""

    backend: Redis | Disk
    fingerprint: str
    ids: dict[str, str]

    def entry(self, name: str) -> Entry:
        return self.backend.load(self.fingerprint, self.ids[name])

    def put(self, name: str, entry: Entry) -> None:
        self.backend.save(self.fingerprint, self.ids[name], entry)

    def rewrite(self, name: str, **changes: object) -> None:
        """Change fields of ``name``'s metadata (the MAC left as it was: the forger lacks the key)."""
        entry = self.entry(name)
        entry.meta.update(changes)
        self.put(name, entry)

    def written_by(self, name: str, store_key: bytes | None, family: str = "stories260K") -> Entry:
        """The entry of document ``name`` as an engine of ``family`` with ``store_key`` writes it (through the same
        backend, then taken out of it)."""
        self.backend.delete(self.fingerprint, self.ids[name])  # (or the other engine finds it held, and writes nothing)
        with engine(self.backend.config(store_key), family) as other:
            (cid,) = other.compile([DOCS[name]])
            written = self.backend.load(other.fingerprint, cid)
            self.backend.delete(other.fingerprint, cid)
        return written


def _checksum(parts: list[bytes]) -> str:
    h = xxhash.xxh3_128()
    for part in parts:
        h.update(part)
    return h.hexdigest()


def _flip(data: bytes, at: int, mask: int = 0x10) -> bytes:
    return data[:at] + bytes([data[at] ^ mask]) + data[at + 1 :]


def _other_kv(w: World) -> None:
    """Another document's KV under the id, its checksum recomputed (an unkeyed forgery)."""
    north, black = w.entry("north"), w.entry("black")
    north.parts, north.meta["checksum"] = black.parts, _checksum(black.parts)
    w.put("north", north)


def _other_kv_with_its_tags(w: World) -> None:
    """Another document's KV with its checksum and payload tag copied along."""
    north, black = w.entry("north"), w.entry("black")
    north.parts = black.parts
    north.meta.update(checksum=black.meta["checksum"], payload_mac=black.meta["payload_mac"])
    w.put("north", north)


def _tokens(w: World) -> None:
    tokens = list(w.entry("north").meta["token_ids"])
    tokens[5] = (tokens[5] + 1) % 512
    w.rewrite("north", token_ids=tokens)


def _bos(w: World) -> None:
    tokens = list(w.entry("north").meta["token_ids"])
    w.rewrite("north", token_ids=[2, *tokens[1:]])  # the id hashes the tokens after the BOS: only the MAC sees it


def _options(**change: object) -> Callable[[World], None]:
    def forge(w: World) -> None:
        options = dict(w.entry("north").meta["options"], **change)
        w.rewrite("north", options=options)

    return forge


def _payload_bit(index: int) -> Callable[[World], None]:
    def forge(w: World) -> None:
        entry = w.entry("north")
        entry.parts[index] = _flip(entry.parts[index], len(entry.parts[index]) // 2)
        w.put("north", entry)

    return forge


def _meta_bit(w: World) -> None:
    entry = w.entry("north")
    raw, tokens = msgpack.packb(entry.meta), msgpack.packb(entry.meta["token_ids"])
    at = raw.index(tokens) + len(tokens) - 1  # the last token's value byte: still msgpack, another token
    entry.raw = _flip(raw, at, mask=0x01)
    w.put("north", entry)


def _part_swapped(w: World) -> None:
    north, black = w.entry("north"), w.entry("black")
    north.parts[1] = black.parts[1]
    w.put("north", north)


def _parts_reordered(w: World) -> None:
    north = w.entry("north")
    north.parts[0], north.parts[1] = north.parts[1], north.parts[0]
    w.put("north", north)


def _kv_swapped(w: World) -> None:
    """K's parts and V's parts exchanged (same sizes), the checksum recomputed."""
    north = w.entry("north")
    half = len(north.parts) // 2
    north.parts = north.parts[half:] + north.parts[:half]
    north.meta["checksum"] = _checksum(north.parts)
    w.put("north", north)


def _layout(w: World) -> None:
    entry = w.entry("north")
    payload = b"".join(entry.parts)
    step = 2 * entry.meta["part_bytes"]
    half = len(payload) // 2
    entry.parts = [p[i : i + step] for p in (payload[:half], payload[half:]) for i in range(0, half, step)]
    entry.meta.update(part_bytes=step, num_parts=len(entry.parts))
    w.put("north", entry)


def _drop_field(name: str) -> Callable[[World], None]:
    def forge(w: World) -> None:
        entry = w.entry("north")
        del entry.meta[name]
        w.put("north", entry)

    return forge


def _mac_of_another(w: World) -> None:
    w.rewrite("north", mac=w.entry("black").meta["mac"])


def _replay(w: World) -> None:
    """The honest entry of another document replayed under this id, as it is (its tags valid)."""
    w.put("north", w.entry("third"))


def _replay_renamed(w: World) -> None:
    """The same, its cache id field rewritten to this one."""
    third = w.entry("third")
    third.meta["cache_id"] = w.ids["north"]
    w.put("north", third)


def _written_with(store_key: bytes | None) -> Callable[[World], None]:
    def forge(w: World) -> None:
        w.put("north", w.written_by("north", store_key))

    return forge


def _another_model(w: World) -> None:
    """A model of another family (same tokenizer, same key) compiled the document; its entry put under this id."""
    w.put("north", w.written_by("north", KEY, family="llama"))


def _another_namespace(w: World) -> None:
    """A tenant's honest entry of the same document (salted id, same key), put under the default id."""
    honest = w.entry("north")
    options = CompileOptions(add_bos=True, namespace="tenant-b")
    tokens = list(honest.meta["token_ids"])
    salted = chunk_id(w.fingerprint, tokens[1:], options, salt=b"tenant b's secret salt")
    payload = torch.frombuffer(bytearray(b"".join(honest.parts)), dtype=torch.uint8)
    dtype = getattr(torch, honest.meta["dtype"])
    k, v = (t.view(dtype).view(tuple(honest.meta["shape"])) for t in payload.chunk(2))
    chunk = ChunkKV(salted, torch.tensor(tokens), k, v, options)
    encoded = serde.encode(chunk, fingerprint=w.fingerprint, part_bytes=PART_BYTES, key=StoreKey(KEY))
    w.put("north", Entry(msgpack.unpackb(encoded.meta), [bytes(p) for p in encoded.parts]))


def _black_sea(w: World) -> None:
    """The issue's case: NORTH's id and tokens, BLACK's KV, every unkeyed check satisfied (checksum recomputed)."""
    _other_kv(w)


FORGERIES: dict[str, Callable[[World], None]] = {
    "another document's KV, checksum recomputed": _other_kv,
    "another document's KV with its checksum and payload tag": _other_kv_with_its_tags,
    "a token changed": _tokens,
    "the BOS changed": _bos,
    "add_bos flipped": _options(add_bos=False),
    "a compile context added": _options(context=[5, 6, 7]),
    "the namespace label changed": _options(namespace="tenant-a"),
    "extra BOS tokens added": _options(num_extra_bos=2),
    "the fingerprint changed": lambda w: w.rewrite("north", fingerprint="0" * 32),
    "the dtype changed": lambda w: w.rewrite("north", dtype="bfloat16"),
    "the shape changed": lambda w: w.rewrite(
        "north", shape=[w.entry("north").meta["shape"][0] + 1, *w.entry("north").meta["shape"][1:]]
    ),
    "the checksum changed": lambda w: w.rewrite("north", checksum="0" * 32),
    "the part layout changed": _layout,
    "a bit flipped in the metadata": _meta_bit,
    "a bit flipped in the first part": _payload_bit(0),
    "a bit flipped in the last part": _payload_bit(-1),
    "a part swapped from another entry": _part_swapped,
    "two parts reordered": _parts_reordered,
    "K and V exchanged, checksum recomputed": _kv_swapped,
    "the MAC removed": _drop_field("mac"),
    "the payload MAC removed": _drop_field("payload_mac"),
    "the MAC of another entry": _mac_of_another,
    "another entry replayed under the id": _replay,
    "another entry replayed, its cache id rewritten": _replay_renamed,
    "written without the key": _written_with(None),
    "written with another fleet's key": _written_with(OTHER_KEY),
    "an entry of another model": _another_model,
    "an entry of another namespace": _another_namespace,
    "North Sea -> Black Sea": _black_sea,
}


@pytest.fixture(params=["redis", "disk"])
def world(request, tmp_path) -> World:
    """The fleet's honest entries of ``DOCS`` in a real redis-server or a real folder."""
    if request.param == "redis":
        server = request.getfixturevalue("redis_server")
        backend: Redis | Disk = Redis(request.getfixturevalue("redis_url"), server.client())
    else:
        backend = Disk(tmp_path / "chunks")
    with engine(backend.config(KEY)) as writer:
        ids = dict(zip(DOCS, writer.compile(list(DOCS.values())), strict=True))
        world = World(backend, writer.fingerprint, ids)
    assert all(backend.exists(world.fingerprint, cid) for cid in ids.values())
    return world


@pytest.fixture(scope="module")
def honest() -> dict[str, ChunkKV]:
    """Each document compiled by an engine without any store: what the fleet's entries must hold."""
    with engine() as plain:
        return {name: plain.store.get(cid) for name, cid in zip(DOCS, plain.compile(list(DOCS.values())), strict=True)}


def assert_refused(caplog: pytest.LogCaptureFixture, world: World, cid: str) -> None:
    """The read of ``cid`` was a logged miss (a WARNING naming the id) and the entry was dropped."""
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and cid[:32] in r.getMessage()]
    assert warned and "dropping" in warned[0].getMessage(), [r.getMessage() for r in caplog.records]
    assert not world.backend.exists(world.fingerprint, cid)


def assert_same(chunk: ChunkKV, expected: ChunkKV) -> None:
    assert torch.equal(chunk.token_ids, expected.token_ids)
    assert torch.equal(chunk.k.cpu(), expected.k) and torch.equal(chunk.v.cpu(), expected.v)


def test_the_forgeries_are_many_and_apart():
    assert len(FORGERIES) >= 20


@pytest.mark.parametrize("case", list(FORGERIES))
def test_a_forged_entry_is_a_logged_miss_then_unknown(world, case, caplog, honest):
    """An engine with the key that never saw the document: the forged entry is refused (logged, dropped), the link
    an ``UnknownCacheIdError``; once it compiles the document, the chunk it links is a fresh compile's."""
    FORGERIES[case](world)
    cid = world.ids["north"]
    with engine(world.backend.config(KEY)) as reader:
        with caplog.at_level(logging.WARNING, logger="pic.store"):
            with pytest.raises(pic.UnknownCacheIdError):
                reader.link([cid], QUERY)
        assert_refused(caplog, world, cid)
        assert reader.store.stats()[-1].errors >= 1
        assert reader.compile([NORTH]) == [cid]  # no tier holds it now: compiled again, and written back
        with reader.link([world.ids["black"], cid], QUERY):
            assert_same(reader.store.get(cid), honest["north"])
        assert world.backend.exists(world.fingerprint, cid)  # the honest entry, back


@pytest.mark.parametrize(
    "case", ["North Sea -> Black Sea", "a bit flipped in the last part", "written without the key"]
)
def test_a_forged_entry_under_a_compiled_document_is_compiled_again(world, case, caplog, honest):
    """A server that compiles the document while the forged entry is in the tier (its compile finds the id held
    there and prefills nothing) links it: the read is refused, and the engine prefills the document it remembers.
    The KV it links and the logits at the query are a fresh compile's, never the forged document's."""
    FORGERIES[case](world)
    cid = world.ids["north"]
    with engine(world.backend.config(KEY)) as reader, engine() as plain:
        assert reader.compile([NORTH]) == [cid]
        with caplog.at_level(logging.WARNING, logger="pic.store"):
            linked = reader.link([cid], QUERY, policy="naive")
        with linked:
            assert_same(reader.store.get(cid), honest["north"])
            plain.compile([NORTH])
            with plain.link([cid], QUERY, policy="naive") as fresh:
                torch.testing.assert_close(linked.logits, fresh.logits, rtol=0, atol=0)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and cid[:32] in r.getMessage()]
    assert warned and "dropping" in warned[0]
    if world.backend.exists(world.fingerprint, cid):  # written back by the recompile: the honest KV
        held = torch.frombuffer(bytearray(b"".join(world.entry("north").parts)), dtype=torch.uint8)
        expected = torch.cat(
            [t.contiguous().view(torch.uint8).flatten() for t in (honest["north"].k, honest["north"].v)]
        )
        assert torch.equal(held, expected)


def test_without_a_key_the_black_sea_forgery_is_served(world, honest):
    """The control: the same forgery read without a store key passes every unkeyed check, and the engine links
    the Black Sea document's KV under the North Sea document's id (what the key prevents)."""
    _black_sea(world)
    cid = world.ids["north"]
    with engine(world.backend.config(None)) as reader:
        assert reader.compile([NORTH]) == [cid]
        with reader.link([cid], QUERY, policy="naive"):
            served = reader.store.get(cid)
    assert torch.equal(served.token_ids, honest["north"].token_ids)
    assert torch.equal(served.k.cpu(), honest["black"].k) and not torch.equal(served.k.cpu(), honest["north"].k)


def test_honest_entries_read_with_the_key(world, honest):
    """The fleet's own entries pass: a fresh engine with the key links every document from the tier."""
    with engine(world.backend.config(KEY)) as reader:
        with reader.link(list(world.ids.values()), QUERY):
            for name, cid in world.ids.items():
                assert_same(reader.store.get(cid), honest[name])
        assert reader.store.stats()[-1].errors == 0


def test_a_keyless_reader_reads_keyed_entries(world, honest):
    """Without a key the tiers are trusted as they are: entries written with one read as any other."""
    with engine(world.backend.config(None)) as reader:
        with reader.link([world.ids["north"]], QUERY):
            assert_same(reader.store.get(world.ids["north"]), honest["north"])
