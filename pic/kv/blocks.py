"""Blocks, the resident chunks they belong to, the owners they are charged to, and the O(1) free queue that orders
them for reuse.

The four are one idea: a block points at its chunk, a chunk lists its blocks, an owner (a namespace) keeps its
evictable chunks in the order they were released, and the queue links plain free blocks through fields of their own
(an intrusive doubly-linked list, vLLM v1's ``FreeKVCacheBlockQueue``). An unreferenced chunk's blocks are in no
queue: they wait, still holding the chunk's KV, among their owner's evictable chunks, so a request that links the
chunk takes it back with one operation on the chunk, not one per block. A block's reference count lives in its
pool's array (``BlockPool``: counted in bulk over a block table), read here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

import numpy as np


class Block:
    """One physical KV block's bookkeeping (the KV itself lives in ``KVCache``). ``ref_cnt``: block tables that
    map it (a shared chunk block: the requests aliasing it, plus holds taken while a request is assembled), read
    from ``refs``, the pool's counts by block id (a block of no pool, a queue's test, counts none); ``chunk``: the
    resident chunk it belongs to; ``owner``: the namespace it is charged to while in use or resident (who allocated
    it; a chunk block's is its chunk's); ``prev``, ``next``: the plain free queue's links (``None``: not in it).
    """

    __slots__ = ("block_id", "chunk", "owner", "prev", "next", "_refs")

    def __init__(self, block_id: int, refs: np.ndarray | None = None) -> None:
        self.block_id, self._refs = block_id, refs
        self.chunk: ResidentChunk | None = None
        self.owner = ""
        self.prev: Block | None = None
        self.next: Block | None = None

    @property
    def ref_cnt(self) -> int:
        return 0 if self._refs is None else int(self._refs[self.block_id])

    @property
    def is_queued(self) -> bool:
        """Whether it is in a plain free queue (a chunk's blocks never are)."""
        return self.prev is not None

    def __repr__(self) -> str:
        key = None if self.chunk is None else self.chunk.key
        return f"Block({self.block_id}, ref_cnt={self.ref_cnt}, chunk={key!r})"


class ResidentChunk:
    """A chunk's canonical blocks, in order (``ids``: their ids, a read-only int64 array, what a hold hands out).
    ``num_refs`` is the sum of its blocks' ``ref_cnt``: the chunk is evictable exactly when it is 0 and the chunk is
    not pinned. ``info`` is the caller's description of the chunk (tokens, options), kept alongside; ``owner``: its
    namespace, charged for its blocks; ``released``: when it last became evictable (the pool's clock: least recently
    used first across owners)."""

    __slots__ = ("key", "blocks", "ids", "num_refs", "pinned", "info", "owner", "released")

    def __init__(self, key: str, blocks: list[Block], info: object, *, owner: str = "") -> None:
        self.key, self.blocks, self.info, self.owner = key, blocks, info, owner
        self.ids = np.array([b.block_id for b in blocks], dtype=np.int64)  # (its blocks never change)
        self.ids.flags.writeable = False
        self.num_refs = sum(b.ref_cnt for b in blocks)
        self.pinned = False
        self.released = 0

    @property
    def block_ids(self) -> list[int]:
        return self.ids.tolist()

    @property
    def is_evictable(self) -> bool:
        return self.num_refs == 0 and not self.pinned


class Owner:
    """What one namespace has of the pool: ``usage``, the blocks charged to it (its resident chunks' blocks, evictable
    or not, and the private blocks it allocated that are still referenced); ``share``, the blocks its chunks keep
    against other owners (``floor(kv_share * num_blocks)``; 0: none); ``evictable``, its evictable chunks, least
    recently released first (O(1) to append, to take the first, and to remove any by key), with
    ``num_evictable`` blocks between them."""

    __slots__ = ("name", "share", "usage", "evictable", "num_evictable")

    def __init__(self, name: str, *, share: int = 0) -> None:
        self.name, self.share, self.usage = name, share, 0
        self.evictable: OrderedDict[str, ResidentChunk] = OrderedDict()
        self.num_evictable = 0

    @property
    def excess(self) -> int:
        """Blocks it holds beyond its share (0 at or under it): while above 0, others' work may evict its chunks."""
        return max(0, self.usage - self.share)

    @property
    def lru(self) -> ResidentChunk | None:
        """Its least recently released evictable chunk."""
        return next(iter(self.evictable.values()), None)

    def __repr__(self) -> str:
        return f"Owner({self.name!r}, usage={self.usage}, share={self.share}, evictable={self.num_evictable})"


class FreeBlockQueue:
    """Plain free blocks (of no chunk, no reference), in the order they are handed out (``popleft``): a block freed
    goes to the front, reused first, and so do an evicted chunk's. Every operation is O(1)."""

    def __init__(self, blocks: list[Block]) -> None:
        self._head, self._tail = Block(-1), Block(-1)  # sentinels: the list is never empty, no end is special
        self._head.next, self._tail.prev = self._tail, self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def popleft(self) -> Block:
        """The front block, taken (the caller checks ``len`` first)."""
        block = self._head.next
        assert block is not self._tail and block is not None, "popleft from an empty free queue"
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        assert block.prev is not None and block.next is not None, f"{block} is not in the free queue"
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self._len -= 1

    def append(self, block: Block) -> None:
        self._insert(block, after=self._tail.prev)

    def appendleft(self, block: Block) -> None:
        self._insert(block, after=self._head)

    def _insert(self, block: Block, *, after: Block | None) -> None:
        assert block.prev is None and after is not None and after.next is not None, f"{block} queued twice"
        block.prev, block.next = after, after.next
        after.next.prev = block
        after.next = block
        self._len += 1

    def __iter__(self) -> Iterator[Block]:
        """Front to back (for checks and tests; O(n))."""
        block = self._head.next
        while block is not self._tail and block is not None:
            yield block
            block = block.next
