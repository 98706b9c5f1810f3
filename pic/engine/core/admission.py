"""``Admission``: the prefill work of a step under what its token budget leaves after the decodes. Work under way
goes first: resumed links get their place among the running, and passes under way go on (pieces of a long static
pass: they hold their blocks and take no new ones, and a waiting request may be waiting for them; a probe's second
pass runs in its probe's step, ``Scheduler.second_passes``). Then new work: waiting sequences' recompute passes and
chunk prefills (``PrefillOrder.INTERACTIVE``: a request's work first, in arrival order, then bulk compiles' chunk
prefills, with the whole budget in steps with no request's pass and ``compile_share`` of it in steps with one;
``PrefillOrder.ARRIVAL``: all of it in arrival order).

Tenants take turns (``Turns``): with several namespaces waiting, each one's work keeps its arrival order and the
namespaces are interleaved round robin (the first of each, then the second of each ...; the namespace last given
budget goes to the back, across steps), so one namespace's many requests cannot hold another's first token. Under
``PrefillOrder.ARRIVAL`` too: arrival order within each namespace, compiles and requests alike, turns across them
(isolation between tenants does not depend on the prefill order). Work that must wait (it does not fit the pool or
the step's budget now) holds back the rest of its own namespace's work, not the others' (the pool answers per
namespace: one namespace's lack of blocks says nothing of another's); a namespace at its ``Quota.max_num_seqs`` is
passed over, and at the engine's ``max_num_seqs`` no new request is admitted. With one namespace (no tenants) this
is exactly the arrival order, and the first request that must wait stops the ones after it.

A chunk prefill takes what budget is left and goes on in the next step (chunked prefill), so a compile of many
documents never stalls the running streams for more than a step; so does a static policy's recompute pass larger
than the budget. One that cannot be split (dynamic, probing) runs with no other prefill work beside it. A sequence
whose chunks are being fetched (``ChunkSources``) waits alone and is passed over.

No deadlock: when nothing runs, nothing will free a block, so work that still does not fit fails
(``KVPoolExhaustedError``, or ``FinishReason.KV_POOL`` with its tokens so far).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from pic.compile import ChunkPrefill
from pic.config import PICConfig, PrefillOrder
from pic.engine.core.batch import PassPiece, ScheduledBatch
from pic.engine.core.chunk_sources import ChunkSources
from pic.engine.core.kv_manager import KVManager, owner_of
from pic.engine.core.sequence import Queues, Sequence, Status, Transition
from pic.engine.core.turns import Turns
from pic.errors import KVPoolExhaustedError, PicError
from pic.link.linker import Linker

Work = Sequence | ChunkPrefill


def _arrival(work: Work) -> float:
    return work.order if isinstance(work, ChunkPrefill) else work.times.arrival_s


def _namespace(work: Work) -> str:
    """Whose work it is: a request's namespace, a chunk prefill's chunk's."""
    return work.options.namespace if isinstance(work, ChunkPrefill) else owner_of(work)


