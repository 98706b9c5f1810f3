"""Invariants of a ``BlockPool``, checked from scratch (shared by the pool, sharing and soak tests)."""

from __future__ import annotations

from pic.kv import BlockPool


def check_pool(pool: BlockPool, expected_refs: dict[int, int] | None = None) -> None:
    """Assert every invariant of ``pool``'s bookkeeping; O(num_blocks).

    * The plain free queue is a well-formed doubly-linked list of distinct blocks and ``len`` counts them; a block
      is linked into it exactly when it is a plain block with no reference (``chunk is None`` and ``ref_cnt == 0``).
    * ``free_queue`` (the plain queue, then the evictable chunks' blocks) holds a block exactly when it is a plain
      block with no reference or a block of an evictable chunk (no reference, not pinned).
    * A resident chunk's blocks point back at it, and its ``num_refs`` is the sum of their ``ref_cnt``.
    * Plain free blocks precede every chunk block in the queue; each evictable chunk's blocks sit
      together, in the chunk's order.
    * ``stats()`` agrees: used = num_blocks - len(queue), chunk / evictable / private counts, shared
      references, and the peak is at least what is used now.
    * Owners: each block in use or resident is charged to its ``owner`` (a chunk's blocks to the chunk's), the
      owners' usage counts exactly those (their sum: used plus evictable blocks), an owner with nothing charged is
      kept only for its share; each owner's evictable chunks are its chunks of the queue, in the queue's order,
      released in that order; ``num_available`` never promises more than the queue holds, and exactly that when
      no owner has a share.

    Args:
        expected_refs: block id -> the references the caller's live mappings (block tables, holds)
            account for; every block's ``ref_cnt`` must equal ``expected_refs.get(block_id, 0)``.
    """
    plain = list(pool._plain)
    assert len(plain) == len(pool._plain), (len(plain), len(pool._plain))
    queue = pool.free_queue
    queued_ids = [b.block_id for b in queue]
    assert len(set(queued_ids)) == len(queued_ids), f"a block is queued twice: {queued_ids}"
    assert all(pool.blocks[i] is b for i, b in zip(queued_ids, queue, strict=True)), "a foreign block in the queue"
    assert queue[: len(plain)] == plain, "the plain free blocks are not first"
    for before, block, after in zip([None, *plain], plain, [*plain[1:], None], strict=False):  # [None] when empty
        assert block.prev is not None and block.next is not None, block
        assert before is None or block.prev is before, f"{block}.prev is not {before}"
        assert after is None or block.next is after, f"{block}.next is not {after}"
        assert before is not None or block.prev.block_id == -1, f"{block} is first but has a block before it"
        assert after is not None or block.next.block_id == -1, f"{block} is last but has a block after it"
    queued = set(queued_ids)

    for block in pool.blocks:
        assert block.ref_cnt >= 0, block
        assert (block.prev is None) == (block.next is None), f"{block} is half linked"
        assert block.is_queued == (block in plain), f"{block} is linked but not reachable from the plain queue"
        chunk = block.chunk
        if chunk is None:
            should_queue = block.ref_cnt == 0
        else:
            assert pool.chunks.get(chunk.key) is chunk, f"{block} belongs to a chunk that is not resident"
            assert any(b is block for b in chunk.blocks), f"{block} is not among its chunk's blocks"
            should_queue = chunk.is_evictable
            assert not block.is_queued, f"{block}: a chunk block in the plain queue"
        queued_here = block.block_id in queued
        assert queued_here == should_queue, f"{block}: queued {queued_here}, should be {should_queue}"
        if expected_refs is not None:
            assert block.ref_cnt == expected_refs.get(block.block_id, 0), (block, expected_refs.get(block.block_id, 0))
    if expected_refs is not None:
        assert all(0 <= i < pool.num_blocks for i in expected_refs), f"block ids out of range: {expected_refs}"

    for key, chunk in pool.chunks.items():
        assert chunk.key == key and chunk.blocks, chunk.key
        assert all(b.chunk is chunk for b in chunk.blocks), f"chunk {key} has a block that is not its own"
        assert len({b.block_id for b in chunk.blocks}) == len(chunk.blocks), f"chunk {key} repeats a block"
        assert chunk.num_refs == sum(b.ref_cnt for b in chunk.blocks), (key, chunk.num_refs)

    is_chunk = [b.chunk is not None for b in queue]
    assert is_chunk == sorted(is_chunk), f"a plain free block behind a chunk block: {queue}"
    first_chunk = is_chunk.index(True) if True in is_chunk else len(queue)
    rest = queue[first_chunk:]
    while rest:
        chunk = rest[0].chunk
        assert chunk is not None
        n = len(chunk.blocks)
        assert rest[:n] == chunk.blocks, f"chunk {chunk.key}'s blocks are not together and in order in the queue"
        rest = rest[n:]

    stats = pool.stats()
    chunks = list(pool.chunks.values())
    num_used = pool.num_blocks - len(queue)
    assert stats.num_blocks == pool.num_blocks == len(pool.blocks)
    assert stats.num_available_blocks == len(queue) and stats.num_used_blocks == num_used
    assert stats.num_resident_chunk_blocks == sum(len(c.blocks) for c in chunks)
    assert stats.num_evictable_blocks == sum(len(c.blocks) for c in chunks if c.is_evictable)
    assert stats.num_evictable_blocks == sum(is_chunk)
    assert stats.num_empty_blocks == sum(b.chunk is None for b in queue)
    queued = {b.block_id for b in queue}
    assert stats.num_held_chunk_blocks == sum(b.chunk is not None and b.block_id not in queued for b in pool.blocks)
    assert stats.num_shared_block_refs == sum(c.num_refs for c in chunks)
    assert stats.num_private_blocks == sum(b.chunk is None and b.ref_cnt > 0 for b in pool.blocks)
    assert stats.num_resident_chunks == len(chunks)
    assert stats.peak_used_blocks >= num_used
    assert pool.num_available_blocks == len(queue)
    check_owners(pool, queue)


