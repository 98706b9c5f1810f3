"""The block pool: ref-counted KV blocks, resident chunks, lazy LRU eviction. Pure Python, no tensors.

A compiled chunk lives in the pool as *canonical blocks* registered under its cache id. Requests map
a chunk's clean blocks into their block tables (a reference each, no copy) and own private blocks for
everything they write. A chunk no request references stays resident: it waits among its owner's evictable
chunks, still holding its KV, and its blocks are only reused when plain free blocks run out, least
recently used chunk first and a whole chunk at a time (a chunk missing one block is useless, so its
other blocks are freed with it). Pinned chunks are never evictable.

References are counted in an array by block id, a whole block table in a few array operations, and a chunk's
count moves once per chunk (a 32K-token link maps 2,048 blocks of 64 chunks): the work of holding, mapping and
freeing a link's blocks does not grow per block in Python. Per block in Python is only what is per block anyway:
allocating private blocks, making a chunk resident, evicting or dropping one.

Owners: every block in use or resident is charged to a namespace (``pic.namespaces``): a private block to whoever
allocated it, a chunk's blocks to the chunk's namespace. An owner's *share* (``floor(kv_share * num_blocks)``,
``PICConfig.quotas``) is what its chunks keep against other owners. When ``owner`` needs blocks and no plain free
block is left, the pool evicts ``owner``'s own evictable chunks first, least recently used first, then other owners'
chunks, least recently used first among the owners over their share: an owner at or under its share never loses a
chunk to another owner's work, and one owner's churn evicts its own chunks before anyone else's. An owner *under*
its share takes back what it is owed first: other owners' chunks over their share go before its own until it holds
its share (else a namespace that came to a pool others had filled could never grow to its share: each of its
compiles would evict its last one). Without shares every owner is over its share of 0 as soon as it holds a block,
and with one owner eviction is least recently used first, as it was before owners. Each owner keeps its evictable
chunks in release order, so a victim is found in O(number of owners).

The allocator decides *which* blocks; ``KVCache`` holds the KV tensors they index. Keeping them apart
lets a scheduler plan admission without touching a tensor, and tests check the accounting alone.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from pic.errors import KVPoolExhaustedError
from pic.kv.blocks import Block, FreeBlockQueue, Owner, ResidentChunk


@dataclass(frozen=True)
class KVStats:
    """A snapshot of the pool (``PIC.kv_stats()``). Every block is in exactly one of four states, whose counts
    sum to ``num_blocks``: empty (never used, or freed); evictable (a resident chunk no request references and
    nobody pinned: its KV kept for the next link, taken, least recently used chunk first, once no empty block is
    left); held chunk (a resident chunk a live request references, or pinned); private (owned by live requests:
    prefix, query, decode, copy-on-write blocks). The other views are sums of those (properties, so they cannot
    disagree). ``num_shared_block_refs``: references of request block tables to chunk blocks;
    ``peak_used_blocks``: the most ``num_used_blocks`` since the pool was built or ``reset_peak()``.
    """

    num_blocks: int
    num_empty_blocks: int
    num_evictable_blocks: int
    num_held_chunk_blocks: int
    num_private_blocks: int
    num_shared_block_refs: int
    num_resident_chunks: int
    num_evicted_chunks: int
    peak_used_blocks: int

    def __post_init__(self) -> None:
        states = self.num_available_blocks + self.num_used_blocks
        assert states == self.num_blocks, f"block states sum to {states}, not num_blocks={self.num_blocks}"

    @property
    def num_available_blocks(self) -> int:
        """What a request can take now."""
        return self.num_empty_blocks + self.num_evictable_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_held_chunk_blocks + self.num_private_blocks

    @property
    def num_resident_chunk_blocks(self) -> int:
        return self.num_evictable_blocks + self.num_held_chunk_blocks


class BlockPool:
    """Hands out ``num_blocks`` blocks, counts references, keeps chunks resident until their blocks are needed
    (``block_size``: for messages only, the allocator never looks at tokens). ``kv_shares``: namespace -> the share
    of the blocks its chunks keep against other namespaces (``Quota.kv_share``; the shares sum to at most 1)."""

    def __init__(self, num_blocks: int, *, block_size: int, kv_shares: Mapping[str, float] | None = None) -> None:
        assert num_blocks > 0, num_blocks
        self.num_blocks, self.block_size = num_blocks, block_size
        self._refs = np.zeros(num_blocks, dtype=np.int64)  # block id -> references (``Block.ref_cnt``)
        self._chunk_of = np.full(num_blocks, -1, dtype=np.int64)  # block id -> its chunk's first block (-1: none)
        self.blocks = [Block(i, self._refs) for i in range(num_blocks)]
        self._plain = FreeBlockQueue(self.blocks)  # free blocks of no chunk; evictable chunks are their owners'
        self.chunks: dict[str, ResidentChunk] = {}  # cache id -> resident chunk
        # name -> Owner: every owner charged a block now, and every owner with a share (read-only outside the pool)
        self.owners: dict[str, Owner] = {}
        for name, share in (kv_shares or {}).items():
            blocks = math.floor(share * num_blocks + 1e-9)  # (0.29 * 100 is 28.999...)
            if blocks > 0:
                self.owners[name] = Owner(name, share=blocks)
        self._num_evictable = 0  # blocks of evictable chunks
        self._clock = 0  # counts chunks becoming evictable: their ``released`` order
        self._peak_used = 0
        self.num_evicted_chunks = 0  # chunks evicted to make room

    @property
    def num_available_blocks(self) -> int:
        """Empty and evictable chunk blocks, whoever's."""
        return len(self._plain) + self._num_evictable

    @property
    def free_queue(self) -> list[Block]:
        """The unreferenced blocks in the order the pool reuses them when no owner has a share: plain free blocks,
        then evictable chunks' blocks, least recently released chunk first (for checks and tests; O(blocks))."""
        evictable = sorted((c for o in self.owners.values() for c in o.evictable.values()), key=lambda c: c.released)
        return [*self._plain, *(b for chunk in evictable for b in chunk.blocks)]

    def is_resident(self, key: str) -> bool:
        return key in self.chunks

    def usage(self, owner: str = "") -> int:
        """Blocks charged to ``owner``: its resident chunks' (evictable or not) and its private blocks in use."""
        entry = self.owners.get(owner)
        return 0 if entry is None else entry.usage

    def share(self, owner: str = "") -> int:
        """Blocks ``owner``'s chunks keep against other owners (0: no quota)."""
        entry = self.owners.get(owner)
        return 0 if entry is None else entry.share

    def num_available(self, *, holding: Iterable[str] = (), owner: str = "") -> int:
        """Blocks an ``allocate`` for ``owner`` can take after the caller holds the resident chunks ``holding`` (holding
        an evictable chunk takes its blocks out of the free queue): plain free blocks, ``owner``'s evictable chunks,
        and what other owners' evictable chunks give before each is back at its share. In O(number of owners): a
        lower bound where a whole chunk would take an owner below its share (``check_available`` counts those)."""
        held = self._held_evictable(holding)
        total = self._num_plain
        for entry in self.owners.values():
            if entry.num_evictable:
                evictable = entry.num_evictable - held[entry.name]
                total += evictable if entry.name == owner else min(evictable, entry.excess)
        return total

    def check_available(self, num_blocks: int, *, holding: Iterable[str] = (), what: str, owner: str = "") -> None:
        """Raises: KVPoolExhaustedError: ``num_blocks`` more cannot be allocated for ``owner`` once ``holding`` is held
        (naming ``what``, the blocks it needs and those available, and the blocks other owners' shares keep)."""
        holding = list(holding)
        if num_blocks > self.num_blocks:
            raise KVPoolExhaustedError(
                f"KV pool too small: {what} needs {num_blocks} blocks of {self.block_size} tokens but the pool has "
                f"{self.num_blocks} in all; raise PICConfig.kv_pool_tokens to at least {num_blocks * self.block_size}"
            )
        if num_blocks <= self.num_available(holding=holding, owner=owner):
            return
        available, kept = self._available_exactly(holding, owner)
        if num_blocks <= available:
            return
        whose = f" to namespace {owner!r}" if owner else ""
        shares = (
            f"; {kept} blocks of other namespaces' evictable chunks are kept for them (within their kv_share, "
            "PICConfig.quotas)"
            if kept
            else ""
        )
        raise KVPoolExhaustedError(
            f"KV pool exhausted: {what} needs {num_blocks} blocks of {self.block_size} tokens but "
            f"{available} of {self.num_blocks} are available{whose} (empty or evictable; "
            f"{self.num_blocks - self.num_available_blocks} are held by live requests and pinned chunks{shares}); "
            f"raise PICConfig.kv_pool_tokens, or generate from / release pending Linked requests"
        )

    def allocate(self, num_blocks: int, *, owner: str = "") -> list[int]:
        """Take ``num_blocks`` blocks for ``owner`` (charged to it): plain free blocks first, then whole chunks evicted,
        ``owner``'s own least recently used first, then other owners' over their share, least recently used first
        (those before its own while ``owner`` holds less than its share).

        Raises:
            KVPoolExhaustedError: fewer blocks are free or evictable for ``owner``; nothing is taken.
        """
        self.check_available(num_blocks, what="the request", owner=owner)
        taken = []
        for _ in range(num_blocks):
            if self._num_plain == 0:
                self._evict(self._victim(owner))
            block = self._plain.popleft()
            block.owner = owner
            self._owner(owner).usage += 1  # (looked up again: evicting its last chunk may have forgotten it)
            taken.append(block.block_id)
        self._refs[taken] = 1
        self._note_used()
        return taken

    def free(self, block_ids: Iterable[int] | np.ndarray) -> None:
        """Drop one reference to each block (an id listed twice loses two). A private block with none left is free at
        once (no longer charged to its owner), the last freed reused first; a chunk with none left becomes
        evictable, most recently used (chunks freed together: in the order of their last block here)."""
        ids = _as_ids(block_ids)
        if not ids.size:
            return
        refs = self._refs
        np.subtract.at(refs, ids, 1)
        if refs[ids].min() < 0:
            np.add.at(refs, ids, 1)
            raise AssertionError(f"blocks freed twice among {ids.tolist()}")
        firsts = self._chunk_of[ids]
        private = ids[firsts < 0]
        for block_id in dict.fromkeys(private[refs[private] == 0].tolist()):  # (once each, in the order given)
            block = self.blocks[block_id]
            self._plain.appendleft(block)
            self._uncharge(block.owner, 1)
        for chunk, num_refs in self._by_chunk(firsts[firsts >= 0], ordered=True):
            chunk.num_refs -= num_refs
            if chunk.is_evictable:
                self._enqueue(chunk)

    def incref(self, block_ids: Iterable[int] | np.ndarray) -> None:
        """One more reference to blocks of chunks the caller holds (mapping them into a block table)."""
        ids = _as_ids(block_ids)
        firsts = self._chunk_of[ids]
        assert (firsts >= 0).all(), f"not a held chunk block among {ids.tolist()}: of no chunk"
        for chunk, num_refs in self._by_chunk(firsts, ordered=False):
            assert chunk.num_refs > 0, f"not a held chunk block among {ids.tolist()}: chunk {chunk.key} is not held"
            chunk.num_refs += num_refs
        np.add.at(self._refs, ids, 1)

    def _by_chunk(self, firsts: np.ndarray, *, ordered: bool) -> list[tuple[ResidentChunk, int]]:
        """The chunks named by ``firsts`` (blocks' chunks, by first block), each with the times it is named;
        ``ordered``: in the order of each one's last place in ``firsts`` (where a loop over the blocks would be done
        with it), else in any order."""
        if not firsts.size:
            return []
        if not ordered:
            keys, counts = np.unique(firsts, return_counts=True)
        else:
            keys, where, counts = np.unique(firsts[::-1], return_index=True, return_counts=True)
            order = np.argsort(-where, kind="stable")
            keys, counts = keys[order], counts[order]
        blocks = self.blocks
        return [(blocks[k].chunk, n) for k, n in zip(keys.tolist(), counts.tolist(), strict=True)]

    def add_chunk(self, key: str, block_ids: list[int], info: object, *, owner: str | None = None) -> None:
        """Make freshly allocated blocks the resident chunk ``key`` of ``owner`` (``None``: the namespace of
        ``info.options``, else the default one), charged to it from now on. The caller's reference to each block
        becomes a hold on the chunk, released with ``free`` like any other."""
        assert key not in self.chunks, f"chunk {key} is already resident"
        blocks = [self.blocks[i] for i in block_ids]
        assert all(b.chunk is None and b.ref_cnt == 1 for b in blocks), "add_chunk takes freshly allocated blocks"
        owner = namespace_of(info) if owner is None else owner
        chunk = ResidentChunk(key, blocks, info, owner=owner)
        for block in blocks:
            if block.owner != owner:  # (allocated by another owner's work: a request promoting a shared chunk)
                self._uncharge(block.owner, 1)
                self._owner(owner).usage += 1
                block.owner = owner
            block.chunk = chunk
        self._chunk_of[chunk.ids] = chunk.ids[0]
        self.chunks[key] = chunk

    def hold(self, key: str) -> np.ndarray:
        """A reference to every block of the resident chunk ``key`` (no longer evictable, so nothing evicts it);
        returns its block ids (``ResidentChunk.ids``, read-only). Release with ``free``."""
        chunk = self.chunks[key]
        if chunk.is_evictable:
            self._dequeue(chunk)
        self._refs[chunk.ids] += 1
        chunk.num_refs += len(chunk.blocks)
        self._note_used()
        return chunk.ids

    def pin(self, key: str) -> bool:
        """Never evict chunk ``key``; ``False`` if it is not resident."""
        chunk = self.chunks.get(key)
        if chunk is None:
            return False
        if chunk.is_evictable:
            self._dequeue(chunk)
        chunk.pinned = True
        self._note_used()
        return True

    def unpin(self, key: str) -> None:
        chunk = self.chunks.get(key)
        if chunk is not None and chunk.pinned:
            chunk.pinned = False
            if chunk.is_evictable:
                self._enqueue(chunk)

    def drop(self, key: str) -> bool:
        """Forget chunk ``key`` (expiry); ``True`` if it was resident. Requests mapping its blocks
        keep them (still charged to the chunk's owner): they are freed when the last reference goes."""
        chunk = self.chunks.get(key)
        if chunk is None:
            return False
        if chunk.is_evictable:
            self._dequeue(chunk)
        del self.chunks[key]
        self._chunk_of[chunk.ids] = -1
        for block in chunk.blocks:
            block.chunk = None
            if block.ref_cnt == 0:
                self._plain.appendleft(block)
                self._uncharge(block.owner, 1)
        return True

    @property
    def _num_plain(self) -> int:
        """Free blocks of no chunk."""
        return len(self._plain)

    def _owner(self, name: str) -> Owner:
        entry = self.owners.get(name)
        if entry is None:
            entry = self.owners[name] = Owner(name)
        return entry

    def _uncharge(self, name: str, num_blocks: int) -> None:
        """``num_blocks`` of ``name``'s are free again; an owner with nothing charged and no share is forgotten."""
        entry = self.owners[name]
        entry.usage -= num_blocks
        assert entry.usage >= 0, entry
        if entry.usage == 0 and entry.share == 0:
            del self.owners[name]

    def _held_evictable(self, holding: Iterable[str]) -> Counter[str]:
        """Owner -> blocks of the evictable chunks among ``holding`` (each counted once)."""
        held: Counter[str] = Counter()
        for key in set(holding):
            chunk = self.chunks.get(key)
            if chunk is not None and chunk.is_evictable:
                held[chunk.owner] += len(chunk.blocks)
        return held

    def _available_exactly(self, holding: list[str], owner: str) -> tuple[int, int]:
        """What ``num_available`` bounds, counted chunk by chunk (each other owner gives its least recently used
        chunks, whole, while it is over its share), and the evictable blocks other owners' shares keep from
        ``owner``. O(the evictable chunks walked): only when the bound is short."""
        held, held_blocks = set(holding), self._held_evictable(holding)
        available, kept = self._num_plain, 0
        for entry in self.owners.values():
            if entry.name == owner:
                available += entry.num_evictable - held_blocks[owner]
                continue
            usage = entry.usage
            for key, chunk in entry.evictable.items():
                if key in held:
                    continue
                if usage > entry.share:
                    available += len(chunk.blocks)
                    usage -= len(chunk.blocks)
                else:
                    kept += len(chunk.blocks)
        return available, kept

    def _victim(self, owner: str) -> ResidentChunk:
        """The chunk to evict for ``owner``: its own least recently used, else the least recently used of the owners
        over their share; those first while ``owner`` is under its share (``check_available`` made sure there is
        one or the other)."""
        own = self.owners.get(owner)
        mine = None if own is None else own.lru
        if mine is not None and own.usage >= own.share:  # type: ignore[union-attr]
            return mine
        victim: ResidentChunk | None = None
        for entry in self.owners.values():
            if entry.name != owner and entry.usage > entry.share and entry.evictable:
                chunk = entry.lru
                if victim is None or chunk.released < victim.released:  # type: ignore[union-attr]
                    victim = chunk
        victim = victim or mine
        assert victim is not None, f"no chunk to evict for {owner!r}: an allocate beyond its check"
        return victim

    def _enqueue(self, chunk: ResidentChunk) -> None:
        """A chunk just became evictable: to the back of its owner's evictable chunks, most recently used."""
        self._clock += 1
        chunk.released = self._clock
        entry = self.owners[chunk.owner]
        entry.evictable[chunk.key] = chunk
        entry.num_evictable += len(chunk.blocks)
        self._num_evictable += len(chunk.blocks)

    def _dequeue(self, chunk: ResidentChunk) -> None:
        """An evictable chunk is held, pinned or dropped: it leaves its owner's evictable chunks, wherever it is."""
        entry = self.owners[chunk.owner]
        del entry.evictable[chunk.key]
        entry.num_evictable -= len(chunk.blocks)
        self._num_evictable -= len(chunk.blocks)

    def _evict(self, chunk: ResidentChunk) -> None:
        """Forget an evictable chunk; its blocks go to the front of the queue as plain free blocks (taken next), no
        longer charged to its owner."""
        assert chunk.is_evictable, f"evicting chunk {chunk.key} that is in use or pinned"
        self._dequeue(chunk)
        del self.chunks[chunk.key]
        self._chunk_of[chunk.ids] = -1
        for block in reversed(chunk.blocks):
            block.chunk = None
            self._plain.appendleft(block)
        self._uncharge(chunk.owner, len(chunk.blocks))
        self.num_evicted_chunks += 1

    def _note_used(self) -> None:
        self._peak_used = max(self._peak_used, self.num_blocks - self.num_available_blocks)

    def reset_peak(self) -> None:
        """Start ``peak_used_blocks`` again from the blocks in use now."""
        self._peak_used = self.num_blocks - self.num_available_blocks

    def audit(self, references: Counter[int]) -> str | None:
        """Whether the pool adds up with ``references`` (block id -> the references its holders know of: block
        tables, holds, blocks set aside, prefills): every block's count equal to them, every chunk's ``num_refs`` the
        sum of its blocks', the plain free queue exactly the unreferenced blocks of no chunk and the owners'
        evictable chunks exactly the unreferenced unpinned ones, each owner charged its blocks. ``None`` when it
        does, else the first thing that does not (a failed step's check: ``EngineCore``). O(blocks)."""
        charged: Counter[str] = Counter()
        for block in self.blocks:
            if block.ref_cnt != (known := references[block.block_id]):
                return f"block {block.block_id} has {block.ref_cnt} references, its holders {known}"
            chunk = block.chunk
            if chunk is not None and self.chunks.get(chunk.key) is not chunk:
                return f"block {block.block_id} belongs to chunk {chunk.key[:12]}, which is not resident"
            if (block.ref_cnt == 0 and chunk is None) != block.is_queued:
                state = ("unused", "not queued") if not block.is_queued else ("in use", "queued")
                return f"block {block.block_id} is {state[0]} but {state[1]}"
            if block.ref_cnt or chunk is not None:
                charged[block.owner] += 1
        evictable = {key for entry in self.owners.values() for key in entry.evictable}
        for chunk in self.chunks.values():
            if chunk.num_refs != sum(b.ref_cnt for b in chunk.blocks):
                return f"chunk {chunk.key[:12]} counts {chunk.num_refs} references, its blocks others"
            if chunk.is_evictable != (chunk.key in evictable):
                state = "" if chunk.is_evictable else "not "
                return f"chunk {chunk.key[:12]} is {state}evictable, its owner's list not"
        usage = Counter({name: entry.usage for name, entry in self.owners.items() if entry.usage})
        return None if usage == charged else f"owners are charged {dict(usage)}, their blocks {dict(charged)}"

    def stats(self) -> KVStats:
        """Counts of the pool now (O(blocks of resident chunks))."""
        chunks = self.chunks.values()
        num_evictable = sum(len(c.blocks) for c in chunks if c.is_evictable)
        num_held_chunk = sum(len(c.blocks) for c in chunks if not c.is_evictable)
        return KVStats(
            num_blocks=self.num_blocks,
            num_empty_blocks=len(self._plain),
            num_evictable_blocks=num_evictable,
            num_held_chunk_blocks=num_held_chunk,
            num_private_blocks=self.num_blocks - len(self._plain) - num_evictable - num_held_chunk,
            num_shared_block_refs=sum(c.num_refs for c in chunks),
            num_resident_chunks=len(self.chunks),
            num_evicted_chunks=self.num_evicted_chunks,
            peak_used_blocks=self._peak_used,
        )


def _as_ids(block_ids: Iterable[int] | np.ndarray) -> np.ndarray:
    """``[n]`` int64 block ids: an array as it is, any other iterable of ints copied into one."""
    if isinstance(block_ids, np.ndarray):
        return block_ids
    return np.fromiter(block_ids, dtype=np.int64)


def namespace_of(info: object) -> str:
    """The namespace of a chunk described by ``info`` (a ``ChunkInfo``'s ``options.namespace``; ``""``, the default
    one, for anything without options, as the pool's tests describe chunks)."""
    return getattr(getattr(info, "options", None), "namespace", "")
