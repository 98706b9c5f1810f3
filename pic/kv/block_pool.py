"""The block pool: ref-counted KV blocks, resident chunks, lazy LRU eviction. Pure Python, no tensors.

A compiled chunk lives in the pool as *canonical blocks* registered under its cache id. Requests map
a chunk's clean blocks into their block tables (a reference each, no copy) and own private blocks for
everything they write. A chunk no request references stays resident: its blocks wait at the back of
the free queue, still holding its KV, and are only reused when plain free blocks run out, least
recently used chunk first and a whole chunk at a time (a chunk missing one block is useless, so its
other blocks are freed with it). Pinned chunks never enter the queue, so they are never evicted.

The allocator decides *which* blocks; ``KVCache`` holds the KV tensors they index. Keeping them apart
lets a scheduler plan admission without touching a tensor, and tests check the accounting alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pic.errors import KVPoolExhaustedError
from pic.kv.blocks import Block, FreeBlockQueue, ResidentChunk


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
    (``block_size``: for messages only, the allocator never looks at tokens)."""

    def __init__(self, num_blocks: int, *, block_size: int) -> None:
        assert num_blocks > 0, num_blocks
        self.num_blocks, self.block_size = num_blocks, block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.chunks: dict[str, ResidentChunk] = {}  # cache id -> resident chunk
        self._peak_used = 0
        self.num_evicted_chunks = 0  # chunks evicted to make room

    @property
    def num_available_blocks(self) -> int:
        """Empty and evictable chunk blocks (the free queue)."""
        return len(self.free_queue)

    def is_resident(self, key: str) -> bool:
        return key in self.chunks

    def num_available(self, *, holding: Iterable[str] = ()) -> int:
        """Blocks an ``allocate`` could take after the caller holds the resident chunks ``holding``
        (holding an evictable chunk takes its blocks out of the free queue)."""
        held = {key: self.chunks[key] for key in holding if key in self.chunks}
        return len(self.free_queue) - sum(len(c.blocks) for c in held.values() if c.is_evictable)

    def check_available(self, num_blocks: int, *, holding: Iterable[str] = (), what: str) -> None:
        """Raises: KVPoolExhaustedError: ``num_blocks`` more cannot be allocated once ``holding`` is held (naming
        ``what``, the blocks it needs and those available)."""
        available = self.num_available(holding=holding)
        if num_blocks > self.num_blocks:
            raise KVPoolExhaustedError(
                f"KV pool too small: {what} needs {num_blocks} blocks of {self.block_size} tokens but the pool has "
                f"{self.num_blocks} in all; raise PICConfig.kv_pool_tokens to at least {num_blocks * self.block_size}"
            )
        if num_blocks > available:
            raise KVPoolExhaustedError(
                f"KV pool exhausted: {what} needs {num_blocks} blocks of {self.block_size} tokens but "
                f"{available} of {self.num_blocks} are available (empty or evictable; "
                f"{self.num_blocks - len(self.free_queue)} are held by live requests and pinned chunks); "
                f"raise PICConfig.kv_pool_tokens, or generate from / release pending Linked requests"
            )

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks, evicting least recently used chunks, whole, when no plain free block is left.

        Raises:
            KVPoolExhaustedError: fewer blocks are free or evictable; nothing is taken.
        """
        self.check_available(num_blocks, what="the request")
        taken = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            if block.chunk is not None:
                self._evict(block.chunk)
            block.ref_cnt = 1
            taken.append(block.block_id)
        self._note_used()
        return taken

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block. A private block with none left is free at once; a chunk
        with none left becomes evictable, most recently used."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_cnt > 0, f"{block} freed twice"
            block.ref_cnt -= 1
            chunk = block.chunk
            if chunk is None:
                if block.ref_cnt == 0:
                    self.free_queue.appendleft(block)  # before every chunk block: reused first
                continue
            chunk.num_refs -= 1
            if chunk.is_evictable:
                self._enqueue(chunk)

    def incref(self, block_ids: Iterable[int]) -> None:
        """One more reference to blocks of chunks the caller holds (mapping them into a block table)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.chunk is not None and block.chunk.num_refs > 0, f"{block} is not a held chunk block"
            block.ref_cnt += 1
            block.chunk.num_refs += 1

    def add_chunk(self, key: str, block_ids: list[int], info: object) -> None:
        """Make freshly allocated blocks the resident chunk ``key``. The caller's reference to each
        block becomes a hold on the chunk, released with ``free`` like any other."""
        assert key not in self.chunks, f"chunk {key} is already resident"
        blocks = [self.blocks[i] for i in block_ids]
        assert all(b.chunk is None and b.ref_cnt == 1 for b in blocks), "add_chunk takes freshly allocated blocks"
        chunk = ResidentChunk(key, blocks, info)
        for block in blocks:
            block.chunk = chunk
        self.chunks[key] = chunk

    def hold(self, key: str) -> list[int]:
        """A reference to every block of the resident chunk ``key`` (taking it out of the free queue,
        so nothing evicts it); returns its block ids. Release with ``free``."""
        chunk = self.chunks[key]
        if chunk.is_evictable:
            self._dequeue(chunk)
        for block in chunk.blocks:
            block.ref_cnt += 1
        chunk.num_refs += len(chunk.blocks)
        self._note_used()
        return chunk.block_ids

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
        keep them: they are freed when the last reference goes."""
        chunk = self.chunks.pop(key, None)
        if chunk is None:
            return False
        for block in chunk.blocks:
            block.chunk = None
            if block.is_queued:
                self.free_queue.remove(block)
            if block.ref_cnt == 0:
                self.free_queue.appendleft(block)
        return True

    def _enqueue(self, chunk: ResidentChunk) -> None:
        """A chunk just became evictable: its blocks go to the back, most recently used, together."""
        for block in chunk.blocks:
            self.free_queue.append(block)

    def _dequeue(self, chunk: ResidentChunk) -> None:
        """An evictable chunk is held or pinned: its blocks leave the queue, wherever they are."""
        for block in chunk.blocks:
            self.free_queue.remove(block)

    def _evict(self, chunk: ResidentChunk) -> None:
        """Forget an evictable chunk; its blocks stay in the queue as plain free blocks."""
        assert chunk.is_evictable, f"evicting chunk {chunk.key} that is in use or pinned"
        del self.chunks[chunk.key]
        for block in chunk.blocks:
            block.chunk = None
        self.num_evicted_chunks += 1

    def _note_used(self) -> None:
        self._peak_used = max(self._peak_used, self.num_blocks - len(self.free_queue))

    def reset_peak(self) -> None:
        """Start ``peak_used_blocks`` again from the blocks in use now."""
        self._peak_used = self.num_blocks - len(self.free_queue)

    def stats(self) -> KVStats:
        """Counts of the pool now (O(blocks of resident chunks))."""
        chunks = self.chunks.values()
        num_evictable = sum(len(c.blocks) for c in chunks if c.is_evictable)
        num_held_chunk = sum(len(c.blocks) for c in chunks if not c.is_evictable)
        return KVStats(
            num_blocks=self.num_blocks,
            num_empty_blocks=len(self.free_queue) - num_evictable,
            num_evictable_blocks=num_evictable,
            num_held_chunk_blocks=num_held_chunk,
            num_private_blocks=self.num_blocks - len(self.free_queue) - num_held_chunk,
            num_shared_block_refs=sum(c.num_refs for c in chunks),
            num_resident_chunks=len(self.chunks),
            num_evicted_chunks=self.num_evicted_chunks,
            peak_used_blocks=self._peak_used,
        )
