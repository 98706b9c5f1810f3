"""``Scheduler``: who runs in the next forward, and the one place a step's results land, in vLLM v1's shape:
``schedule()`` returns the batch, the executor runs it (``pic.model.executor``: forward and sampling), and
``update_from_output(batch, output)`` takes the token ids in. It never touches a tensor (this module imports no
torch): hidden states it carries (a parked link's) are the executor's, passed through unread.

Each step, running sequences go first: each gets the slot of its next token, in admission order; when the pool
has no block for one, the most recently admitted running sequence is preempted (its blocks freed, its chunks
held, requeued at the front for a fresh pass over its prompt and the tokens it generated), or, when it runs alone,
the holds of waiting sequences are let go, then a resuming link is preempted. The budget left goes to prefill work
(``Admission``). Every status change is one ``Queues.move``. A sequence whose work raises fails through ``fail``,
the one way a sequence fails: its status, queue and blocks go together, its last output is put, and nothing more
is done for it; the step and the other requests go on.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future

from pic.config import PICConfig
from pic.engine.core.admission import Admission
from pic.engine.core.batch import ForwardOutput, PassPiece, ScheduledBatch, StepOutput
from pic.engine.core.chunk_sources import ChunkSources
from pic.engine.core.compile_calls import CompileCalls
from pic.engine.core.decoding import Decoder, Sampled, finish_output, link_output
from pic.engine.core.kv_manager import KVManager
from pic.engine.core.sequence import Queues, Sequence, Status, Transition
from pic.engine.generation import FinishReason
from pic.engine.request import RequestOutput
from pic.errors import CALLER_ERRORS, PicError, SequenceStateError
from pic.link.linker import Linker

log = logging.getLogger("pic")


class Scheduler:
    def __init__(
        self,
        kv: KVManager,
        linker: Linker,
        sources: ChunkSources,
        compiles: CompileCalls,
        decoder: Decoder,
        *,
        config: PICConfig,
    ) -> None:
        self.kv, self.linker, self.sources, self.compiles, self.decoder = kv, linker, sources, compiles, decoder
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.queues = Queues()
        self._probed: list[Sequence] = []  # probes that ended in this step: their second passes run next
        self._preempted = False  # one was preempted in this step: no new prefill work (it would take its blocks)
        self.admission = Admission(
            self.queues, kv, linker, sources, fail=self.fail, out_of_blocks=self.out_of_blocks,
            frees_soon=self._frees_soon, config=config,
        )  # fmt: skip

    def has_work(self, *, include_paced: bool = True) -> bool:
        """Whether a step would do something now (``include_paced=False``: not counting sequences that run only in
        steps their client asks for); a waiting sequence counts once its chunks are at hand or a load answered."""
        queues = self.queues
        open_seqs = (*queues.to_admit, *queues.prefilling, *queues.running)
        seqs = [s for s in open_seqs if include_paced or not s.request.paced]
        if any(s.status is not Status.WAITING or _fetched(s) for s in seqs):
            return True
        writing = self._frees_soon()
        if any(p.is_started or not writing or self.kv.can_start(p) for p in self.sources.prefills.values()):
            return True
        return bool(self.compiles.open) and self.compiles.has_news  # (a link alone has no compile call to ask)

    def _frees_soon(self) -> bool:
        return self.compiles.num_writing > 0

    # -- schedule -------------------------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        """This step's work: a decode for every running sequence (preempting when the pool is full), then, unless
        one was preempted, prefill work under the budget the decodes leave."""
        batch, self._preempted = ScheduledBatch(), False
        todo = list(self.queues.running)
        while todo:
            seq = todo.pop(0)
            try:
                self._schedule_decode(seq, todo, batch)
            except Exception as exc:
                self.fail(seq, exc)
        self.admission.prefetch()
        if not self._preempted:
            self.admission.schedule(batch, budget=self.max_num_batched_tokens - len(batch.decodes))
        return batch

    def _schedule_decode(self, seq: Sequence, todo: list[Sequence], batch: ScheduledBatch) -> None:
        """Reserve ``seq``'s next slot, preempting others (``todo``: the running ones not yet scheduled) or itself
        when the pool has no block for it."""
        if seq.status is not Status.RUNNING:  # (a queue holds it where it cannot be)
            raise SequenceStateError(f"request {seq.request_id} is {seq.status.value} where only running can be")
        while not self.kv.can_append(seq):
            if todo:  # preempt the most recently admitted sequence not yet scheduled, and look again
                self._preempt(todo.pop())
            elif self.admission.drop_holds(keep=None):  # (chunks kept for waiting ones let go)
                continue
            elif resuming := self.queues.of(Status.RESUMING):
                self._preempt(resuming[-1])  # (its generation started)
            elif batch.decodes:  # the others run this step and will free blocks: wait for them
                return self._preempt(seq)
            else:  # alone: nothing will free a block
                return self.out_of_blocks(seq)
        self.kv.append(seq)
        batch.decodes.append(seq)

    def second_passes(self) -> ScheduledBatch:
        """The second passes of the probes that ended in this step's forward, to run in the same step: a probe's
        request is not held up a step more (behind a compile's piece or a pass that came first), and its picks are
        computed at once. Nothing else runs beside them; an empty batch when no probe ended."""
        batch = ScheduledBatch()
        for seq in self._probed:
            if seq.status is Status.PREFILLING and seq.link.pass_ is not None:  # (not failed since)
                batch.passes.append(PassPiece(seq, seq.link.pass_.num_left, ends=True))
        self._probed = []
        return batch

    def _preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks for the others (its chunks held), or fail it."""
        try:
            self.queues.move(seq, Transition.PREEMPT)  # (checked before anything is freed)
            self.kv.preempt(seq)
            self.linker.forget_pass(seq.link)
        except Exception as exc:
            self.fail(seq, exc)
            return
        self._preempted = True

    # -- update ---------------------------------------------------------------------------------------------

    def update_from_output(self, batch: ScheduledBatch, output: ForwardOutput) -> None:
        """The one place a step's results land: the passes that ended park their link or start decoding (a probe's
        policy chooses, and its second pass runs next, in the same step: ``second_passes``), the chunks compiled
        become resident and held for the requests that waited for them, every generating sequence appends the token
        the executor sampled for it, every output goes to its request's sink, and the store's answers that came
        meanwhile are taken in (chunks loaded, compile calls' checks and writes: as vLLM v1 takes a KV connector's
        finished loads). A failed forward or sampling fails its sequences and chunk prefills."""
        if output.error is not None:
            for seq in [p.seq for p in batch.passes] + batch.decodes + batch.resumed:
                self.fail(seq, output.error, quiet=True)  # (the executor logged the error, with its trace)
            batch.failed_prefills += [(prefill, output.error) for prefill, _ in batch.pieces]
        ran = batch.outputs(output.hidden) if output.error is None else StepOutput()
        rows = [seq for seq in batch.resumed if seq.status is Status.RUNNING]  # (those that sample, in order)
        parked: list[Sequence] = []
        for piece, hidden in ran.passes:
            if piece.ends and piece.seq.status is Status.PREFILLING:  # (else it goes on; or it failed in this step)
                self._pass_done(piece.seq, hidden, rows, parked)
        for prefill in ran.pieces:
            if prefill.is_done:
                self._hold_for(prefill.cache_id, self.compiles.chunk_done(prefill))
        for prefill, error in batch.failed_prefills:
            for seq in self.compiles.prefill_failed(prefill, error):
                self.fail(seq, error)
        for seq in parked:
            seq.sink.put(link_output(seq))
        rows += [seq for seq, _ in ran.decodes if seq.status is Status.RUNNING]
        self._sampled([self.decoder.append(seq, output.sampled.get(seq.request_id)) for seq in rows])
        self._store_answers()

    def _store_answers(self) -> None:
        """The loader's answers: compile calls' checks and writes (a link alone has no call open), and the chunks
        loaded for waiting sequences (a sequence whose load failed fails)."""
        if self.compiles.open:
            self.compiles.poll()
        for seq in self.queues.of(Status.WAITING):
            try:
                self.sources.loaded(seq)
            except Exception as exc:
                self.fail(seq, exc)

    def _pass_done(self, seq: Sequence, hidden: object, rows: list[Sequence], parked: list[Sequence]) -> None:
        """A pass ended: after a probe, the policy chooses (its second pass runs next); else a link parks with its
        query's final hidden states (``hidden``, the executor's, for ``Linked.logits``) and a generation decodes,
        its first token the one the executor sampled from the pass's last row (into ``rows``). A policy's own error
        fails its request, not the batch."""
        try:
            if seq.link.pass_.is_probe:
                self.kv.copy_written(seq, self.linker.probe_done(seq.link))
                self._probed.append(seq)
                return
            self.linker.pass_done(seq.link)
            self.kv.pass_done(seq)
            self.queues.move(seq, Transition.PARK if seq.sampling is None else Transition.RUN)
        except Exception as exc:
            self.fail(seq, exc)
            return
        if seq.sampling is not None:
            rows.append(seq)
        else:
            seq.park(hidden)
            parked.append(seq)

    def _hold_for(self, cache_id: str, waiters: list[Sequence]) -> None:
        """A chunk compiled for ``waiters`` is resident: each one still waiting holds it until admitted."""
        for seq in waiters:
            if not seq.is_finished:  # (a request that ended while its chunk compiled)
                self.kv.hold(seq, cache_id)
                self.sources.compiled(seq, cache_id)

    def _sampled(self, sampled: list[Sampled]) -> None:
        """Each sampled token put out, or its sequence finished."""
        for one in sampled:
            if one.finish is not None:
                self.finish(one.seq, one.finish, text=one.text, token=one.token)
                continue
            one.seq.sink.put(RequestOutput(one.seq.request_id, text=one.text, token_ids=(one.token,), finished=False))

    def fail(self, seq: Sequence, error: Exception, *, quiet: bool = False) -> None:
        """The one way a sequence fails: with ``error`` (its own: a policy's error reaches the caller as it is).
        Logged (``quiet``: not, logged already or the engine is closing), then ended as ``finish`` ends it: status,
        queue and blocks together. A sequence that ended already is left."""
        if seq.is_finished:
            return
        if isinstance(error, CALLER_ERRORS):  # (the caller's to handle: printing it too is noise)
            log.debug("pic: request %d failed: %s", seq.request_id, error)
        elif not quiet:  # (a bug, or a policy's own error: with its traceback)
            trace = None if isinstance(error, PicError) else error
            log.error("pic: request %d failed: %s", seq.request_id, error, exc_info=trace)
        self.finish(seq, error)

    def out_of_blocks(self, seq: Sequence) -> None:
        """End a generation that has no block for its next token while nothing else runs to free one: it ends
        normally, with its tokens so far (``FinishReason.KV_POOL``), logged as a warning."""
        if not seq.is_finished:
            num = len(seq.output_ids)
            log.warning("pic: request %d stopped after %d tokens: the KV pool is full", seq.request_id, num)
            self.finish(seq, FinishReason.KV_POOL)

    def finish(self, seq: Sequence, why: FinishReason | Exception, *, text: str = "", token: int | None = None) -> None:
        """End the sequence (out of its queue, FINISHED), free its blocks, and put its last output (with ``text`` and
        ``token``, this step's)."""
        self.queues.move(seq, Transition.FINISH)
        self.kv.free(seq)
        seq.end(why)
        seq.sink.put(finish_output(seq, text=text, token=token))


def _fetched(seq: Sequence) -> bool:
    """Whether a waiting sequence's chunks are at hand, or a load for it has answered."""
    pending = seq.fetch.pending
    return not pending or any(f.done() for f in pending.values() if isinstance(f, Future))
