"""Tenants sharing one engine (issue 63, "Quotas and fairness"): a namespace's chunks keep its ``kv_share`` of the
pool and its ``store_share`` of the CPU tier against other namespaces' work, its own work evicts its own chunks
first, and waiting requests of several namespaces are admitted in turns, each namespace at most its
``max_num_seqs`` at once. The pool alone, the CPU tier alone, then the engine on the embedded stories260K model;
orders and counts of events, never times."""

from __future__ import annotations

import dataclasses
import itertools
import queue
import random
from collections import Counter

import pytest
import torch

import pic
from pic.config import CompileOptions
from pic.engine.commands import Compile, Step, Submit
from pic.engine.core.turns import Turns
from pic.engine.request import CompileJob
from pic.ids import chunk_id
from pic.kv import BlockPool, ChunkKV
from pic.namespaces import OPEN
from pic.store import LruTier
from tests.conftest import make_engine
from tests.kv_invariants import check_pool

# ------------------------------------------------------------------------------------------------ the pool


_KEYS = itertools.count()


def add_chunks(pool: BlockPool, owner: str, *sizes: int) -> list[str]:
    """Resident chunks of ``owner`` of ``sizes`` blocks, compiled by ``owner`` and released in that order (evictable,
    the first least recently used); returns their keys."""
    keys, held = [], []
    for size in sizes:
        key = f"{owner or 'default'}-{next(_KEYS)}"
        blocks = pool.allocate(size, owner=owner)
        pool.add_chunk(key, blocks, info=None, owner=owner)
        keys.append(key)
        held.append(blocks)
    for blocks in held:
        pool.free(blocks)
    return keys


def test_a_namespace_within_its_share_keeps_its_chunks_while_another_compiles_far_more():
    pool = BlockPool(20, block_size=4, kv_shares={"a": 0.5})  # a keeps 10 blocks
    a = add_chunks(pool, "a", 2, 2, 2, 2)  # 8 blocks: within its share
    assert (pool.usage("a"), pool.share("a"), pool.share("b")) == (8, 10, 0)
    b_chunks = []
    for _ in range(40):  # b compiles 80 blocks' worth, one chunk at a time, into the 12 blocks a leaves
        b_chunks += add_chunks(pool, "b", 2)
        check_pool(pool)
    assert all(pool.is_resident(k) for k in a)
    assert [k for k in b_chunks if pool.is_resident(k)] == b_chunks[-6:]  # b's own, least recently used first
    assert pool.num_available(owner="b") == 12 and pool.num_available(owner="a") == 20
    with pytest.raises(pic.KVPoolExhaustedError) as refused:  # what b cannot take is kept for a
        pool.allocate(13, owner="b")
    message = str(refused.value)
    assert "needs 13 blocks of 4 tokens but 12 of 20 are available to namespace 'b'" in message
    assert "8 blocks of other namespaces' evictable chunks are kept for them (within their kv_share" in message
    assert all(pool.is_resident(k) for k in a) and pool.usage("b") == 12
    check_pool(pool)
    taken = pool.allocate(20, owner="a")  # a's own work may take everything: its own chunks and b's
    assert not pool.chunks and pool.usage("a") == 20 and pool.usage("b") == 0
    check_pool(pool, {i: 1 for i in taken})


def test_a_namespaces_work_evicts_its_own_chunks_first():
    pool = BlockPool(8, block_size=4, kv_shares={"b": 0.25})  # b keeps 2 blocks
    (a0,) = add_chunks(pool, "a", 2)  # the least recently used chunk of all (a has no quota)
    b0, b1 = add_chunks(pool, "b", 2, 2)  # b over its share
    (c0,) = add_chunks(pool, "c", 2)  # no quota
    assert pool.allocate(2, owner="b") and set(pool.chunks) == {a0, b1, c0}  # b's own LRU, not a's older one
    assert pool.allocate(2, owner="b") and set(pool.chunks) == {a0, c0}  # b's last one
    assert pool.allocate(2, owner="b") and set(pool.chunks) == {c0}  # then others' over their share, LRU first
    assert pool.allocate(2, owner="b") and not pool.chunks
    check_pool(pool, {i: 1 for i in range(8)})


