"""Who runs in the next forward: one token budget per step shared by decodes, recompute passes and chunk
prefills (vLLM v1's scheduler, with linked requests and compiles).

Each step, running sequences go first: each gets the slot of its next token, in admission order; when the
pool has no block for one, the most recently admitted running sequence is preempted (its blocks freed,
its chunks held, requeued at the front for a fresh pass over its prompt and the tokens it generated).
The budget left goes to prefill work: waiting sequences (their recompute passes) first, in arrival order, while
the budget, the sequence cap and the pool allow, then bulk compiles' chunk prefills (``PrefillOrder.INTERACTIVE``:
a request that arrives during a bulk compile waits a step, not the compile), with the whole budget in steps with
no request's pass and ``compile_share`` of it in steps with one; or all of them in arrival order
(``PrefillOrder.ARRIVAL``). A
chunk prefill takes what budget is left and goes on in the next step (chunked prefill), so a compile of
many documents never stalls the running streams for more than a step; so does a static policy's recompute
pass larger than the budget. One that cannot be split (dynamic, probing) runs with no other prefill work.
A sequence whose chunks are being fetched (``ChunkSources``) waits alone and is passed over.

No deadlock: when nothing runs, nothing will free a block, so work that still does not fit fails
(``KVPoolExhaustedError``, or ``FinishReason.KV_POOL`` with its tokens so far).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from pic.compile import ChunkPrefill
from pic.config import PrefillOrder
from pic.engine.batch import PassPiece, ScheduledBatch
from pic.engine.chunk_sources import ChunkSources
from pic.engine.generation import FinishReason
from pic.engine.kv_manager import KVManager
from pic.engine.sequence import Sequence
from pic.errors import KVPoolExhaustedError, PicError
from pic.link.linker import Linker


class Scheduler:
    """Args:
    kv: does the pool work of its decisions.
    linker: plans what a waiting sequence's admission takes, and sets up its pass.
    sources: fetches waiting sequences' chunks; holds the queue of chunk prefills.
    max_num_seqs: most sequences running at once (parked ones do not count).
    max_num_batched_tokens: most tokens per forward; a recompute pass larger than it runs alone.
    prefill_order, compile_share: which prefill work goes first (``PICConfig.prefill_order``, ``compile_share``).
    frees_soon: whether store I/O under way will free blocks (a compile's hold on a chunk being written
        through): work that does not fit waits for it rather than fail.
    """

    def __init__(
        self,
        kv: KVManager,
        linker: Linker,
        sources: ChunkSources,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        prefill_order: PrefillOrder = PrefillOrder.INTERACTIVE,
        compile_share: float = 0.125,
        frees_soon: Callable[[], bool] = lambda: False,
    ) -> None:
        self.kv, self.linker, self.sources, self.frees_soon = kv, linker, sources, frees_soon
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.prefill_order, self.compile_share = prefill_order, compile_share
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.prefilling: list[Sequence] = []  # admitted, their pass run in pieces (not decoding yet)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence, or a parked one whose generation starts."""
        seq.wait()
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Forget a sequence that finished or was aborted (its blocks are the engine's to free)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.prefilling:
            self.prefilling.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        preempted = self._schedule_running(batch)
        self._fetch_chunks(batch)
        if not preempted:
            self._schedule_prefill_work(batch, budget=self.max_num_batched_tokens - len(batch.decodes))
        return batch

    def _schedule_running(self, batch: ScheduledBatch) -> bool:
        """Reserve each running sequence's next slot, preempting the latest admitted when the pool is full."""
        todo, preempted = deque(self.running), False
        self.running = []
        while todo:
            seq = todo.popleft()
            while not self.kv.can_append(seq):
                if todo:  # preempt the most recently admitted sequence not yet scheduled, and look again
                    self._preempt(todo.pop())
                    preempted = True
                elif not self._drop_holds(keep=None):  # (chunks kept for waiting sequences let go: look again)
                    break
            else:
                self.kv.append(seq)
                batch.decodes.append(seq)
                self.running.append(seq)
                continue
            if batch.decodes:  # the others run this step and will free blocks: wait for them
                self._preempt(seq)
                preempted = True
            else:  # alone: nothing will free a block
                batch.failed.append((seq, FinishReason.KV_POOL))
        return preempted

    def _fetch_chunks(self, batch: ScheduledBatch) -> None:
        """Start fetching every waiting sequence's missing chunks (a prefetch), failing those that cannot run."""
        for seq in list(self.waiting):
            error = self.sources.resolve(seq).error
            if error is not None:
                self.waiting.remove(seq)
                batch.failed.append((seq, error))

    def _schedule_prefill_work(self, batch: ScheduledBatch, *, budget: int) -> None:
        """Give ``budget`` tokens to prefill work (``PrefillOrder.INTERACTIVE``): waiting sequences' recompute
        passes and the chunk prefills they wait for, in arrival order, then bulk compiles' chunk prefills: the
        whole budget in a step with no request's pass, ``compile_share`` of it in one with; or (``ARRIVAL``) all
        of them in arrival order."""
        self.sources.drop_abandoned()
        requests: list[Sequence | ChunkPrefill] = [*self.prefilling, *self.waiting]
        compiles = list(self.sources.prefills.values())
        if self.prefill_order is PrefillOrder.ARRIVAL:
            self._schedule_in_order(batch, sorted([*requests, *compiles], key=lambda w: w.order), budget=budget)
            return
        requests += [p for p in compiles if p.is_interactive]  # (chunks a request waits for)
        compiles = [p for p in compiles if not p.is_interactive]
        kept = int(budget * self.compile_share) if compiles else 0
        left = self._schedule_in_order(
            batch, sorted(requests, key=lambda w: w.order), budget=budget - kept, compiles_wait=bool(compiles)
        )
        # Beside a request's pass, compiles get their share only: the step (and the request's first token) is not
        # slowed by a compile's full piece. Without one, they get the whole budget.
        num_compile = min(kept, left + kept) if batch.has_prefill_work else budget
        self._schedule_in_order(batch, sorted(compiles, key=lambda w: w.order), budget=num_compile)

    def _schedule_in_order(
        self, batch: ScheduledBatch, queued: list[Sequence | ChunkPrefill], *, budget: int, compiles_wait: bool = False
    ) -> int:
        """Schedule ``queued`` in order while ``budget`` lasts and none must wait; returns the budget left.
        ``compiles_wait``: chunk prefills are queued behind these sequences: one that does not fit the pool waits
        for them to end (and free their holds) rather than fail."""
        for work in queued:
            if budget <= 0:
                break
            if isinstance(work, ChunkPrefill):
                if not self._schedule_piece(work, batch, budget=budget):
                    break
                budget -= batch.pieces[-1][1].token_ids.shape[0]
                continue
            num_tokens = self._admit(work, batch, budget=budget, compiles_wait=compiles_wait)
            if num_tokens is None:
                break
            budget -= num_tokens
        return budget

    def _busy(self, batch: ScheduledBatch) -> bool:
        """Whether something runs this step (and will free blocks or take budget)."""
        return bool(self.running or self.prefilling) or batch.has_prefill_work

    def _schedule_piece(self, prefill: ChunkPrefill, batch: ScheduledBatch, *, budget: int) -> bool:
        """Add the next piece of ``prefill`` (starting it when the pool has its blocks); whether it ran. One that
        cannot start while nothing runs and no hold or store write will free a block fails with the pool's
        ``KVPoolExhaustedError`` (blocks needed and available)."""
        if not prefill.is_started:
            if not self.kv.can_start(prefill, reserved=batch.num_reserved):
                stuck = not self._busy(batch) and not self.frees_soon() and not self._drop_holds(keep=None)
                if stuck and not self.kv.can_start(prefill):  # (not even beside nothing set aside)
                    try:
                        self.kv.start(prefill)  # raises, with the blocks needed and available
                    except KVPoolExhaustedError as exc:
                        batch.failed_prefills.append((prefill, exc))
                return False
            self.kv.start(prefill)
        batch.pieces.append((prefill, prefill.piece(budget)))
        return True

    def _admit(self, seq: Sequence, batch: ScheduledBatch, *, budget: int, compiles_wait: bool = False) -> int | None:
        """Admit a waiting sequence: the tokens it takes from the budget, 0 when it is passed over (its chunks are
        being fetched, or it failed), ``None`` when it must wait and the ones after it too."""
        if seq in self.prefilling:  # its pass goes on
            if seq.link.pass_.piece_size(budget) > budget and batch.has_prefill_work:
                return None
            return self._place(seq, batch, budget=budget)
        num_ending = sum(p.ends for p in batch.passes)
        if len(self.running) + len(self.prefilling) + num_ending >= self.max_num_seqs:
            return None
        if seq.blocks.kv is not None:  # parked, generation starting: no blocks, no forward
            self.waiting.remove(seq)
            batch.resumed.append(seq)
            self.running.append(seq)
            return 0
        busy = self._busy(batch) or compiles_wait
        chunks = self.sources.resolve(seq)  # (again: this step's admissions may have evicted a chunk)
        if not chunks.is_ready:
            if chunks.error is not None:
                self.waiting.remove(seq)
                batch.failed.append((seq, chunks.error))
            return 0
        try:
            plan = self.linker.plan(
                seq.link, prefix=seq.prefix_ids, chunks=seq.chunks,
                query=seq.query_ids + seq.output_ids, num_generated=len(seq.output_ids), relevance=seq.relevance,
            )  # fmt: skip
            # a larger pass runs in pieces, or (not splittable) with no other prefill work beside it
            if plan.num_tokens > budget and not plan.chunkable and batch.has_prefill_work:
                return None
            if not self.kv.can_allocate(seq, plan, reserved=batch.num_reserved):
                if busy:
                    return None
                self._drop_holds(keep=seq)  # (then a KVPoolExhaustedError from allocate if it still does not fit)
            assembly = self.kv.allocate(seq, plan, reserved=batch.num_reserved)
        except PicError as exc:
            self.waiting.remove(seq)
            out_of_blocks = isinstance(exc, KVPoolExhaustedError) and seq.output_ids
            batch.failed.append((seq, FinishReason.KV_POOL if out_of_blocks else exc))
            return 0
        num_rows = 1 if seq.sampling else len(seq.query_ids)
        self.linker.start(seq.link, plan, seq.blocks.kv, assembly=assembly, num_output_rows=num_rows)
        seq.admitted()
        self.waiting.remove(seq)
        batch.num_reserved += plan.num_reserved
        extra = plan.num_tokens - seq.link.pass_.num_tokens  # a probe's second pass
        return extra + self._place(seq, batch, budget=budget)

    def _place(self, seq: Sequence, batch: ScheduledBatch, *, budget: int) -> int:
        """Schedule the next piece of an admitted sequence's pass: all that is left, or (a pass that runs in
        pieces) what the budget holds; returns its tokens. A sequence whose pass ends this step decodes next."""
        pass_ = seq.link.pass_
        num_tokens = pass_.piece_size(budget)
        ends = num_tokens == pass_.num_left
        batch.passes.append(PassPiece(seq, num_tokens, ends))
        if not ends:
            if seq not in self.prefilling:
                self.prefilling.append(seq)
            return num_tokens
        if seq in self.prefilling:
            self.prefilling.remove(seq)
        if seq.sampling is not None:
            self.running.append(seq)
        return num_tokens

    def _preempt(self, seq: Sequence) -> None:
        self.kv.preempt(seq)
        self.linker.forget_pass(seq.link)
        seq.preempt()
        self.waiting.appendleft(seq)

    def _drop_holds(self, *, keep: Sequence | None) -> bool:
        """Release the chunks waiting sequences keep resident (all but ``keep``'s); whether any were."""
        dropped = False
        for seq in self.waiting:
            if seq is not keep:
                dropped |= self.kv.drop_holds(seq)
        return dropped
