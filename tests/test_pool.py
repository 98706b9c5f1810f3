"""The tensor-free KV allocator: the O(1) free queue, and the block pool's references, resident chunks,
lazy whole-chunk LRU eviction, pinning, expiry and statistics; then random operations against a
reference model."""

from __future__ import annotations

import random

import pytest

import pic
from pic.kv import BlockPool, KVStats
from pic.kv.blocks import Block, FreeBlockQueue
from tests.kv_invariants import check_pool


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


# ---------------------------------------------------------------------------------------------- queue


def test_free_queue_operations_keep_the_order():
    blocks = [Block(i) for i in range(6)]
    q = FreeBlockQueue(blocks)
    assert len(q) == 6 and ids(q) == [0, 1, 2, 3, 4, 5] and all(b.is_queued for b in blocks)
    assert q.popleft() is blocks[0]
    assert not blocks[0].is_queued and blocks[0].next is None and ids(q) == [1, 2, 3, 4, 5]
    q.remove(blocks[3])  # from the middle
    assert not blocks[3].is_queued and blocks[3].prev is None and blocks[3].next is None
    assert ids(q) == [1, 2, 4, 5] and len(q) == 4
    assert blocks[2].next is blocks[4] and blocks[4].prev is blocks[2]  # the neighbours are joined
    q.append(blocks[3])
    q.appendleft(blocks[0])
    assert ids(q) == [0, 1, 2, 4, 5, 3] and len(q) == 6
    q.remove(blocks[3])  # the back
    q.remove(blocks[0])  # the front
    assert ids(q) == [1, 2, 4, 5] and len(q) == 4
    for expected in (1, 2, 4, 5):
        assert q.popleft().block_id == expected
    assert len(q) == 0 and list(q) == [] and not any(b.is_queued for b in blocks)
    q.append(blocks[5])
    q.appendleft(blocks[4])
    assert ids(q) == [4, 5] and len(q) == 2  # an emptied queue works again


def test_free_queue_misuse_is_caught():
    a, b = Block(0), Block(1)
    q = FreeBlockQueue([a])
    with pytest.raises(AssertionError, match="queued twice"):
        q.append(a)
    with pytest.raises(AssertionError, match="queued twice"):
        q.appendleft(a)
    with pytest.raises(AssertionError, match="not in the free queue"):
        q.remove(b)
    q.popleft()
    with pytest.raises(AssertionError, match="empty free queue"):
        q.popleft()
    assert len(q) == 0


class _Counted(Block):
    """A block that counts the reads of its queue links and its comparisons: what walking or searching the queue
    does (``touches``, over every block of the class)."""

    __slots__ = ()
    touches = 0

    def __getattribute__(self, name: str):
        if name in ("prev", "next"):
            _Counted.touches += 1
        return super().__getattribute__(name)

    def __eq__(self, other: object) -> bool:
        _Counted.touches += 1
        return self is other

    __hash__ = Block.__hash__


def test_free_queue_operations_are_constant_time():
    """Removing from the middle of a long queue touches only the neighbours: 100k removals and insertions in a
    100k-block queue read a few links each (counted, not timed: a list's O(n) remove, or a walk to the block,
    reads tens of thousands per operation)."""
    blocks = [_Counted(i) for i in range(100_000)]
    q = FreeBlockQueue(blocks)
    _Counted.touches = 0
    for block in blocks[25_000:75_000]:
        q.remove(block)
    for block in blocks[25_000:50_000]:
        q.appendleft(block)
    for block in blocks[50_000:75_000]:
        q.append(block)
    num_ops = 100_000
    assert _Counted.touches <= 8 * num_ops, f"{_Counted.touches / num_ops:.1f} links read per operation"
    assert len(q) == 100_000
    order = ids(q)
    assert order[:25_000] == list(range(49_999, 24_999, -1)) and order[-25_000:] == list(range(50_000, 75_000))


# ----------------------------------------------------------------------------------------------- pool


def test_allocate_and_free():
    pool = BlockPool(8, block_size=4)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_available_blocks == 5 and all(pool.blocks[i].ref_cnt == 1 for i in a)
    check_pool(pool, {i: 1 for i in a})
    b = pool.allocate(5)
    assert not set(a) & set(b) and pool.num_available_blocks == 0
    pool.free(a)
    assert pool.num_available_blocks == 3
    check_pool(pool, {i: 1 for i in b})
    assert sorted(pool.allocate(3)) == sorted(a)  # freed blocks are handed out again
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free([a[0], a[0]])
    assert pool.allocate(0) == []