def test_without_quotas_eviction_is_least_recently_used_first():
    """One namespace, or several without shares: as before owners (each owner over its share of 0); with several,
    a namespace's own chunks go first, then the others' least recently used first."""
    pool = BlockPool(9, block_size=4)
    c0, c1, c2 = add_chunks(pool, "", 2, 3, 2)
    pool.free(pool.hold(c1))  # c1 used again: c0, c2, c1 from least to most recently used
    taken = pool.allocate(2)  # the plain blocks
    taken += pool.allocate(1)
    assert set(pool.chunks) == {c1, c2}
    taken += pool.allocate(4)  # c0's other block, then c2, then c1
    assert set(pool.chunks) == set()
    check_pool(pool, {i: 1 for i in taken})

    pool = BlockPool(6, block_size=4)
    _, y0, x1 = add_chunks(pool, "x", 2)[0], add_chunks(pool, "y", 2)[0], add_chunks(pool, "x", 2)[0]
    assert pool.num_available(owner="z") == 6 and pool.share("x") == 0
    taken = pool.allocate(2, owner="z")  # z has none: the least recently used, x0
    assert set(pool.chunks) == {y0, x1}
    taken += pool.allocate(2, owner="x")  # x's own first: x1, not y0
    assert set(pool.chunks) == {y0}
    check_pool(pool, {i: 1 for i in taken})


def test_a_namespace_under_its_share_takes_back_what_it_is_owed_before_evicting_its_own():
    """b filled the pool while a was away: a's compiles evict b's chunks until a holds its share (each would
    otherwise evict a's last one), then a's own."""
    pool = BlockPool(20, block_size=4, kv_shares={"a": 0.5})
    b = add_chunks(pool, "b", *[2] * 10)
    a = [key for _ in range(5) for key in add_chunks(pool, "a", 2)]
    assert all(pool.is_resident(k) for k in a) and [k for k in b if pool.is_resident(k)] == b[5:]
    assert pool.usage("a") == 10 == pool.share("a")
    a += add_chunks(pool, "a", 2)  # at its share: its own least recently used now
    assert [k for k in a if pool.is_resident(k)] == a[1:] and [k for k in b if pool.is_resident(k)] == b[5:]
    check_pool(pool)


def test_a_namespace_over_its_share_loses_its_least_recently_used_chunks_to_others():
    pool = BlockPool(20, block_size=4, kv_shares={"a": 0.25})  # a keeps 5 blocks
    a0, a1, a2, a3 = add_chunks(pool, "a", 2, 2, 2, 2)  # 8: 3 over its share
    private = pool.allocate(12, owner="b")  # every plain block
    assert pool.num_available(owner="b") == 3  # (a lower bound: whole chunks give 4)
    pool.check_available(4, what="b's request", owner="b")  # counted chunk by chunk: a gives 2 chunks, back to 4
    taken = pool.allocate(4, owner="b")
    assert set(pool.chunks) == {a2, a3} and pool.usage("a") == 4  # its least recently used, until it is within
    with pytest.raises(pic.KVPoolExhaustedError, match="4 blocks of other namespaces' evictable chunks are kept"):
        pool.allocate(1, owner="b")
    private += pool.allocate(1, owner="a")  # a's own work takes its own
    assert set(pool.chunks) == {a3}
    check_pool(pool, {i: 1 for i in [*private, *taken]})
    del a0, a1


def test_the_least_recently_used_of_the_namespaces_over_their_share_goes_first():
    pool = BlockPool(12, block_size=4, kv_shares={"a": 1 / 6, "b": 1 / 6})  # 2 blocks each
    (a0,) = add_chunks(pool, "a", 2)
    (b0,) = add_chunks(pool, "b", 2)
    a1, b1 = add_chunks(pool, "a", 2)[0], add_chunks(pool, "b", 2)[0]
    pool.allocate(4, owner="c")  # the plain blocks
    assert pool.allocate(2, owner="c") and set(pool.chunks) == {b0, a1, b1}  # a0, the oldest
    assert pool.allocate(2, owner="c") and set(pool.chunks) == {a1, b1}  # b0; now each is at its share
    with pytest.raises(pic.KVPoolExhaustedError):
        pool.allocate(1, owner="c")
    check_pool(pool)