class Admission:
    """The scheduler's part that admits prefill work (``fail``: ``Scheduler.fail``). ``frees_soon``: whether store I/O
    under way will free blocks (a compile's hold on a chunk being written through): work that does not fit waits
    for it rather than fail."""

    def __init__(
        self,
        queues: Queues,
        kv: KVManager,
        linker: Linker,
        sources: ChunkSources,
        *,
        fail: Callable[[Sequence, Exception], None],
        out_of_blocks: Callable[[Sequence], None],
        frees_soon: Callable[[], bool],
        config: PICConfig,
    ) -> None:
        self.queues, self.kv, self.linker, self.sources, self.fail = queues, kv, linker, sources, fail
        self.out_of_blocks = out_of_blocks
        self.frees_soon, self.config = frees_soon, config
        self.turns, self.compile_turns = Turns(), Turns()  # requests' (all work's under ARRIVAL), bulk compiles'
        self._active: Counter[str] = Counter()  # namespace -> its sequences running or prefilling (this step)

    def prefetch(self) -> None:
        """Start fetching every waiting sequence's missing chunks, failing those that cannot run."""
        for seq in self.queues.of(Status.WAITING):  # (a resuming one has its KV)
            try:
                self.sources.fetch(seq)
            except PicError as exc:
                self.fail(seq, exc)

    def schedule(self, batch: ScheduledBatch, *, budget: int) -> None:
        """Give ``budget`` tokens to prefill work: the work under way first, then new work in the order of
        ``prefill_order``, the namespaces taking turns."""
        for prefill in self.sources.drop_abandoned():
            self.kv.abort(prefill)
        self._active = Counter(owner_of(seq) for seq in (*self.queues.running, *self.queues.prefilling))
        self._start_resumed(batch)
        under_way = list(self.queues.prefilling)
        requests: list[Work] = self.queues.of(Status.WAITING)
        compiles = list(self.sources.prefills.values())
        if self.config.prefill_order is PrefillOrder.ARRIVAL:
            budget = self._in_order(batch, under_way, budget=budget)
            self._in_order(batch, self._turns_of([*requests, *compiles], self.turns), budget=budget, turns=self.turns)
            return
        requests += [p for p in compiles if p.is_interactive]  # (chunks a request waits for)
        compiles = [p for p in compiles if not p.is_interactive]
        kept = int(budget * self.config.compile_share) if compiles else 0
        left = self._in_order(batch, under_way, budget=budget - kept)
        queued = self._turns_of(requests, self.turns)
        left = self._in_order(batch, queued, budget=left, compiles_wait=bool(compiles), turns=self.turns)
        # Beside a request's pass, compiles get their share only: the step (and the request's first token) is not
        # slowed by a compile's full piece. Without one, they get the whole budget.
        num_compile = min(kept, left + kept) if batch.has_prefill_work else budget
        queued = self._turns_of(compiles, self.compile_turns)
        self._in_order(batch, queued, budget=num_compile, turns=self.compile_turns)

    @staticmethod
    def _turns_of(works: list[Work], turns: Turns) -> list[Work]:
        return turns.order(works, namespace=_namespace, arrival=_arrival)

    def _in_order(
        self,
        batch: ScheduledBatch,
        queued: list[Work],
        *,
        budget: int,
        compiles_wait: bool = False,
        turns: Turns | None = None,
    ) -> int:
        """Schedule ``queued`` in order while ``budget`` lasts; returns the budget left. Work that must wait holds back
        the rest of its namespace's; a waiting request of a namespace at its ``max_num_seqs`` is passed over; at the
        engine's, no waiting request is admitted. ``compiles_wait``: chunk prefills are queued behind these
        sequences: one that does not fit the pool waits for them to end (and free their holds) rather than fail.
        ``turns``: told whose work got budget."""
        held_back: set[str] = set()  # namespaces whose next work must wait
        for work in queued:
            if budget <= 0:
                break
            name = _namespace(work)
            if name in held_back:
                continue
            if isinstance(work, ChunkPrefill):
                if not self._piece(work, batch, budget=budget):
                    held_back.add(name)
                    continue
                num_tokens: int | None = batch.pieces[-1][1].token_ids.shape[0]
            else:
                if work.status is Status.WAITING and self._full():
                    break
                if work.status is Status.WAITING and self._namespace_full(name):
                    continue
                try:
                    num_tokens = self._admit(work, batch, budget=budget, compiles_wait=compiles_wait)
                except Exception as exc:
                    self.fail(work, exc)
                    continue
                if num_tokens is None:
                    held_back.add(name)
                    continue
            budget -= num_tokens
            if num_tokens and turns is not None:
                turns.took(name)
        return budget

    def busy(self, batch: ScheduledBatch) -> bool:
        """Whether something runs this step (and will free blocks or take budget)."""
        return self.queues.num_active > 0 or batch.has_prefill_work

    def _full(self) -> bool:
        return self.queues.num_active >= self.config.max_num_seqs

    def _namespace_full(self, name: str) -> bool:
        """Whether namespace ``name`` runs its ``Quota.max_num_seqs`` already."""
        quota = self.config.quotas.get(name)
        return quota is not None and quota.max_num_seqs is not None and self._active[name] >= quota.max_num_seqs

    def _piece(self, prefill: ChunkPrefill, batch: ScheduledBatch, *, budget: int) -> bool:
        """Add the next piece of ``prefill`` (starting it when the pool has its blocks); whether it ran. One that
        cannot start while nothing runs and no hold or store write will free a block fails with the pool's
        ``KVPoolExhaustedError`` (blocks needed and available)."""
        if not prefill.is_started:
            if not self.kv.can_start(prefill):
                if not self.busy(batch) and not self.frees_soon() and not self.drop_holds(keep=None):
                    try:
                        self.kv.start(prefill)  # raises, with the blocks needed and available
                    except KVPoolExhaustedError as exc:
                        batch.failed_prefills.append((prefill, exc))
                return False
            self.kv.start(prefill)
        batch.pieces.append((prefill, prefill.piece(budget)))
        return True

    def _admit(self, seq: Sequence, batch: ScheduledBatch, *, budget: int, compiles_wait: bool) -> int | None:
        """Schedule a sequence's prefill work: the tokens it takes from the budget, 0 when it is passed over (its
        chunks are being fetched, or it failed), ``None`` when it must wait and its namespace's after it too."""
        if seq.status is Status.PREFILLING:  # its pass goes on (the next piece)
            if seq.link.pass_.piece_size(budget) > budget and batch.has_prefill_work:
                return None
            return self._place(seq, batch, budget=budget)
        return self._new_pass(seq, batch, budget=budget, busy=self.busy(batch) or compiles_wait)

    def _start_resumed(self, batch: ScheduledBatch) -> None:
        """Give the resuming links their place among the running while the caps allow (the engine's; their namespace's
        passes them over): no blocks, no forward (their first tokens come from the hidden states their passes left)."""
        for seq in self.queues.of(Status.RESUMING):
            if self._full():
                return
            if self._namespace_full(owner_of(seq)):
                continue
            self.queues.move(seq, Transition.START)
            batch.resumed.append(seq)
            self._active[owner_of(seq)] += 1

    def _new_pass(self, seq: Sequence, batch: ScheduledBatch, *, budget: int, busy: bool) -> int | None:
        """Admit a waiting sequence: plan its link, take its blocks, set up its pass, place its first piece."""
        try:
            if not self.sources.fetch(seq):  # (again: this step's admissions may have evicted a chunk)
                return 0
            request, generated = seq.request, seq.output_ids
            plan = self.linker.specialise_and_plan(
                seq.link, prefix=request.prefix_ids, chunks=seq.fetch.chunks, query=request.query_ids + generated,
                num_generated=len(generated), relevance=request.relevance,
            )  # fmt: skip
            # a larger pass runs in pieces, or (not splittable) with no other prefill work beside it
            if plan.num_tokens > budget and not plan.chunkable and batch.has_prefill_work:
                return None
            if not self.kv.can_allocate(seq, plan):
                if busy:
                    return None
                self.drop_holds(keep=seq)  # (then a KVPoolExhaustedError from allocate if it still does not fit)
            assembly = self.kv.allocate(seq, plan)
        except PicError as exc:
            if isinstance(exc, KVPoolExhaustedError) and seq.output_ids:
                self.out_of_blocks(seq)
            else:
                self.fail(seq, exc)
            return 0
        num_rows = 1 if seq.sampling else len(seq.request.query_ids)
        self.linker.start(seq.link, plan, seq.blocks.kv, assembly=assembly, num_output_rows=num_rows)
        self.queues.move(seq, Transition.ADMIT)
        self._active[owner_of(seq)] += 1
        return self._place(seq, batch, budget=budget)

    @staticmethod
    def _place(seq: Sequence, batch: ScheduledBatch, *, budget: int) -> int:
        """Schedule the next piece of an admitted sequence's pass: all that is left, or (a pass that runs in
        pieces) what the budget holds; returns its tokens."""
        pass_ = seq.link.pass_
        num_tokens = pass_.piece_size(budget)
        batch.passes.append(PassPiece(seq, num_tokens, ends=num_tokens == pass_.num_left))
        return num_tokens

    def drop_holds(self, *, keep: Sequence | None) -> bool:
        """Release the chunks waiting sequences keep resident (all but ``keep``'s); whether any were."""
        dropped = False
        for seq in self.queues.to_admit:
            if seq is not keep:
                dropped |= self.kv.drop_holds(seq)
        return dropped