def test_exhausted_pool_names_the_numbers_and_takes_nothing():
    pool = BlockPool(4, block_size=4)
    taken = pool.allocate(3)
    before = pool.stats()
    with pytest.raises(pic.KVPoolExhaustedError, match=r"needs 2 blocks of 4 tokens but 1 of 4 are available"):
        pool.allocate(2)
    assert pool.stats() == before and pool.num_available_blocks == 1
    check_pool(pool, {i: 1 for i in taken})
    with pytest.raises(pic.KVPoolExhaustedError, match=r"the batch needs 3 blocks .* 3 are held by live requests"):
        pool.check_available(3, what="the batch")
    with pytest.raises(pic.KVPoolExhaustedError, match=r"needs 5 blocks of 4 tokens but the pool has 4 in all"):
        pool.allocate(5)  # more than the whole pool: the message says so
    assert pool.stats() == before
    assert isinstance(pic.KVPoolExhaustedError("x"), pic.StoreFullError)


def chunk_pool(num_blocks: int, *sizes: int, block_size: int = 4) -> tuple[BlockPool, list[list[int]]]:
    """A pool with resident chunks ``c0, c1, ...`` of ``sizes`` blocks, released in that order
    (evictable, ``c0`` least recently used)."""
    pool = BlockPool(num_blocks, block_size=block_size)
    chunk_ids = []
    for i, n in enumerate(sizes):
        blocks = pool.allocate(n)
        pool.add_chunk(f"c{i}", blocks, info=("info", i))
        chunk_ids.append(blocks)
    for blocks in chunk_ids:
        pool.free(blocks)
    check_pool(pool)
    return pool, chunk_ids


def test_a_released_chunk_stays_resident_and_evictable():
    pool = BlockPool(8, block_size=4)
    blocks = pool.allocate(3)
    pool.add_chunk("c", blocks, info="about c")
    chunk = pool.chunks["c"]
    assert chunk.block_ids == blocks and chunk.num_refs == 3 and not chunk.is_evictable and chunk.info == "about c"
    assert all(pool.blocks[i].chunk is chunk for i in blocks)
    check_pool(pool, {i: 1 for i in blocks})  # the compile call's references are holds on the chunk
    pool.free(blocks)
    assert chunk.is_evictable and pool.chunks["c"] is chunk  # still resident, its KV intact
    assert pool.num_available_blocks == 8 and ids(pool.free_queue)[-3:] == blocks  # at the tail, in order
    check_pool(pool)

    assert pool.hold("c").tolist() == blocks  # holding takes it back out of the queue
    assert chunk.num_refs == 3 and pool.num_available_blocks == 5 and not chunk.is_evictable
    check_pool(pool, {i: 1 for i in blocks})
    pool.incref(blocks[1:])  # a request maps two of its blocks
    check_pool(pool, {blocks[0]: 1, blocks[1]: 2, blocks[2]: 2})
    pool.free(blocks)  # the hold is released: the mapped blocks keep it in use
    assert chunk.num_refs == 2 and pool.num_available_blocks == 5
    check_pool(pool, {blocks[1]: 1, blocks[2]: 1})
    pool.free(blocks[1:])
    assert chunk.is_evictable and ids(pool.free_queue)[-3:] == blocks
    check_pool(pool)

    pool.hold("c")
    with pytest.raises(AssertionError, match="not a held chunk block"):
        pool.incref(pool.allocate(1))
    with pytest.raises(AssertionError, match="already resident"):
        pool.add_chunk("c", pool.allocate(1), info=None)


def test_add_chunk_takes_freshly_allocated_blocks():
    pool = BlockPool(4, block_size=4)
    a, b = pool.allocate(2)
    pool.add_chunk("c", [a], info=None)
    with pytest.raises(AssertionError, match="freshly allocated"):
        pool.add_chunk("d", [a], info=None)  # already a chunk's
    pool.free([b])
    with pytest.raises(AssertionError, match="freshly allocated"):
        pool.add_chunk("d", [b], info=None)  # a free block
    check_pool(pool, {a: 1})


def test_plain_free_blocks_are_reused_before_any_chunk_is_evicted():
    pool, (c0,) = chunk_pool(6, 2)
    private = pool.allocate(4)
    assert not set(private) & set(c0) and "c0" in pool.chunks
    pool.free(private[:1])  # a freed private block goes before the chunk's blocks
    assert ids(pool.free_queue) == [private[0], *c0]
    assert pool.allocate(1) == private[:1] and "c0" in pool.chunks
    check_pool(pool, {i: 1 for i in private})
    assert pool.stats().num_evicted_chunks == 0


