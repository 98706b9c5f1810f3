"""``KVManager``: the one owner of the KV pool's blocks (vLLM's KVCacheManager in front of its BlockPool), for linked
requests, chunk compiles and the store's device tier alike: nothing else calls a method of ``BlockPool`` that
changes it (a test walks pic/ for one). The scheduler decides *who* runs; the KV manager does the pool work its
decisions need and writes each sequence's ``SeqBlocks`` (nothing else does); compile calls hold and free their
chunks through it; the device tier (``pic.store.device``, which it builds) makes chunks resident, promotes, drops
and pins them through it; a ``RequestKV`` or a ``ChunkPrefill`` keeps no pool and hands back the blocks it lets go.
The ``Linker`` asks it ``is_resident`` when it counts what a request takes.

Whose blocks: a request's work is its namespace's (``seq.request.access.own.name``), a compile's the namespace of its
chunks (``options.namespace``): the pool charges them their blocks and evicts their own chunks first for them
(``BlockPool``'s owners), and every check here asks for the same owner as the allocation it guards."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

import numpy as np

from pic.compile import ChunkPrefill, lead_tokens, prefill_blocks
from pic.engine.core.sequence import SeqBlocks, Sequence
from pic.engine.request import CompileJob
from pic.kv import BlockPool, ChunkInfo, ChunkKV, KVCache, RequestKV, blocks_for
from pic.link.assemble import Assembly, AssemblyPlan, block_table
from pic.link.linker import LinkPlan
from pic.store import TieredStore
from pic.store.device import DeviceTier


class KVManager:
    """Block-level work on sequences, chunk prefills and resident chunks; ``store_over`` builds the chunk store over
    the device tier this manager writes (``self.store``: it promotes chunks from the lower tiers into ``pool``);
    ``kv_bytes_per_token``: K and V bytes of one token (what a chunk takes in a lower tier)."""

    def __init__(
        self,
        pool: BlockPool,
        cache: KVCache,
        *,
        store_over: Callable[[DeviceTier], TieredStore],
        block_size: int,
        kv_bytes_per_token: int,
    ) -> None:
        self.pool, self.cache, self._block_size = pool, cache, block_size
        self._kv_bytes_per_token = kv_bytes_per_token
        self.store = store_over(DeviceTier(self, cache))

    def can_allocate(self, seq: Sequence, plan: LinkPlan) -> bool:
        """Whether the pool holds ``plan`` (and the blocks its probe's second pass may copy)."""
        needed, to_hold = self._needs(seq, plan)
        return self.pool.num_available(holding=to_hold, owner=owner_of(seq)) >= needed

    @staticmethod
    def _needs(seq: Sequence, plan: LinkPlan) -> tuple[int, list[str]]:
        """The blocks ``plan`` takes, and the resident chunks it holds that ``seq`` does not hold yet."""
        to_hold = [cid for cid in plan.assembly.resident if cid not in seq.blocks.held]
        return plan.assembly.num_blocks_needed + plan.num_reserved, to_hold

    def is_resident(self, cache_id: str) -> bool:
        return self.pool.is_resident(cache_id)

    def allocate(self, seq: Sequence, plan: LinkPlan) -> Assembly:
        """Take the blocks (shared chunk blocks mapped, dirty ones copied, and a probe's possible copies set aside:
        ``SeqBlocks.reserved``); the sequence's holds become its table's references. ``KVPoolExhaustedError`` when
        ``can_allocate`` is false (the blocks needed and available; nothing is taken)."""
        needed, to_hold = self._needs(seq, plan)
        owner = owner_of(seq)
        self.pool.check_available(needed, holding=to_hold, what=plan.assembly.describe(), owner=owner)
        blocks = seq.blocks
        assembly = self._assemble(plan.assembly, held=blocks.held, to_hold=to_hold, owner=owner)
        blocks.held, blocks.kv, blocks.shared = {}, assembly.req, plan.assembly.shared
        blocks.reserved = self.pool.allocate(plan.num_reserved, owner=owner)
        if seq.link.first_pass is None:  # (the figures of its first pass: a link's, reported by LinkOutput)
            blocks.num_shared, blocks.num_private = assembly.num_shared_blocks, assembly.num_private_blocks
        return assembly

    def _assemble(self, plan: AssemblyPlan, *, held: dict[str, np.ndarray], to_hold: list[str], owner: str) -> Assembly:
        """Hold or promote the chunks, then build the block table (``pic.link.assemble``): ``held`` are the chunks
        the sequence holds already (it keeps them resident while it waits), whose references its table takes over;
        ``owner``: the request's namespace; nothing is taken if this raises. The table's references are taken in
        bulk, per chunk and in arrays, not per block."""
        layout, pool = plan.layout, self.pool
        held, taken, private, mapped = dict(held), {}, [], _NO_BLOCKS
        try:
            for cid in to_hold:
                taken[cid] = pool.hold(cid)
            for cid, chunk in plan.to_promote.items():
                taken[cid] = np.array(self.store.promote(chunk, owner=owner))  # (charged to the chunk's namespace)
            held |= taken
            private = pool.allocate(plan.num_private, owner=owner)
            canonical = [held[c.cache_id] for c in plan.chunks]
            num_blocks = blocks_for(layout.num_slots, layout.block_size)
            table, sources, copies = block_table(
                num_blocks, plan.shared, plan.chunk_blocks, canonical, private, plan.rewritten
            )
            mapped = table[plan.shared]
            pool.incref(mapped)
            self.cache.copy_blocks(sources.tolist(), copies.tolist())
        except BaseException:
            pool.free(mapped)
            pool.free(private)
            pool.free(_joined(taken.values()))
            raise
        req = RequestKV(self.cache, table, num_slots=layout.num_slots, held=_joined(held.values()))
        return Assembly(req, layout, canonical, num_shared_blocks=len(plan.shared), num_private_blocks=plan.num_private)

    def copy_written(self, seq: Sequence, written: list[int]) -> None:
        """A probe's second pass will write into the request's blocks ``written``: those it maps shared become
        private copies, in the blocks set aside at admission; the rest of those go back to the pool."""
        blocks = seq.blocks
        written_ids = np.array(written, dtype=np.int64)
        shared = written_ids[np.isin(written_ids, blocks.shared)]
        fresh, rest = blocks.reserved[: len(shared)], blocks.reserved[len(shared) :]
        blocks.reserved = []
        self.pool.free(rest)
        self.pool.free(blocks.kv.copy_on_write(shared, fresh))
        blocks.shared = np.setdiff1d(blocks.shared, shared)
        blocks.num_shared -= len(shared)
        blocks.num_private += len(shared)

    def pass_done(self, seq: Sequence) -> None:
        """After the forward that ended its pass: the canonical blocks the request copied are no longer read."""
        self.pool.free(seq.blocks.kv.release_held())

    def can_append(self, seq: Sequence) -> bool:
        """Whether ``append`` can take the slot of the sequence's next token."""
        return not seq.blocks.kv.is_full or self.pool.num_available(owner=owner_of(seq)) >= 1

    def append(self, seq: Sequence) -> None:
        """Reserve the slot of the next token (a new private block when the last is full: ``KVPoolExhaustedError``
        when none is free or evictable for its owner)."""
        kv = seq.blocks.kv
        if kv.is_full:
            kv.add_block(*self.pool.allocate(1, owner=owner_of(seq)))
        seq.blocks.next_slot = kv.append_slot()

    def preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks but keep its chunks resident (held) until it is admitted again."""
        blocks = seq.blocks
        for cid in dict.fromkeys(seq.request.cache_ids):
            if cid not in blocks.held and self.pool.is_resident(cid):
                blocks.held[cid] = self.pool.hold(cid)
        self._release(blocks)

    def hold(self, seq: Sequence, cache_id: str) -> None:
        """Keep a resident chunk (compiled for the waiting ``seq``) in the pool until it is admitted."""
        seq.blocks.held[cache_id] = self.pool.hold(cache_id)

    def free(self, seq: Sequence) -> None:
        """Drop every block reference the sequence owns (idempotent)."""
        self._release(seq.blocks)
        self.drop_holds(seq)

    def _release(self, blocks: SeqBlocks) -> None:
        """Free its table's blocks and those set aside for a probe's copies (its holds stay)."""
        if blocks.kv is not None:
            self.pool.free(blocks.kv.release())
            blocks.kv = None
        reserved, blocks.reserved = blocks.reserved, []
        self.pool.free(reserved)

    def drop_holds(self, seq: Sequence) -> bool:
        """Let the chunks a waiting sequence keeps resident go (when evicted, they are loaded from a lower tier or
        compiled again before it is admitted: ``ChunkSources``); whether it held any."""
        held, seq.blocks.held = seq.blocks.held, {}
        self.pool.free(_joined(held.values()))
        return bool(held)

    def can_start(self, prefill: ChunkPrefill) -> bool:
        """Whether the pool has the blocks of a chunk prefill."""
        return self.pool.num_available(owner=prefill.options.namespace) >= prefill.num_blocks(self._block_size)

    def check_compile(self, job: CompileJob, new: list[str], *, bos_token_id: int | None) -> None:
        """Refuse, before any work, a compile call whose ``new`` chunks cannot fit in the pool beside the chunks in
        use (the call's resident ones are held already): one at a time (plus its lead blocks) when a lower tier can
        take them, else all together (``KVPoolExhaustedError``, with the blocks needed and available)."""
        if not new:
            return
        num_lead, dropped, bs = len(lead_tokens(job.options, bos_token_id)), job.options.num_dropped, self._block_size
        sizes = [prefill_blocks(num_lead + len(job.tokens[cid]), num_dropped=dropped, block_size=bs) for cid in new]
        num_bytes = sum(len(job.tokens[cid]) + job.options.add_bos for cid in new) * self._kv_bytes_per_token
        owner = job.options.namespace
        hold_all = not self.store.lower_can_fit(num_bytes, keep=list(job.tokens), namespace=owner)  # (the only copy)
        num_needed = (sum(c for c, _ in sizes) if hold_all else max(c for c, _ in sizes)) + max(n for _, n in sizes)
        chunks = f"{len(new)} new chunk" + ("" if len(new) == 1 else "s")
        self.pool.check_available(num_needed, what=f"this compile call ({chunks})", owner=owner)

    def start(self, prefill: ChunkPrefill) -> None:
        """Take a chunk prefill's blocks (``KVPoolExhaustedError``: the pool cannot hold them; nothing is taken)."""
        what = f"compiling chunk {prefill.cache_id} ({len(prefill.token_ids)} tokens)"
        num_blocks, owner = prefill.num_blocks(self._block_size), prefill.options.namespace
        self.pool.check_available(num_blocks, what=what, owner=owner)
        prefill.start(self.pool.allocate(num_blocks, owner=owner), self.cache)

    def finish(self, prefill: ChunkPrefill) -> tuple[ChunkInfo, list[int]]:
        """A prefill's last piece ran: its chunk's info and canonical blocks (held once for the caller: ``add_chunk``
        makes them resident); its lead blocks are freed."""
        info, canonical, lead = prefill.finish()
        self.pool.free(lead)
        return info, canonical

    def abort(self, prefill: ChunkPrefill) -> None:
        """Free the blocks a prefill took (idempotent)."""
        self.pool.free(prefill.abort())

    # -- resident chunks: the device tier's writes (``pic.store.device.ResidentChunks``) and compile calls' holds

    def add_chunk(self, info: ChunkInfo, block_ids: list[int]) -> None:
        """Make prefilled blocks resident as ``info``'s chunk (the caller's references become holds)."""
        self.pool.add_chunk(info.cache_id, block_ids, info)

    def promote(self, chunk: ChunkKV, *, owner: str) -> list[int]:
        """Write a chunk read from a lower tier into fresh blocks taken for ``owner`` and make it resident; returns its
        blocks, held once for the caller (who checked that the pool has room)."""
        blocks = self.pool.allocate(blocks_for(chunk.num_tokens, self._block_size), owner=owner)
        try:
            self.cache.write(blocks, chunk.k, chunk.v)
        except BaseException:
            self.pool.free(blocks)
            raise
        self.add_chunk(chunk.info, blocks)
        return blocks

    def drop(self, cache_id: str) -> bool:
        return self.pool.drop(cache_id)

    def pin(self, cache_id: str) -> bool:
        return self.pool.pin(cache_id)

    def unpin(self, cache_id: str) -> None:
        self.pool.unpin(cache_id)

    def hold_chunk(self, cache_id: str) -> np.ndarray:
        """A reference to every block of a resident chunk (nothing evicts it until ``free_blocks``)."""
        return self.pool.hold(cache_id)

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Let one reference to each block go (a hold, or blocks taken for work that ended)."""
        self.pool.free(block_ids)

    def reset_peak(self) -> None:
        self.pool.reset_peak()

    def audit(self, seqs: Iterable[Sequence], prefills: Iterable[ChunkPrefill]) -> str | None:
        """Whether the pool adds up with the blocks ``seqs`` (the open requests) and ``prefills`` (the queued chunk
        prefills) hold, when no compile call is open (``BlockPool.audit``: ``None``, or what does not)."""
        references: Counter[int] = Counter()
        for seq in seqs:
            blocks = seq.blocks
            references.update(_joined(blocks.held.values()).tolist())
            references.update(blocks.reserved)
            if blocks.kv is not None:
                references.update(blocks.kv.references)
        for prefill in prefills:
            if prefill.kv is not None:
                references.update(prefill.kv.references)
        return self.pool.audit(references)


_NO_BLOCKS = np.empty(0, dtype=np.int64)


def _joined(block_ids: Iterable[np.ndarray]) -> np.ndarray:
    """Arrays of block ids, one after another."""
    arrays = list(block_ids)
    return np.concatenate(arrays) if arrays else _NO_BLOCKS


def owner_of(seq: Sequence) -> str:
    """Whose request ``seq`` is: the namespace its blocks are charged to and its work evicts first."""
    return seq.request.access.own.name
