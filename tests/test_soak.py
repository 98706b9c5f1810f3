"""A seeded randomized soak of the KV pool under pressure.

Two engines with small pools (one mapping shared chunk blocks, one copying them) share a real Redis;
more than a thousand random operations compile, link with every policy, keep requests alive across
operations, generate, stream, release, expire, pin and unpin, and an occasional fresh engine links
what they compiled straight out of Redis. After every operation the pools' invariants are checked
against the references the live requests' block tables account for, the blocks in use are derived
independently of the pool's counters, and a resident chunk's canonical blocks are compared with the
KV a reference engine (a huge pool, nothing evicted) compiled. A failed call must be the error the
model of the world predicts (``KVPoolExhaustedError`` exactly when the request's blocks exceed the
free and evictable ones, ``UnknownCacheIdError`` exactly for an id no tier holds) and must take
nothing. A sample of generations, many from requests that lived through evictions, must produce
the reference engine's tokens.

The operations are seeded and the run is deterministic (``link`` holds a request's chunks in prompt
order): a failure names the step and the operation to replay.
"""

from __future__ import annotations

import collections
import random
import time
import types
from dataclasses import dataclass, field

import pytest
import torch

import pic
from pic.engine.core import EngineCore
from pic.kv import BlockPool
from pic.link import lay_out
from tests.kv_invariants import check_engine_pool, check_pool
from tests.models import model, tokenizer

SEED = 20250611
NUM_OPS = 2000
BS = 16
POOL_TOKENS = {"share": 24 * BS, "copy": 32 * BS}  # the copying engine needs room for whole copies
POLICIES = ("naive", "full", "legolink:16", "mepic", "cacheblend:0.15")
MAX_LIVE = 6
MAX_PINNED = 2
MAX_NEW = 4  # tokens a generation asks for at most
BOS = 1
BOUNDARY_QUERY = (40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53)  # 2 slots short of a block boundary
QUERIES = (  # the last one ends two slots before a block boundary: decoding takes a new block
    (300, 45, 99),
    (77, 120, 410, 33, 8),
    (256,),
    (17, 18, 19, 20, 21, 22, 23),
    BOUNDARY_QUERY,
)
WEIGHTS = {
    "link": 30,
    "generate": 14,
    "release": 8,
    "stream": 3,
    "compile": 16,
    "expire": 3,
    "pin": 3,
    "unpin": 2,
    "reset_peak": 1,
    "squeeze": 2,
    "fresh_engine": 1,
}


@dataclass
class Live:
    """A linked request kept alive across operations, and how to link it again on the reference engine."""

    linked: pic.Linked
    ids: tuple[str, ...]
    policy: str
    query: tuple[int, ...]
    prefix: tuple[int, ...]
    born: int
    shared: dict[int, str] = field(default_factory=dict)  # table entries mapping a chunk's block -> its id


@dataclass
class Side:
    """An engine under test and the soak's model of it: live requests, pinned ids, and the ids whose tokens the
    engine keeps (it compiled or linked them, and they were not expired since)."""

    name: str
    engine: pic.PIC
    live: list[Live] = field(default_factory=list)
    pinned: set[str] = field(default_factory=set)
    recipes: set[str] = field(default_factory=set)

    @property
    def core(self) -> EngineCore:
        """The engine's core, to read between the soak's calls: one thread drives the soak, so the engine
        is idle then (its thread waits for a command) and nothing changes under the reads."""
        with self.engine.paused() as core:
            return core

    @property
    def pool(self) -> BlockPool:
        return self.core.pool

    def refs(self) -> dict[int, int]:
        """Block id -> references: one per entry of every live request's block table."""
        return dict(collections.Counter(b for live in self.live for b in live.linked.block_ids))


def _snapshot(pool: BlockPool) -> tuple:
    """Everything a failed call must leave as it was (queue order included: LRU order is state)."""
    return (
        pool.stats(),
        [b.block_id for b in pool.free_queue],
        [(b.ref_cnt, None if b.chunk is None else b.chunk.key) for b in pool.blocks],
        {key: (c.block_ids, c.pinned, c.num_refs) for key, c in pool.chunks.items()},
    )