def check_owners(pool: BlockPool, queue: list) -> None:
    """The owners' part of ``check_pool`` (``queue``: the free queue, front to back)."""
    usage: dict[str, int] = {}
    for block in pool.blocks:
        if block.chunk is not None:
            assert block.owner == block.chunk.owner, f"{block} is charged to {block.owner!r}, its chunk's is not"
        if block.chunk is not None or block.ref_cnt > 0:
            usage[block.owner] = usage.get(block.owner, 0) + 1
    assert {n: o.usage for n, o in pool.owners.items() if o.usage} == usage, (pool.owners, usage)
    assert all(o.usage or o.share for o in pool.owners.values()), f"an owner with nothing charged: {pool.owners}"
    assert all(n == o.name for n, o in pool.owners.items())
    stats = pool.stats()
    assert sum(usage.values()) == stats.num_used_blocks + stats.num_evictable_blocks
    assert sum(o.share for o in pool.owners.values()) <= pool.num_blocks
    queued_chunks = list(dict.fromkeys(b.chunk for b in queue if b.chunk is not None))
    assert [c.released for c in queued_chunks] == sorted({c.released for c in queued_chunks}), "released out of order"
    for name, owner in pool.owners.items():
        mine = [c for c in queued_chunks if c.owner == name]
        assert list(owner.evictable.values()) == mine, f"{owner}'s evictable chunks are not its queued ones in order"
        assert list(owner.evictable) == [c.key for c in mine]
        assert owner.num_evictable == sum(len(c.blocks) for c in mine), owner
    assert all(c.owner in pool.owners for c in queued_chunks)
    no_shares = not any(o.share for o in pool.owners.values())
    for name in {"", *pool.owners}:
        available = pool.num_available(owner=name)
        assert available <= len(queue) and (available == len(queue) or not no_shares), (name, available, len(queue))


def check_engine_pool(engine, expected_refs: dict[int, int] | None = None) -> None:
    """``check_pool`` of an engine's pool, read while the engine is paused between two steps."""
    with engine.paused() as core:
        check_pool(core.pool, expected_refs)