def test_eviction_takes_whole_chunks_least_recently_released_first():
    pool, (c0, c1, c2) = chunk_pool(9, 2, 3, 2)  # 2 plain free blocks in front
    # c1 used again: now c0, c2, c1 from least to most recently released
    pool.free(pool.hold("c1"))
    assert ids(pool.free_queue)[2:] == [*c0, *c2, *c1]
    plain = pool.allocate(2)
    assert set(pool.chunks) == {"c0", "c1", "c2"}
    (first,) = pool.allocate(1)  # no plain block left: c0 goes, whole
    assert first == c0[0] and set(pool.chunks) == {"c1", "c2"} and pool.blocks[c0[1]].chunk is None
    assert ids(pool.free_queue)[0] == c0[1]  # its other block is a plain free block now, handed out next
    assert pool.stats().num_evicted_chunks == 1
    check_pool(pool, {i: 1 for i in [*plain, first]})
    (second,) = pool.allocate(1)
    assert second == c0[1] and set(pool.chunks) == {"c1", "c2"}
    taken = pool.allocate(3)  # c2 (2 blocks), then c1
    assert taken[:2] == c2 and taken[2] == c1[0] and set(pool.chunks) == set()
    assert pool.stats().num_evicted_chunks == 3
    check_pool(pool, {i: 1 for i in [*plain, first, second, *taken]})


def test_held_and_pinned_chunks_are_never_evicted():
    pool, (c0, c1) = chunk_pool(8, 2, 2)
    held = pool.hold("c0").tolist()
    assert pool.pin("c1") and pool.chunks["c1"].pinned
    assert pool.num_available_blocks == 4 and pool.stats().num_used_blocks == 4
    check_pool(pool, {i: 1 for i in held})
    private = pool.allocate(4)
    before = pool.stats()
    with pytest.raises(pic.KVPoolExhaustedError, match="needs 1 blocks of 4 tokens but 0 of 8"):
        pool.allocate(1)
    assert pool.stats() == before and set(pool.chunks) == {"c0", "c1"}
    pool.free(held)  # c0 is evictable again; c1 stays pinned
    assert pool.allocate(1) == c0[:1] and set(pool.chunks) == {"c1"}
    with pytest.raises(pic.KVPoolExhaustedError):
        pool.allocate(2)
    pool.unpin("c1")  # evictable again, at the tail
    assert not pool.chunks["c1"].pinned and ids(pool.free_queue) == [c0[1], *c1]
    check_pool(pool, {i: 1 for i in [*private, c0[0]]})
    assert pool.allocate(3)[1:] == c1 and not pool.chunks


def test_pin_and_unpin():
    pool, (c0,) = chunk_pool(4, 2)
    assert not pool.pin("nope")
    pool.unpin("nope")  # nothing to do
    pool.unpin("c0")  # not pinned: nothing to do
    check_pool(pool)
    assert pool.pin("c0") and pool.pin("c0")  # twice is once
    assert pool.num_available_blocks == 2 and pool.stats().num_used_blocks == 2 and pool.stats().peak_used_blocks == 2
    check_pool(pool)
    held = pool.hold("c0").tolist()  # a pinned chunk can be held, and stays out of the queue when released
    pool.free(held)
    assert pool.num_available_blocks == 2
    check_pool(pool)
    pool.hold("c0")
    pool.unpin("c0")  # still held: not evictable yet
    assert pool.num_available_blocks == 2
    check_pool(pool, {i: 1 for i in c0})
    pool.free(c0)
    assert pool.num_available_blocks == 4 and ids(pool.free_queue)[-2:] == c0
    check_pool(pool)


def test_drop_keeps_a_held_chunks_blocks_until_released():
    pool, (c0, c1, c2) = chunk_pool(8, 2, 2, 2)
    held = pool.hold("c1").tolist()
    assert pool.drop("c1") and "c1" not in pool.chunks
    assert all(pool.blocks[i].chunk is None and pool.blocks[i].ref_cnt == 1 for i in held)
    assert pool.num_available_blocks == 6 and pool.stats().num_private_blocks == 2  # the holder's now
    check_pool(pool, {i: 1 for i in held})
    pool.free(held)  # the last reference: plain free blocks, handed out before any chunk's
    assert pool.num_available_blocks == 8 and ids(pool.free_queue)[:2] == held[::-1]
    check_pool(pool)
    assert pool.drop("c0") and ids(pool.free_queue)[:2] == c0[::-1]  # an unreferenced chunk: free at once
    assert pool.pin("c2") and pool.drop("c2")  # expiry removes pinned chunks too
    assert pool.num_available_blocks == 8 and not pool.chunks and pool.stats().num_evicted_chunks == 0
    assert not pool.drop("c2")
    check_pool(pool)
    assert len(set(pool.allocate(8))) == 8


