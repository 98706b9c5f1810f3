"""Who runs in the next forward: waiting and running queues, admission by blocks, a token budget, a
sequence cap, and preemption (nano-vllm's scheduler, with linked requests).

Every step, each running sequence gets the slot of its next token, in admission order; when the pool
has no block for one, the most recently admitted running sequence is preempted (its blocks freed, its
chunks kept resident, requeued at the front for a fresh recompute pass over its prompt and the tokens
it has generated). Then waiting sequences are admitted in order while the token budget, the sequence
cap and the pool's free and evictable blocks allow (not in a step that preempted: the blocks just freed
go to the running ones). No deadlock: when nothing runs, nothing will free a block, so a sequence that
still does not fit fails (``KVPoolExhaustedError``, or ``FinishReason.KV_POOL`` with its tokens so far).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pic.engine.generation import FinishReason
from pic.engine.linker import Linker
from pic.engine.sequence import Sequence, Status
from pic.errors import KVPoolExhaustedError, PicError


@dataclass
class ScheduledBatch:
    """One step's work.

    Attributes:
        prefills: admitted this step: their recompute pass runs (``Sequence.pass_`` is set).
        decodes: running: their last token runs (``Sequence.next_slot`` is reserved).
        resumed: parked sequences whose generation starts: their first token is sampled from the
            hidden state their pass left (no forward).
        failed: sequences that cannot run, with the error or the reason they finish early.
    """

    prefills: list[Sequence] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)
    resumed: list[Sequence] = field(default_factory=list)
    failed: list[tuple[Sequence, Exception | FinishReason]] = field(default_factory=list)


class Scheduler:
    """Args:
    linker: does the pool work of its decisions.
    max_num_seqs: most sequences running at once (parked ones do not count).
    max_num_batched_tokens: most tokens per forward; a recompute pass larger than it runs alone.
    """

    def __init__(self, linker: Linker, *, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.linker, self.max_num_seqs, self.max_num_batched_tokens = linker, max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence, or a parked one whose generation starts."""
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Forget a sequence that finished or was aborted (its blocks are the engine's to free)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        preempted = self._schedule_running(batch)
        if not preempted:
            self._schedule_waiting(batch, budget=self.max_num_batched_tokens - len(batch.decodes))
        return batch

    def _schedule_running(self, batch: ScheduledBatch) -> bool:
        """Reserve each running sequence's next slot, preempting the latest admitted when the pool is full."""
        todo, preempted = deque(self.running), False
        self.running = []
        while todo:
            seq = todo.popleft()
            while not self.linker.can_append(seq):
                if todo:  # preempt the most recently admitted sequence not yet scheduled, and look again
                    self._preempt(todo.pop())
                    preempted = True
                elif not self._drop_holds(keep=None):  # (chunks kept for preempted sequences let go: look again)
                    break
            else:
                seq.next_slot = self.linker.append(seq)
                batch.decodes.append(seq)
                self.running.append(seq)
                continue
            if batch.decodes:  # the others run this step and will free blocks: wait for them
                self._preempt(seq)
                preempted = True
            else:  # alone: nothing will free a block
                batch.failed.append((seq, FinishReason.KV_POOL))
        return preempted

    def _schedule_waiting(self, batch: ScheduledBatch, *, budget: int) -> None:
        """Admit waiting sequences in order while the budget, the cap and the pool allow. A query-aware
        policy's sequence runs its probe and its second pass in this step: the blocks the second may copy
        and its query's tokens are counted now."""
        reserved = 0  # blocks set aside for the second passes of this step's probes
        while self.waiting and len(self.running) + len(batch.prefills) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.kv is not None:  # parked, generation starting: no blocks, no forward
                self.waiting.popleft()
                batch.resumed.append(seq)
                self.running.append(seq)
                continue
            busy = bool(self.running or batch.prefills)
            try:
                plan = self.linker.plan(seq)
                num_tokens = int(seq.selected.sum())
                reserve = self.linker.probe_reserve(plan, seq)
                if self.linker.probes(seq):
                    num_tokens += plan.layout.query.num_tokens  # the second pass runs the query again
                if busy and num_tokens > budget:
                    return
                if not self.linker.can_admit(plan, seq, reserved=reserved + reserve):
                    if busy:
                        return
                    self._drop_holds(keep=seq)
                    self.linker.check_admit(plan, seq, reserved=reserved + reserve)  # KVPoolExhaustedError
                self.linker.admit(plan, seq, num_output_rows=1 if seq.sampling else len(seq.query_ids))
                reserved += reserve
            except PicError as exc:
                self.waiting.popleft()
                out_of_blocks = isinstance(exc, KVPoolExhaustedError) and seq.output_ids
                batch.failed.append((seq, FinishReason.KV_POOL if out_of_blocks else exc))
                continue
            self.waiting.popleft()
            budget -= num_tokens
            batch.prefills.append(seq)
            if seq.sampling is not None:
                self.running.append(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.linker.preempt(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def _drop_holds(self, *, keep: Sequence | None) -> bool:
        """Release the chunks waiting sequences keep resident (all but ``keep``'s); whether any were."""
        dropped = False
        for seq in self.waiting:
            if seq is not keep and seq.held:
                self.linker.drop_holds(seq)
                dropped = True
        return dropped