def test_a_promoted_chunk_is_charged_to_its_namespace_and_evicts_for_the_request():
    """A request of ``r`` that links a chunk of the shared namespace ``s`` promotes it with ``r``'s work (``r``'s
    chunks are evicted first for it) into blocks charged to ``s`` (``add_chunk`` moves the charge)."""
    pool = BlockPool(6, block_size=4, kv_shares={"s": 0.5})
    (r0,) = add_chunks(pool, "r", 2)
    pool.allocate(2, owner="x")
    blocks = pool.allocate(3, owner="r")  # plain, then r0
    assert not pool.is_resident(r0) and pool.usage("r") == 3
    pool.add_chunk("s0", blocks, info=None, owner="s")
    assert (pool.usage("r"), pool.usage("s"), pool.chunks["s0"].owner) == (0, 3, "s")
    assert "r" not in pool.owners  # nothing charged, no share: forgotten
    check_pool(pool, {**{i: 1 for i in blocks}, **{b.block_id: 1 for b in pool.blocks if b.owner == "x"}})
    pool.free(blocks)
    pool.add_chunk("d0", pool.allocate(1, owner="s"), info=cpu_chunk("d0", "d").info)  # the owner from its options
    assert pool.chunks["d0"].owner == "d"


# -------------------------------------------------------------------------------- random operations vs a model


class OwnersModel:
    """What the pool should hold, by brute force: blocks charged to owners, live references, resident chunks and
    the order their owners' evictable chunks were released in."""

    def __init__(self, num_blocks: int, shares: dict[str, int]) -> None:
        self.num_blocks, self.shares = num_blocks, shares
        self.charge: dict[int, str] = {}  # block -> owner, for every block in use or resident
        self.refs: Counter[int] = Counter()
        self.chunks: dict[str, tuple[str, list[int]]] = {}  # key -> (owner, blocks)
        self.pinned: set[str] = set()
        self.lru: list[str] = []  # evictable chunks, least recently released first

    def evictable(self) -> list[str]:
        unused = (k for k, (_, blocks) in self.chunks.items() if not any(self.refs[b] for b in blocks))
        return [k for k in unused if k not in self.pinned]

    def sync_lru(self) -> None:
        evictable = set(self.evictable())
        self.lru = [k for k in self.lru if k in evictable] + sorted(evictable - set(self.lru))

    def usage(self) -> Counter[str]:
        return Counter(self.charge.values())

    def victims(self, n: int, owner: str) -> list[str] | None:
        """The chunks ``allocate(n, owner=owner)`` evicts, in order, or ``None`` when it cannot: block by block, plain
        ones first; then the owner's least recently released chunk, or (while the owner is under its share, or has
        none) the least recently released of the other owners' over their share."""
        plain, usage, victims = self.num_blocks - len(self.charge), self.usage(), []
        for _ in range(n):
            if plain == 0:
                left = [k for k in self.lru if k not in victims]
                mine = next((k for k in left if self.chunks[k][0] == owner), None)
                others = ((k, self.chunks[k][0]) for k in left if self.chunks[k][0] != owner)
                theirs = next((k for k, whose in others if usage[whose] > self.shares.get(whose, 0)), None)
                key = mine if mine is not None and usage[owner] >= self.shares.get(owner, 0) else theirs or mine
                if key is None:
                    return None
                whose, blocks = self.chunks[key]
                victims.append(key)
                plain += len(blocks)
                usage[whose] -= len(blocks)
            plain -= 1
            usage[owner] += 1
        return victims

    def evict(self, keys: list[str]) -> None:
        for key in keys:
            for block in self.chunks.pop(key)[1]:
                del self.charge[block]
            self.pinned.discard(key)
        self.lru = [k for k in self.lru if k not in keys]

    def free(self, blocks: list[int]) -> None:
        for block in blocks:
            self.refs[block] -= 1
            if not self.refs[block] and not any(block in bs for _, bs in self.chunks.values()):
                del self.charge[block]