class Soak:
    def __init__(self, redis_url: str, seed: int) -> None:
        self.rng = random.Random(seed)
        self.redis_url = redis_url
        self.docs = [[self.rng.randrange(3, 512) for _ in range(self.rng.randint(10, 60))] for _ in range(16)]
        self.ref = pic.PIC(model("stories260K"), tokenizer(), config=pic.PICConfig(kv_pool_tokens=16384))
        self.ids = self.ref.compile(self.docs, progress=False)
        assert self.ref.bos_token_id == BOS
        self.tokens = {cid: [BOS, *doc] for cid, doc in zip(self.ids, self.docs, strict=True)}
        self.ref_kv = {cid: self.ref.store.get(cid) for cid in self.ids}
        self.ref_out: dict[tuple, tuple[torch.Tensor, list[int]]] = {}
        self.sides = [
            Side("share", self._engine(share=True, pool_tokens=POOL_TOKENS["share"])),
            Side("copy", self._engine(share=False, pool_tokens=POOL_TOKENS["copy"])),
        ]
        self.redis: set[str] = set()  # ids the soak expects Redis to hold
        self.expired: dict[tuple[str, str], int] = {}  # (side, id) -> the step it last expired
        self.compiled_by: dict[str, str] = {}  # id -> the side whose compile last wrote it to Redis
        self.ops: collections.Counter[str] = collections.Counter()
        self.seen: collections.Counter[str] = collections.Counter()  # outcomes and errors
        self.step = 0

    def _engine(self, *, share: bool, pool_tokens: int) -> pic.PIC:
        return pic.PIC(
            model("stories260K"),
            tokenizer(),
            config=pic.PICConfig(block_size=BS, kv_pool_tokens=pool_tokens, share_chunk_blocks=share),
            # Links never write back (test_redis checks that they do): what Redis holds follows compiles only.
            store=pic.StoreConfig(redis_url=self.redis_url, part_bytes=4096, shared_recheck_s=None),
        )

    # --- the model of the world -------------------------------------------------------------

    def num_chunk_blocks(self, cid: str) -> int:
        return -(-len(self.tokens[cid]) // BS)

    def known(self, side: Side, cid: str) -> bool:
        """Whether some tier of ``side`` holds ``cid``: resident in its pool, or in Redis."""
        return cid in side.pool.chunks or cid in self.redis

    def used_blocks(self, side: Side) -> set[int]:
        """Blocks off the free queue, derived from the live tables and pins alone: mapped blocks, and
        every block of a resident chunk that is pinned or mapped by a live request."""
        mapped = set(side.refs())
        used = set(mapped)
        for key, chunk in side.pool.chunks.items():
            if key in side.pinned or mapped & set(chunk.block_ids):
                used |= set(chunk.block_ids)
        return used

    def available(self, side: Side, holding: set[str]) -> int:
        """Free and evictable blocks once the resident chunks ``holding`` are held (their blocks do not count)."""
        used = self.used_blocks(side)
        own = {b for cid in holding if cid in side.pool.chunks for b in side.pool.chunks[cid].block_ids}
        return side.pool.num_blocks - len(used | own)

    def link_need(self, side: Side, ids: tuple[str, ...], policy: str, query, prefix) -> tuple[int, int, dict]:
        """What a link takes, worked out from its layout: (private blocks, blocks of chunks promoted from
        Redis, {table index: (chunk id, chunk block index)} of the chunk blocks mapped without a copy)."""
        chunks = [types.SimpleNamespace(cache_id=cid, token_ids=torch.tensor(self.tokens[cid])) for cid in ids]
        layout = lay_out(prefix=[BOS, *prefix] if prefix else [], chunks=chunks, query=list(query), block_size=BS)
        resolved = pic.policies.resolve(policy)
        selected = resolved.recompute_mask(layout)
        copy_all = not side.engine.config.share_chunk_blocks or resolved.is_dynamic
        dirty = torch.ones_like(selected) if copy_all else selected
        dirty_blocks = set((layout.slots[dirty & layout.cached] // BS).tolist())
        clean = {}
        for seg in layout.chunks:
            first = (seg.slot_start - seg.num_padding) // BS
            for j in range((seg.num_padding + seg.num_tokens) // BS):
                if first + j not in dirty_blocks:
                    clean[first + j] = (seg.cache_id, j)
        num_private = -(-layout.num_slots // BS) - len(clean)
        promoted = sum(self.num_chunk_blocks(cid) for cid in set(ids) if cid not in side.pool.chunks)
        return num_private, promoted, clean

    # --- checks --------------------------------------------------------------------------------

    def check(self, side: Side, touched: tuple[str, ...] = ()) -> None:
        refs = side.refs()
        check_pool(side.pool, refs)
        stats = side.engine.kv_stats()
        assert stats == side.pool.stats()
        used = self.used_blocks(side)
        assert stats.num_used_blocks == len(used) and stats.num_available_blocks + len(used) == stats.num_blocks
        assert {b.block_id for b in side.pool.free_queue} == set(range(side.pool.num_blocks)) - used
        chunk_blocks = {b for c in side.pool.chunks.values() for b in c.block_ids}
        assert stats.num_private_blocks == len(set(refs) - chunk_blocks)
        assert stats.num_shared_block_refs == sum(n for b, n in refs.items() if b in chunk_blocks)
        for key, chunk in side.pool.chunks.items():
            assert chunk.pinned == (key in side.pinned), (side.name, key)
        for live in side.live:  # a mapped chunk block stays its chunk's until the chunk expires: never evicted
            for block, cid in live.shared.items():
                chunk = side.pool.blocks[block].chunk
                if chunk is None:
                    assert self.expired.get((side.name, cid), -1) >= live.born, (side.name, cid, block)
                else:
                    assert chunk.key == cid, (side.name, cid, block, chunk.key)
        for cid in touched:
            expected = ("device",) * (cid in side.pool.chunks) + ("redis",) * (cid in self.redis)
            assert side.engine.store.lookup(cid) == expected, (side.name, cid, expected)
        if side.pool.chunks:  # a resident chunk's canonical blocks still hold its KV
            cid = self.rng.choice(sorted(side.pool.chunks))
            got, want = side.core.store.device.peek(cid), self.ref_kv[cid]
            # (equal to float32 rounding: a chunk prefilled in one forward with others' tokens)
            close = torch.allclose(got.k, want.k, rtol=1e-4, atol=1e-5) and torch.allclose(
                got.v, want.v, rtol=1e-4, atol=1e-5
            )
            assert close, f"chunk {cid} of {side.name} overwritten"

    def reference(self, live: Live) -> tuple[torch.Tensor, list[int]]:
        """First-token logits and ``MAX_NEW`` greedy tokens of the same link on the reference engine."""
        key = (live.ids, live.policy, live.query, live.prefix)
        if key not in self.ref_out:
            linked = self.ref.link(list(live.ids), list(live.query), prefix=list(live.prefix), policy=live.policy)
            self.ref_out[key] = (linked.logits[-1].clone(), linked.generate(MAX_NEW).token_ids)
        return self.ref_out[key]

    # --- operations ----------------------------------------------------------------------------

    def run(self, num_ops: int) -> None:
        names, weights = zip(*WEIGHTS.items(), strict=True)
        for self.step in range(num_ops):
            op = self.rng.choices(names, weights)[0]
            side = self.sides[self.rng.random() < 0.4]
            self.ops[op] += 1
            try:
                touched = getattr(self, f"op_{op}")(side) or ()
                for s in self.sides:
                    self.check(s, touched if s is side else ())
                if self.step % 100 == 99:  # every id's tiers, now and then (one Redis call each)
                    for s in self.sides:
                        self.check(s, tuple(self.ids))
            except BaseException:
                print(f"soak failed at step {self.step}, op {op} on {side.name}")
                raise

    def pick_ids(self, side: Side, k: int) -> tuple[str, ...]:
        known = [cid for cid in self.ids if self.known(side, cid)]
        pool = known if known and self.rng.random() < 0.92 else self.ids
        if self.rng.random() < 0.1:
            return tuple(self.rng.choices(pool, k=k))  # repeats allowed
        return tuple(self.rng.sample(pool, min(k, len(pool))))

    def written_back(self, side: Side, ids: list[str], *, certain: bool) -> None:
        """A chunk compiled again for a link is written back to Redis on the engine's writer thread, after the link
        returns: wait for that thread, then expect each there (``certain``: the link compiled them all) or take
        what Redis says (a refused link may have compiled some of them)."""
        with side.engine.paused() as core:
            settled = core.loader.settled()
        settled.result(timeout=60)
        for cid in ids:
            held = "redis" in side.engine.store.lookup(cid)
            assert held or not certain, (side.name, cid, "compiled again but not written back")
            if held:
                self.redis.add(cid)
                self.seen["chunk compiled again and written back"] += 1

    def op_link(
        self, side: Side, ids: tuple[str, ...] | None = None, args: tuple | None = None, *, retry: bool = False
    ) -> tuple[str, ...]:
        ids = ids or self.pick_ids(side, self.rng.randint(1, 4))
        if args is None:
            prefix = tuple(self.rng.randrange(3, 512) for _ in range(self.rng.randint(1, 10)))
            args = (self.rng.choice(POLICIES), self.rng.choice(QUERIES), prefix if self.rng.random() < 0.2 else ())
        policy, query, prefix = args
        linkable = all(self.known(side, cid) or cid in side.recipes for cid in ids)
        # A chunk no tier holds that the engine compiled or linked before is compiled again from its tokens: chunk
        # by chunk, so a link refused for room may leave some of them resident.
        recompiles = linkable and not all(self.known(side, cid) for cid in ids)
        unknown = [cid for cid in dict.fromkeys(ids) if not self.known(side, cid)]
        num_private, promoted, clean = self.link_need(side, ids, policy, query, prefix)
        available = self.available(side, {cid for cid in ids if cid in side.pool.chunks})
        was_resident = {cid for cid in ids if cid in side.pool.chunks}
        before = _snapshot(side.pool)
        try:
            linked = side.engine.link(list(ids), list(query), prefix=list(prefix), policy=policy)
        except pic.UnknownCacheIdError:
            assert not linkable, ids
            assert _snapshot(side.pool) == before
            self.seen["link UnknownCacheIdError"] += 1
            return ids
        except pic.KVPoolExhaustedError:
            assert linkable and (recompiles or num_private + promoted > available), (num_private, promoted, available)
            assert recompiles or _snapshot(side.pool) == before, "a refused link took blocks"
            self.written_back(side, unknown, certain=False)
            self.seen["link KVPoolExhaustedError"] += 1
            if not retry and self.rng.random() < 0.3:  # the same link once every live request is gone
                self.seen["retry after releasing all"] += 1
                for live in list(side.live):
                    self.release(side, live)
                self.check(side)
                return self.op_link(side, ids, args, retry=True)
            return ids
        assert linkable and (recompiles or num_private + promoted <= available), (num_private, promoted, available)
        self.seen["link compiled a chunk again from its tokens"] += recompiles
        self.written_back(side, unknown, certain=True)
        side.recipes |= set(ids)
        self.seen["link ok"] += 1
        self.seen["chunks promoted"] += len(set(ids) - was_resident)
        self.seen["promoted what the other engine compiled"] += sum(
            self.compiled_by.get(cid) not in (None, side.name) for cid in set(ids) - was_resident
        )
        assert all(cid in side.pool.chunks for cid in ids), "a linked chunk is not resident after link"
        table = linked.block_ids
        assert linked.num_private_blocks == num_private and linked.num_shared_blocks == len(table) - num_private
        chunk_blocks = {b for c in side.pool.chunks.values() for b in c.block_ids}
        for i, block in enumerate(table):  # clean chunk blocks mapped as they are, everything else private
            want = side.pool.chunks[clean[i][0]].block_ids[clean[i][1]] if i in clean else None
            assert block == want if i in clean else block not in chunk_blocks, (i, block, want)
        live = Live(linked, ids, policy, query, prefix, self.step, {table[i]: cid for i, (cid, _) in clean.items()})
        self.seen["retry ok after releasing all"] += retry
        side.live.append(live)
        if self.rng.random() < 0.1:
            logits, _ = self.reference(live)
            # equal to float32 rounding: the engine may prefill a chunk in one forward with others' tokens
            torch.testing.assert_close(linked.logits[-1], logits, rtol=0, atol=1e-4)
            self.seen["link logits checked"] += 1
        if len(side.live) > MAX_LIVE:
            self.release(side, side.live[0])
        return ids

    def release(self, side: Side, live: Live) -> None:
        live.linked.release()
        side.live.remove(live)

    def op_release(self, side: Side) -> None:
        if side.live:
            live = self.rng.choice(side.live)
            self.release(side, live)
            live.linked.release()  # idempotent

    def op_generate(self, side: Side) -> None:
        if not side.live:
            return
        live = self.rng.choice(side.live)
        n = self.rng.randint(1, MAX_NEW)
        out = live.linked.generate(n)
        side.live.remove(live)
        reason = out.stats.finish_reason
        self.seen[f"finish {reason.value}"] += 1
        assert reason in (pic.FinishReason.LENGTH, pic.FinishReason.EOS, pic.FinishReason.KV_POOL), reason
        if reason is pic.FinishReason.LENGTH:
            assert len(out.token_ids) == n
        elif reason is pic.FinishReason.EOS:
            assert out.token_ids[-1] in side.engine.eos_token_ids
        else:
            assert 0 < len(out.token_ids) < n
        if self.step - live.born >= 10 or self.rng.random() < 0.3:
            _, tokens = self.reference(live)
            assert out.token_ids == tokens[: len(out.token_ids)], (live, out.token_ids, tokens)
            self.seen["generation checked"] += 1
            self.seen["generation checked, lived >= 10 ops"] += self.step - live.born >= 10

    def op_stream(self, side: Side) -> None:
        if side.live:
            live = self.rng.choice(side.live)
            pieces = live.linked.stream(MAX_NEW)
            next(pieces, None)
            pieces.close()  # closing early releases the request
            side.live.remove(live)
            try:
                live.linked.generate(1)
            except pic.LinkedReleasedError:
                self.seen["stream closed early"] += 1
            else:
                raise AssertionError("a closed stream's request is still usable")

    def op_compile(self, side: Side) -> tuple[str, ...]:
        chosen = self.rng.sample(range(len(self.docs)), self.rng.randint(1, 3))
        if self.rng.random() < 0.1:
            chosen.append(chosen[0])  # the same document twice in one call
        ids = tuple(self.ids[i] for i in chosen)
        todo = [cid for cid in ids if not self.known(side, cid)]
        need = max((self.num_chunk_blocks(cid) for cid in todo), default=0)  # Redis takes each: one at a time
        available = self.available(side, set(ids))
        before = _snapshot(side.pool)
        try:
            got = side.engine.compile([self.docs[i] for i in chosen])
        except pic.KVPoolExhaustedError:
            assert todo and need > available, (todo, need, available)
            assert _snapshot(side.pool) == before, "a refused compile took blocks"
            self.seen["compile KVPoolExhaustedError"] += 1
            return ids
        assert tuple(got) == ids and need <= available, (need, available)
        side.recipes |= set(ids)
        self.seen["compile ok"] += 1
        self.seen["chunks compiled"] += len(todo)
        self.redis |= set(ids)  # compiled through, or (resident already) written back where Redis lost it
        self.compiled_by.update(dict.fromkeys(todo, side.name))
        return ids

    def op_expire(self, side: Side) -> tuple[str, ...]:
        mapped = sorted({cid for live in side.live for cid in live.ids})
        cid = self.rng.choice(mapped if mapped and self.rng.random() < 0.5 else self.ids)
        known = self.known(side, cid)
        chunk = side.pool.chunks.get(cid)
        self.seen["expired while mapped"] += chunk is not None and chunk.num_refs > 0
        assert side.engine.store.expire(cid) == known, (side.name, cid)
        self.redis.discard(cid)
        side.pinned.discard(cid)
        side.recipes.discard(cid)
        self.expired[side.name, cid] = self.step
        self.seen["expired"] += 1
        return (cid,)

    def op_pin(self, side: Side) -> tuple[str, ...]:
        if len(side.pinned) >= MAX_PINNED:
            self.op_unpin(side)
        cid = self.rng.choice(self.ids)
        before = _snapshot(side.pool)
        try:
            side.engine.store.pin(cid)
        except pic.UnknownCacheIdError:
            assert not self.known(side, cid)
            assert _snapshot(side.pool) == before
            self.seen["pin UnknownCacheIdError"] += 1
            return (cid,)
        assert self.known(side, cid)
        side.pinned.add(cid)
        self.seen["pinned"] += 1
        return (cid,)

    def op_unpin(self, side: Side) -> tuple[str, ...]:
        if not side.pinned:
            return ()
        cid = self.rng.choice(sorted(side.pinned))
        side.engine.store.unpin(cid)
        side.pinned.discard(cid)
        self.seen["unpinned"] += 1
        return (cid,)

    def op_reset_peak(self, side: Side) -> None:
        side.engine.reset_peak()
        stats = side.engine.kv_stats()
        assert stats.peak_used_blocks == stats.num_used_blocks

    def op_squeeze(self, side: Side) -> None:
        """Fill every free block with one-block requests: a compile of a new chunk is refused, and a
        request decoding past its last block stops with ``KV_POOL`` (its tokens so far kept)."""
        if not any(live.query == BOUNDARY_QUERY for live in side.live):
            args = (self.rng.choice(POLICIES), BOUNDARY_QUERY, ())
            self.op_link(side, self.pick_ids(side, self.rng.randint(1, 2)), args)
        fillers = []
        while True:
            try:
                linked = side.engine.link([], [7])
            except pic.KVPoolExhaustedError:
                break
            fillers.append(Live(linked, (), side.engine.default_policy.spec, (7,), (), self.step))
            side.live.append(fillers[-1])
        self.seen["squeezed"] += 1
        self.check(side)
        assert side.engine.kv_stats().num_available_blocks == 0
        self.op_compile(side)
        for live in [live for live in side.live if live.query == BOUNDARY_QUERY][:1]:
            out = live.linked.generate(MAX_NEW)  # slots 14 and 15 of its last block, then no block for 16
            side.live.remove(live)
            want = self.reference(live)[1][:3]
            if any(t in side.engine.eos_token_ids for t in want):
                assert out.stats.finish_reason is pic.FinishReason.EOS and out.token_ids == want[: len(out.token_ids)]
            else:
                assert out.stats.finish_reason is pic.FinishReason.KV_POOL and out.token_ids == want, (out, want)
                self.seen["squeezed decode stopped: kv_pool"] += 1
        self.check(side)
        for live in fillers:
            self.release(side, live)

    def op_fresh_engine(self, side: Side) -> None:
        """A new worker with an empty pool links what the others compiled, straight out of Redis."""
        if not self.redis:
            return
        fresh = self._engine(share=self.rng.random() < 0.5, pool_tokens=POOL_TOKENS["copy"])
        ids = tuple(self.rng.sample(sorted(self.redis), min(3, len(self.redis))))
        policy, query = self.rng.choice(POLICIES), self.rng.choice(QUERIES)
        live = Live(fresh.link(list(ids), list(query), policy=policy), ids, policy, query, (), self.step)
        assert all(fresh.store.lookup(cid) == ("device", "redis") for cid in ids)
        check_engine_pool(fresh, dict(collections.Counter(live.linked.block_ids)))
        out = live.linked.generate(MAX_NEW)
        assert out.token_ids == self.reference(live)[1]
        check_engine_pool(fresh, {})
        assert fresh.kv_stats().num_used_blocks == 0
        self.seen["fresh engine linked from redis"] += 1

    def finish(self) -> None:
        """Release everything: every block is free or evictable but those of pinned chunks."""
        for side in self.sides:
            for live in list(side.live):
                self.release(side, live)
            check_pool(side.pool, {})
            self.check(side, tuple(self.ids))
            stats = side.engine.kv_stats()
            pinned = sum(len(c.blocks) for key, c in side.pool.chunks.items() if key in side.pinned)
            assert stats.num_used_blocks == pinned and stats.num_private_blocks == 0
            assert stats.num_shared_block_refs == 0
            assert stats.num_available_blocks == stats.num_blocks - pinned
            for cid in sorted(side.pinned):
                side.engine.store.unpin(cid)
            side.pinned.clear()
            check_pool(side.pool, {})
            assert side.engine.kv_stats().num_used_blocks == 0


@pytest.mark.slow
def test_soak(redis_url):
    start = time.perf_counter()
    soak = Soak(redis_url, SEED)
    soak.run(NUM_OPS)
    soak.finish()
    elapsed = time.perf_counter() - start
    evicted = {side.name: side.engine.kv_stats().num_evicted_chunks for side in soak.sides}
    print(f"\nsoak: {sum(soak.ops.values())} ops in {elapsed:.1f}s; evicted {evicted}")
    print("ops:", dict(sorted(soak.ops.items())))
    print("seen:", dict(sorted(soak.seen.items())))

    assert sum(soak.ops.values()) >= 1000
    assert all(n > 0 for n in evicted.values()), evicted  # the pools were under pressure
    for what in (
        "link KVPoolExhaustedError",
        "compile KVPoolExhaustedError",
        "link UnknownCacheIdError",
        "link compiled a chunk again from its tokens",
        "retry ok after releasing all",
        "chunks promoted",
        "promoted what the other engine compiled",
        "squeezed decode stopped: kv_pool",
        "generation checked, lived >= 10 ops",
        "link logits checked",
        "stream closed early",
        "fresh engine linked from redis",
        "expired while mapped",
        "pinned",
        "unpinned",
        "pin UnknownCacheIdError",
    ):
        assert soak.seen[what] > 0, f"the soak never saw {what!r}: {dict(soak.seen)}"