def test_num_available_counts_what_holding_takes():
    pool, (c0, c1, c2) = chunk_pool(10, 2, 3, 1)  # 4 plain free blocks
    held = pool.hold("c1").tolist()
    assert pool.num_available() == 7  # 4 plain + c0's 2 + c2's 1
    assert pool.num_available(holding=["c0"]) == 5
    assert pool.num_available(holding=["c0", "c0", "c2"]) == 4  # each chunk counted once
    assert pool.num_available(holding=["c1"]) == 7  # already held: not in the queue anyway
    assert pool.num_available(holding=["gone"]) == 7  # not resident: nothing to hold
    pool.pin("c2")
    assert pool.num_available(holding=["c2"]) == 6
    pool.check_available(6, holding=["c2"], what="x")
    with pytest.raises(pic.KVPoolExhaustedError, match="x needs 5 blocks of 4 tokens but 4 of 10"):
        pool.check_available(5, holding=["c0", "c2"], what="x")
    check_pool(pool, {i: 1 for i in held})


def test_stats():
    pool, (c0, c1) = chunk_pool(10, 2, 3, block_size=16)
    assert pool.stats() == KVStats(
        num_blocks=10,
        num_empty_blocks=5,
        num_evictable_blocks=5,
        num_held_chunk_blocks=0,
        num_private_blocks=0,
        num_shared_block_refs=0,
        num_resident_chunks=2,
        num_evicted_chunks=0,
        peak_used_blocks=5,  # while they were compiled
    )
    # A request: holds c1, maps two of its blocks, owns 2 private blocks, then drops the hold.
    held = pool.hold("c1").tolist()
    pool.incref(c1[1:])
    private = pool.allocate(2)
    assert pool.stats().peak_used_blocks == 5
    pool.free(held)
    pool.pin("c0")
    stats = pool.stats()
    assert stats == KVStats(
        num_blocks=10,
        num_empty_blocks=3,
        num_evictable_blocks=0,
        num_held_chunk_blocks=5,  # c0 pinned (2), c1 in use (3)
        num_private_blocks=2,
        num_shared_block_refs=2,
        num_resident_chunks=2,
        num_evicted_chunks=0,
        peak_used_blocks=7,
    )
    assert (stats.num_available_blocks, stats.num_used_blocks, stats.num_resident_chunk_blocks) == (3, 7, 5)
    check_pool(pool, {c1[1]: 1, c1[2]: 1, **{i: 1 for i in private}})
    pool.free([*c1[1:], *private])
    pool.unpin("c0")
    assert pool.stats().num_used_blocks == 0 and pool.stats().peak_used_blocks == 7
    pool.reset_peak()
    assert pool.stats().peak_used_blocks == 0
    taken = pool.allocate(9)  # evicts c1 (released first), then c0
    assert pool.stats().num_evicted_chunks == 2 and pool.stats().num_resident_chunks == 0
    pool.free(taken)
    assert pool.stats().peak_used_blocks == 9
    pool.reset_peak()
    assert pool.stats().peak_used_blocks == 0


# ------------------------------------------------------------------------------------ random property