OWNERS = ["", "a", "b", "c"]
OPS = ["alloc", "free", "chunk", "hold", "release", "pin", "unpin", "drop", "check"]
WEIGHTS = [3, 5, 5, 1, 6, 1, 2, 1, 3]


@pytest.mark.parametrize("seed", [7, 8])
def test_random_operations_allocate_what_num_available_promises_and_evict_as_the_rule_says(seed):
    rng = random.Random(seed)
    shares = {"a": 0.25, "b": 0.2, "c": 0.0}
    pool = BlockPool(30, block_size=4, kv_shares=shares)
    model = OwnersModel(30, {"a": 7, "b": 6})
    private: list[list[int]] = []
    holds: list[list[int]] = []
    counts: Counter[str] = Counter()
    for step in range(4000):
        op = rng.choices(OPS, weights=WEIGHTS)[0]
        owner = rng.choice(OWNERS)
        ok = True
        if op in ("alloc", "chunk", "check"):
            n = rng.randint(1, 6)
            expected = model.victims(n, owner)
            promised = pool.num_available(owner=owner)
            assert promised <= pool.num_available_blocks
            if n <= promised:
                assert expected is not None, (step, n, promised, owner)  # num_available never promises too much
            if op == "check":
                if expected is None:
                    with pytest.raises(pic.KVPoolExhaustedError):
                        pool.check_available(n, what="x", owner=owner)
                else:
                    pool.check_available(n, what="x", owner=owner)
                counts["check"] += 1
                continue
            before = pool.stats()
            if expected is None:
                with pytest.raises(pic.KVPoolExhaustedError):
                    pool.allocate(n, owner=owner)
                assert pool.stats() == before
                counts["exhausted"] += 1
                ok = False
            else:
                blocks = pool.allocate(n, owner=owner)  # passes whenever the model says it fits
                counts["evicting"] += bool(expected)
                counts["within"] += n > promised
                model.evict(expected)
                for block in blocks:
                    model.charge[block] = owner
                    model.refs[block] += 1
                if op == "chunk":
                    key, whose = f"k{step}", rng.choice(OWNERS)  # (compiled by another's work: a promotion)
                    pool.add_chunk(key, blocks, info=None, owner=whose)
                    model.chunks[key] = (whose, blocks)
                    for block in blocks:
                        model.charge[block] = whose
                    holds.append(blocks)
                else:
                    private.append(blocks)
        elif op == "free" and private:
            blocks = private.pop(rng.randrange(len(private)))
            pool.free(blocks)
            model.free(blocks)
        elif op == "hold" and model.chunks:
            key = rng.choice(sorted(model.chunks))
            holds.append(pool.hold(key))
            for block in holds[-1]:
                model.refs[block] += 1
        elif op == "release" and holds:
            blocks = holds.pop(rng.randrange(len(holds)))
            pool.free(blocks)
            model.free(blocks)
        elif op == "pin" and model.chunks:
            key = rng.choice(sorted(model.chunks))
            pool.pin(key)
            model.pinned.add(key)
        elif op == "unpin" and model.pinned:
            key = rng.choice(sorted(model.pinned))
            pool.unpin(key)
            model.pinned.discard(key)
        elif op == "drop" and model.chunks:
            key = rng.choice(sorted(model.chunks))
            assert pool.drop(key)
            _, blocks = model.chunks.pop(key)
            model.pinned.discard(key)
            model.lru = [k for k in model.lru if k != key]
            for block in blocks:
                if not model.refs[block]:
                    del model.charge[block]
        else:
            ok = False
        counts[op] += ok
        model.sync_lru()
        check_pool(pool, {b: r for b, r in model.refs.items() if r})
        assert {k: (c.owner, c.block_ids) for k, c in pool.chunks.items()} == model.chunks
        assert {n: pool.usage(n) for n in OWNERS} == {n: model.usage()[n] for n in OWNERS}
        queued = list(dict.fromkeys(b.chunk.key for b in pool.free_queue if b.chunk is not None))
        assert queued == model.lru
    assert min(counts[op] for op in OPS) > 50 and counts["exhausted"] > 50 and counts["evicting"] > 100, counts
    assert counts["within"] > 0, counts  # allocations beyond num_available's bound that the exact count allowed


# ------------------------------------------------------------------------------------------------ the CPU tier


def cpu_chunk(key: str, namespace: str, num_bytes: int = 100) -> ChunkKV:
    """A chunk of ``num_bytes`` bytes of K and V in ``namespace``."""
    values = torch.zeros(num_bytes // 2, dtype=torch.uint8)
    return ChunkKV(key, torch.zeros(1, dtype=torch.long), values, values.clone(), CompileOptions(namespace=namespace))


def test_the_cpu_tier_keeps_a_namespaces_store_share():
    tier = LruTier(capacity_bytes=1000, shares={"a": 0.4})  # a keeps 400 bytes
    for i in range(4):
        assert tier.put(cpu_chunk(f"a{i}", "a"))
    for i in range(30):  # b writes 3000 bytes into the 600 a leaves: its own go, least recently used first
        assert tier.put(cpu_chunk(f"b{i}", "b"))
        assert all(tier.contains(f"a{j}") for j in range(4))
    assert sorted(tier.ids()) == sorted([f"a{j}" for j in range(4)] + [f"b{j}" for j in range(24, 30)])
    assert not tier.can_fit(700, namespace="b") and tier.can_fit(600, namespace="b")
    assert not tier.put(cpu_chunk("big", "b", 700)) and tier.contains("a0")  # refused, nothing evicted
    assert tier.can_fit(1000, namespace="a")  # a's own put may evict everything
    assert tier.put(cpu_chunk("a4", "a", 200))  # beyond its share: its own go first
    assert not tier.contains("a0") and not tier.contains("a1") and tier.contains("b24")
    assert tier.stats().evictions == 26


def test_a_namespace_under_its_store_share_takes_back_what_it_is_owed_first():
    tier = LruTier(capacity_bytes=1000, shares={"a": 0.5})
    for i in range(10):
        tier.put(cpu_chunk(f"b{i}", "b"))
    for i in range(6):
        tier.put(cpu_chunk(f"a{i}", "a"))
    assert sorted(tier.ids()) == sorted([f"a{i}" for i in range(1, 6)] + [f"b{i}" for i in range(5, 10)])


def test_the_cpu_tier_takes_from_a_namespace_over_its_share_until_it_is_back_at_it():
    tier = LruTier(capacity_bytes=1000, shares={"a": 0.3, "d": 0.4})
    for i in range(6):
        tier.put(cpu_chunk(f"a{i}", "a"))
    for i in range(4):
        tier.put(cpu_chunk(f"b{i}", "b"))
    tier.get("a0")  # a0 used again: a1 is a's least recently used
    assert tier.put(cpu_chunk("b4", "b")) and not tier.contains("b0")  # b's own first
    assert tier.put(cpu_chunk("c0", "c")) and not tier.contains("a1")  # c has none: the LRU of those over their share
    assert tier.put(cpu_chunk("c1", "c")) and not tier.contains("c0")  # then its own first
    for i in range(2):  # d, under its share, takes back what it is owed: a's over its share, least recently used first
        tier.put(cpu_chunk(f"d{i}", "d"))
    assert sorted(c for c in tier.ids() if c.startswith("a")) == ["a0", "a4", "a5"] and tier.contains("b1")
    for i in (2, 3):  # a is at its share: b's (no share), least recently used first
        tier.put(cpu_chunk(f"d{i}", "d"))
    assert not tier.contains("b1") and not tier.contains("b2") and tier.contains("a4")
    tier.put(cpu_chunk("d4", "d"))  # d at its share: its own first
    assert not tier.contains("d0") and [c for c in tier.ids() if c.startswith("d")] == ["d1", "d2", "d3", "d4"]
    tier_without = LruTier(capacity_bytes=300)
    for key in ("x0", "x1", "x2", "x3"):
        tier_without.put(cpu_chunk(key, ""))
    assert tier_without.ids() == ["x1", "x2", "x3"]  # without shares: least recently used first, as before


# ------------------------------------------------------------------------------------------------ admission


def test_turns_interleave_namespaces_and_go_on_across_steps():
    turns = Turns()
    works = [("a", 0), ("a", 1), ("a", 2), ("b", 3), ("c", 4), ("b", 5)]
    order = turns.order(works, namespace=lambda w: w[0], arrival=lambda w: w[1])
    assert order == [("a", 0), ("b", 3), ("c", 4), ("a", 1), ("b", 5), ("a", 2)]
    turns.took("a")
    rest = [w for w in works if w != ("a", 0)]
    assert turns.order(rest, namespace=lambda w: w[0], arrival=lambda w: w[1])[:3] == [("b", 3), ("c", 4), ("a", 1)]
    assert turns.names == ["b", "c", "a"]
    alone = [("", 2), ("", 0), ("", 1)]
    assert turns.order(alone, namespace=lambda w: w[0], arrival=lambda w: w[1]) == [("", 0), ("", 1), ("", 2)]


def submit(engine: pic.PIC, namespace: str, query: list[int], sink: queue.SimpleQueue, **kwargs) -> int:
    """Queue a paced request (it runs only in the steps ``step`` asks for) of ``namespace``; returns its id."""
    request = pic.Request(kwargs.pop("cache_ids", []), query, **kwargs)
    new = engine._prepare.new_request(request, sink=sink, paced=True)
    access = pic.Access(own=pic.Namespace(namespace)) if namespace else OPEN
    engine._channel.send(Submit((dataclasses.replace(new, access=access),)))
    return new.request_id


def step(engine: pic.PIC) -> None:
    engine._channel.call(Step)


def finished(sink: queue.SimpleQueue) -> list[int]:
    """The ids of the requests whose last output is in ``sink``, in the order they finished."""
    outputs = []
    while not sink.empty():
        outputs.append(sink.get())
    assert all(out.error is None for out in outputs), [out.error for out in outputs]
    return [out.request_id for out in outputs if out.finished]


def active(engine: pic.PIC) -> Counter[str]:
    """Namespace -> its requests running or prefilling now."""

    def count(core) -> Counter[str]:
        seqs = core.scheduler.queues.requests.values()
        return Counter(s.request.access.own.name for s in seqs if s.status.value in ("running", "prefilling"))

    with engine.paused() as core:
        return count(core)


@pytest.mark.parametrize("prefill_order", ["interactive", "arrival"])
def test_waiting_requests_of_several_namespaces_are_admitted_in_turns(prefill_order):
    """One request runs at a time: a's four, b's two and c's one, queued in that order, finish a, b, c, a, b, a, a
    (the namespace last admitted goes to the back of the turns); of one namespace, in arrival order."""
    engine = make_engine("stories260K", max_num_seqs=1, prefill_order=prefill_order)
    sink: queue.SimpleQueue = queue.SimpleQueue()
    queued = [(name, submit(engine, name, [5, 6, 7 + i], sink, max_new_tokens=1)) for i, name in enumerate("aaaabbc")]
    ids = {name: [rid for n, rid in queued if n == name] for name in "abc"}
    for _ in range(7):
        step(engine)
    order = finished(sink)
    a, b, c = ids["a"], ids["b"], ids["c"]
    assert order == [a[0], b[0], c[0], a[1], b[1], a[2], a[3]]

    alone = [submit(engine, "", [5, 6, 7 + i], sink, max_new_tokens=1) for i in range(4)]
    for _ in range(4):
        step(engine)
    assert finished(sink) == alone  # one namespace: arrival order
    engine.close()


def test_a_namespace_at_its_max_num_seqs_is_passed_over_while_the_others_run():
    engine = make_engine("stories260K", max_num_seqs=8, eos_token_ids=(), quotas={"b": pic.Quota(max_num_seqs=2)})
    sink: queue.SimpleQueue = queue.SimpleQueue()
    b = [submit(engine, "b", [5, 6, 7 + i], sink, max_new_tokens=6) for i in range(6)]  # b's come first
    a = [submit(engine, "a", [5, 6, 20 + i], sink, max_new_tokens=6) for i in range(3)]
    done: list[int] = []
    most = Counter()
    for num_steps in range(1, 60):
        step(engine)
        now = active(engine)
        most = most | now
        if num_steps == 1:
            assert now == Counter({"a": 3, "b": 2})  # all of a's beside b's two: b's others passed over, not a stop
        done += finished(sink)
        if len(done) == len(a) + len(b):
            break
    assert sorted(done) == sorted(a + b) and most["b"] == 2 and most["a"] == 3
    assert max(done.index(i) for i in a) < done.index(b[-1])  # a's all ran beside b's first ones
    engine.close()


# ------------------------------------------------------------------------------------------------ the engine


def compile_in(engine: pic.PIC, namespace: str, docs: list[list[int]]) -> list[str]:
    """Compile token-id documents into ``namespace`` (what the server does for a tenant); returns their ids."""
    options = engine.compile_options().model_copy(update={"namespace": namespace})
    ids = [chunk_id(engine.fingerprint, doc, options) for doc in docs]
    job = CompileJob(tokens=dict(zip(ids, docs, strict=True)), options=options, todo=tuple(ids))
    engine._channel.call(lambda reply: Compile(job, reply))
    return ids


def documents(num: int, *, seed: int, num_tokens: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(num_tokens)] for _ in range(num)]