class Model:
    """What the pool should look like: references per block from the live mappings, which chunks are
    resident, pinned, and in which order unreferenced chunks were released (eviction order)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.private: list[list[int]] = []  # live allocations
        self.holds: list[list[int]] = []  # live holds of whole chunks
        self.maps: list[list[int]] = []  # live mappings of some blocks of a chunk
        self.chunks: dict[str, list[int]] = {}  # resident
        self.pinned: set[str] = set()
        self.lru: list[str] = []  # evictable chunks, least recently released first

    def refs(self) -> dict[int, int]:
        refs: dict[int, int] = {}
        for blocks in [*self.private, *self.holds, *self.maps]:
            for b in blocks:
                refs[b] = refs.get(b, 0) + 1
        return refs

    def evictable(self) -> set[str]:
        refs = self.refs()
        return {k for k, blocks in self.chunks.items() if k not in self.pinned and not any(b in refs for b in blocks)}

    def sync_lru(self) -> None:
        """Chunks that became evictable go to the back; those that stopped being evictable leave."""
        evictable = self.evictable()
        self.lru = [k for k in self.lru if k in evictable] + sorted(evictable - set(self.lru))

    def num_plain_free(self) -> int:
        refs = self.refs()
        in_chunks = {b for blocks in self.chunks.values() for b in blocks}
        return sum(1 for b in range(self.num_blocks) if b not in refs and b not in in_chunks)

    def allocate(self, n: int) -> list[str] | None:
        """The chunks an allocation of ``n`` evicts, or ``None`` when it cannot fit."""
        plain = self.num_plain_free()
        if n > plain + sum(len(self.chunks[k]) for k in self.lru):
            return None
        evicted, room = [], plain
        while room < n:
            key = self.lru[len(evicted)]
            evicted.append(key)
            room += len(self.chunks[key])
        return evicted


# Operations and how often they run: releasing more than taking keeps the pool busy but not stuck.
OPS = ["alloc", "free", "chunk", "hold", "release", "map", "unmap", "pin", "unpin", "drop"]
WEIGHTS = [3, 4, 4, 1, 3, 2, 3, 1, 2, 1]


@pytest.mark.parametrize("seed", [1234])
def test_random_operations_keep_the_invariants(seed):
    rng = random.Random(seed)
    pool = BlockPool(24, block_size=4)
    model = Model(24)
    num_chunks = 0
    counts: dict[str, int] = {}

    def pick(items):
        return items.pop(rng.randrange(len(items)))

    for _ in range(4000):
        op = rng.choices(OPS, weights=WEIGHTS)[0]
        ok = True
        if op in ("alloc", "chunk"):
            n = rng.randint(1, 6)
            expected = model.allocate(n)
            before = pool.stats()
            if expected is None:
                with pytest.raises(pic.KVPoolExhaustedError):
                    pool.allocate(n)
                assert pool.stats() == before
                counts["exhausted"] = counts.get("exhausted", 0) + 1
                ok = False
            else:
                blocks = pool.allocate(n)
                assert len(set(blocks)) == n
                for key in expected:
                    del model.chunks[key]
                    model.pinned.discard(key)
                model.lru = [k for k in model.lru if k not in expected]
                assert pool.stats().num_evicted_chunks == before.num_evicted_chunks + len(expected)
                if op == "chunk":
                    key = f"c{num_chunks}"
                    num_chunks += 1
                    pool.add_chunk(key, blocks, info=key)
                    model.chunks[key] = blocks
                    model.holds.append(blocks)
                else:
                    model.private.append(blocks)
        elif op == "free" and model.private:
            pool.free(pick(model.private))
        elif op == "hold" and model.chunks:
            key = rng.choice(sorted(model.chunks))
            model.holds.append(pool.hold(key).tolist())
            assert model.holds[-1] == model.chunks[key]
        elif op == "release" and model.holds:
            pool.free(pick(model.holds))
        elif op == "map" and model.chunks:  # a request links the chunk: hold, map clean blocks, drop the hold
            key = rng.choice(sorted(model.chunks))
            held = pool.hold(key)
            model.lru = [k for k in model.lru if k != key]  # held for a moment: most recently released after
            mapped = [b for b in held if rng.random() < 0.6] * rng.randint(1, 2)  # a chunk linked twice
            pool.incref(mapped)
            pool.free(held)
            if mapped:
                model.maps.append(mapped)
        elif op == "unmap" and model.maps:
            pool.free(pick(model.maps))
        elif op == "pin" and model.chunks:
            key = rng.choice(sorted(model.chunks))
            assert pool.pin(key)
            model.pinned.add(key)
        elif op == "unpin" and model.pinned:
            key = rng.choice(sorted(model.pinned))
            pool.unpin(key)
            model.pinned.discard(key)
        elif op == "drop" and model.chunks:
            key = rng.choice(sorted(model.chunks))
            assert pool.drop(key)
            del model.chunks[key]
            model.pinned.discard(key)
            model.lru = [k for k in model.lru if k != key]
        else:
            ok = False
        counts[op] = counts.get(op, 0) + ok
        model.sync_lru()
        check_pool(pool, model.refs())
        assert set(pool.chunks) == set(model.chunks)
        assert all(pool.chunks[k].block_ids == blocks for k, blocks in model.chunks.items())
        assert {k for k, c in pool.chunks.items() if c.pinned} == model.pinned
        queued_chunks = list(dict.fromkeys(b.chunk.key for b in pool.free_queue if b.chunk is not None))
        assert queued_chunks == model.lru  # least recently released first
    assert len(counts) == len(OPS) + 1 and min(counts.values()) > 50, counts  # every operation ran often
    assert pool.stats().num_evicted_chunks > 100