def resident(engine: pic.PIC, ids: list[str]) -> list[bool]:
    with engine.paused() as core:
        return [core.pool.is_resident(cid) for cid in ids]


@pytest.mark.parametrize("quota", [True, False])
def test_a_tenants_chunks_survive_another_tenant_compiling_far_more_than_the_pool(quota):
    """a's 2 chunks (10 blocks of the 64-block pool, within its quarter) stay resident while b compiles 40 chunks
    (160 blocks) three at a time (b's own chunks evicted first), and a links them without compiling them again;
    a call of b's that needs more than the pool leaves it is refused, naming the blocks kept for a. Without the
    quota the same call evicts a's chunks (the rule's only protection is the share)."""
    quotas = {"a": pic.Quota(kv_share=0.25)} if quota else {}
    engine = make_engine("stories260K", kv_pool_tokens=64 * 16, eos_token_ids=(), quotas=quotas)
    a = compile_in(engine, "a", documents(2, seed=1, num_tokens=70))  # 5 blocks each
    docs = documents(40, seed=2)
    for first in range(0, 39, 3):
        compile_in(engine, "b", docs[first : first + 3])
    assert resident(engine, a) == [True, True]
    assert engine.kv_stats().num_evicted_chunks > 20
    big = documents(11, seed=3, num_tokens=75)  # 55 blocks held together (no lower tier), beside a's 10
    if quota:
        with pytest.raises(pic.KVPoolExhaustedError, match="10 blocks of other namespaces' evictable chunks are kept"):
            compile_in(engine, "b", big)
        assert resident(engine, a) == [True, True]
        sink: queue.SimpleQueue = queue.SimpleQueue()
        rid = submit(engine, "a", [5, 6, 7], sink, cache_ids=a, max_new_tokens=2)
        step(engine)
        step(engine)
        assert finished(sink) == [rid] and resident(engine, a) == [True, True]  # its private blocks: b's chunks'
        with engine.paused() as core:
            assert core.store.device.stats().misses == 0  # linked, not loaded
    else:
        compile_in(engine, "b", big)
        assert False in resident(engine, a)  # (the least recently used of them was enough)
    with engine.paused() as core:
        check_pool(core.pool)
        assert core.pool.usage("a") == (10 if quota else 5) and core.pool.share("a") == (16 if quota else 0)
    engine.close()
