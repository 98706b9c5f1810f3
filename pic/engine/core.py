"""``EngineCore``: the batched engine's state and its step, owned by one thread (``pic.engine.core_thread``).

Nothing here locks and nothing here is shared: the core thread is the only one that calls it. A step reads
top to bottom: take in the loader's answers, schedule (decodes, then prefill work under one token budget),
run one batched forward over recompute passes, chunk-prefill pieces and decode tokens (and a second one for
the probes that ended in it), then ``update_from_output``, the one place a step's results land: park the
links, make the chunks compiled resident, sample each request's next token with its own options and
generator, and put every output in its request's sink, in the order it was produced.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future

import torch

from pic.compile import ChunkPrefill
from pic.config import PICConfig
from pic.engine.batch import ScheduledBatch, StepOutput
from pic.engine.chunk_sources import ChunkSources
from pic.engine.compile_call import CompileCalls
from pic.engine.decoding import Decoder
from pic.engine.generation import FinishReason
from pic.engine.kv_manager import KVManager
from pic.engine.loader import Loader
from pic.engine.outputs import finish_output, link_output, token_output
from pic.engine.request import CompileJob, NewRequest, OutputSink, RequestOutput
from pic.engine.sampling import SamplingParams
from pic.engine.scheduler import Scheduler
from pic.engine.sequence import Sequence, Status
from pic.errors import PicError
from pic.kv import BlockPool, KVCache
from pic.link.linker import Linker
from pic.model import ModelRunner
from pic.store import TieredStore

log = logging.getLogger("pic")


class EngineCore:
    """Continuous batching of linked requests and chunk compiles over one model, KV pool and chunk store.

    Args:
        runner: the model's batched forward.
        tokenizer: for incremental detokenization.
        pool, cache: the KV pool's allocator and tensors.
        store: the chunk store; its device tier is the pool's resident chunks.
        kv: the block work of admission, growth, preemption and release.
        linker: plans each request's link and its recompute pass.
        config: the engine's options.
        bos_token_id: written before a chunk when compiling (``None``: the model has none).
        eos_token_ids: tokens that end a generation.
        wake: called from a loader thread when store I/O is done (the core thread runs again).
    """

    def __init__(
        self,
        *,
        runner: ModelRunner,
        tokenizer: object,
        pool: BlockPool,
        cache: KVCache,
        store: TieredStore,
        kv: KVManager,
        linker: Linker,
        config: PICConfig,
        bos_token_id: int | None,
        eos_token_ids: frozenset[int],
    ) -> None:
        self.runner, self.pool, self.cache, self.store, self.kv = runner, pool, cache, store, kv
        self.loader = Loader(store, wake=lambda: self.wake())
        self.sources = ChunkSources(store, self.loader, bos_token_id=bos_token_id, next_order=time.perf_counter)
        self.compiles = CompileCalls(self.sources, self.loader, pool, kv_bytes_per_token=runner.spec.kv_bytes_per_token)
        self.linker = linker
        self.scheduler = Scheduler(
            kv, linker, self.sources, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, prefill_order=config.prefill_order,
            compile_share=config.compile_share, frees_soon=lambda: self.compiles.num_writing > 0,
        )  # fmt: skip
        self.decoder = Decoder(runner, tokenizer, eos_token_ids=eos_token_ids)
        self.num_steps = self.num_batched_seqs = 0  # steps that ran a forward, and the sequences in them
        self._seqs: dict[int, Sequence] = {}  # every unfinished sequence (parked ones included)
        self.wake = lambda: None  # set by the core thread

    # -- commands ----------------------------------------------------------------------------------

    def add(self, new: NewRequest) -> None:
        """Queue a new request for its recompute pass (``sampling=None``: park it after the pass)."""
        seq = Sequence(new)
        self._seqs[seq.request_id] = seq
        if seq.sampling is not None:
            seq.generate(seq.sampling, self.decoder.start(seq.sampling))
        self.scheduler.add(seq)

    def resume(self, request_id: int, params: SamplingParams, *, link_s: float, sink: OutputSink) -> bool:
        """Start generating from a parked sequence (``Linked.generate``), its outputs going to ``sink`` from
        now on; whether it was parked."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.status is not Status.PARKED:
            return False
        seq.generate(params, self.decoder.start(params), sink=sink, link_s=link_s)
        self.scheduler.add(seq)
        return True

    def abort(self, request_id: int) -> None:
        """Stop a sequence and free its blocks (a final output with ``FinishReason.ABORT``); unknown or
        finished ids are ignored (a release may arrive after the end)."""
        seq = self._seqs.get(request_id)
        if seq is not None:
            self._finish(seq, FinishReason.ABORT)

    def compile(self, job: CompileJob, reply: Future) -> None:
        """Start compiling ``job``'s chunks as scheduled work; ``reply`` gets the ids compiled once every chunk
        is held by some tier (``CompileCalls``)."""
        self.compiles.add(job, reply)

    def fail_all(self, error: Exception) -> None:
        """End every sequence and compile call with ``error`` and free their blocks (the engine is closing)."""
        for seq in list(self._seqs.values()):
            self._finish(seq, error)
        self.compiles.fail_all(error)
        self.loader.close()

    def has_work(self, *, paced: bool = True) -> bool:
        """Whether a step would do something now; ``paced=False``: not counting sequences that run only in
        steps their client asks for. Sequences waiting on the loader do not count until it answers."""
        sched = self.scheduler
        seqs = [s for s in (*sched.waiting, *sched.prefilling, *sched.running) if paced or not s.paced]
        ready = any(s.status is Status.RUNNING or not s.fetch.pending or any(f.done() for f in
                    s.fetch.pending.values() if isinstance(f, Future)) for s in seqs)  # fmt: skip
        return ready or self._prefill_work() or self.compiles.has_news

    def _prefill_work(self) -> bool:
        """Whether a chunk prefill can run (or, blocked with no store I/O to wait for, must fail)."""
        prefills = self.sources.prefills.values()
        writing = self.compiles.num_writing > 0
        return any(p.is_started or not writing or self.kv.can_start(p) for p in prefills)

    def retry_writes(self) -> None:
        """Write the chunks a lower tier failed to take (``TieredStore.backlog``) again, when due: from the pool
        while they are resident there (on the loader's writer thread, nobody waiting), else forgotten."""
        for cache_id in self.store.backlog.due():
            try:
                if self.store.device.contains(cache_id):
                    self.loader.write_back(self.store.copy_for_lower(cache_id))
                    continue
            except Exception:  # a retry never stops the engine
                log.exception("pic: could not retry writing chunk %s to the lower tiers", cache_id)
            self.store.backlog.forget(cache_id, evicted=True)

    def next_timer_s(self) -> float | None:
        """Seconds until ``retry_writes`` has work (``None``: none pending): how long an idle core may sleep."""
        return self.store.backlog.next_due_s()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, vocab_size]`` float32 logits of final hidden states ``hidden`` ``[N, hidden_size]``."""
        return self.runner.logits(hidden)

    # -- the step: schedule -> run -> update ----------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Take in store answers, schedule, run one batched forward (and the second forward of the probes that
        ended in it), update every work item from its output; returns what each request produced (already in
        its sink)."""
        self.compiles.poll()
        batch = self.scheduler.schedule()
        outputs = [self._finish(seq, why) for seq, why in batch.failed]
        for prefill, error in batch.failed_prefills:
            outputs += self._prefill_failed(prefill, error)
        if batch.resumed:  # their first token comes from the hidden state their pass left: no need to wait
            outputs += self._sampled([(seq, seq.query_hidden[-1]) for seq in batch.resumed])  # for the forward
        if batch.has_forward:
            outputs += self._run(batch)
        self.compiles.poll()
        return outputs

    def _run(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """The forward over the batch's work, the probes' second forward, then the update from their results."""
        try:
            out = batch.outputs(self.runner.forward(batch.inputs(self.runner.spec.device)))
            failed = self._second_passes(out)
        except Exception as exc:  # the batch's work fails; the engine and every other request go on
            log.exception("pic: a forward failed")
            outputs = [self._finish(seq, exc) for seq in batch.sequences() if not seq.is_finished]
            return outputs + [o for prefill, _ in batch.pieces for o in self._prefill_failed(prefill, exc)]
        self.num_steps += 1
        self.num_batched_seqs += len(batch.passes) + len(batch.pieces) + len(batch.decodes)
        return [self._finish(seq, exc) for seq, exc in failed] + self.update_from_output(out)

    def _second_passes(self, out: StepOutput) -> list[tuple[Sequence, Exception]]:
        """The probes that ended in this forward (query-aware policies): each policy chooses from its probe, the
        chunk blocks its second pass writes become private copies, and one more forward runs the second passes
        together; their results replace the probes' in ``out``. Returns the requests whose policy failed on its
        probe (a malformed choice, an exception of its own), with why."""
        probed, failed = [], []
        for i, (piece, _) in enumerate(out.passes):
            if piece.ends and piece.seq.link.pass_.is_probe:
                try:
                    self.kv.copy_written(piece.seq, self.linker.probe_done(piece.seq.link))
                    probed.append(i)
                except Exception as exc:  # a policy's own bug fails its request, not the batch
                    if not isinstance(exc, PicError):
                        log.exception("pic: policy %r failed on its probe", piece.seq.policy.spec)
                    failed.append((piece.seq, exc))
        if probed:
            second = self.runner.forward([out.passes[i][0].seq.link.pass_.seq_input() for i in probed])
            for i, h in zip(probed, second, strict=True):
                out.passes[i] = (out.passes[i][0], h)
        return failed

    def update_from_output(self, out: StepOutput) -> list[RequestOutput]:
        """After the forward, in one place: end the passes (park a link, or sample its first token), make the
        chunks compiled resident, sample one token per decoding sequence."""
        rows: list[tuple[Sequence, torch.Tensor]] = []
        parked: list[Sequence] = []
        for piece, h in out.passes:
            seq = piece.seq
            if not piece.ends or seq.is_finished:  # (goes on next step; or its policy failed on its probe)
                continue
            self.linker.pass_done(seq.link)
            self.kv.pass_done(seq)
            if seq.sampling is None:  # PIC.link: park with the query's hidden states (Linked.logits)
                seq.park(h)
                parked.append(seq)
            else:
                seq.run()
                rows.append((seq, h[-1]))
        for prefill in out.pieces:
            if prefill.is_done:
                self._chunk_done(prefill)
        if parked and self.runner.spec.device.type == "cuda":
            torch.cuda.synchronize(self.runner.spec.device)  # link returns with the pass done (its time is honest)
        for seq in parked:
            seq.sink.put(link_output(seq))
        return self._sampled(rows + [(seq, h[-1]) for seq, h in out.decodes])

    def _sampled(self, rows: list[tuple[Sequence, torch.Tensor]]) -> list[RequestOutput]:
        """Sample a token for each ``(sequence, final hidden state)``; put it out, or finish the sequence."""
        outputs = []
        for sampled in self.decoder.sample(rows):
            seq = sampled.seq
            if sampled.finish is None:
                outputs.append(token_output(seq, sampled.text, sampled.token))
                seq.sink.put(outputs[-1])
            else:
                outputs.append(self._finish(seq, sampled.finish, text=sampled.text, token=sampled.token))
        return outputs

    def _chunk_done(self, prefill: ChunkPrefill) -> None:
        """A chunk's last piece ran: it is resident; each request that waited for it holds it now."""
        for seq in self.compiles.chunk_done(prefill):
            if seq.is_finished:  # a request that ended while its chunk compiled
                continue
            self.kv.hold(seq, prefill.cache_id)
            self.sources.compiled(seq, prefill.cache_id)

    def _prefill_failed(self, prefill: ChunkPrefill, error: Exception) -> list[RequestOutput]:
        """A chunk prefill cannot run: its compile calls fail, and so do the requests that waited for it."""
        return [self._finish(seq, error) for seq in self.compiles.prefill_failed(prefill, error)]

    def _finish(
        self, seq: Sequence, why: FinishReason | Exception, *, text: str = "", token: int | None = None
    ) -> RequestOutput:
        """Free the sequence's blocks, end it, and hand its last output over."""
        self.scheduler.remove(seq)
        self.kv.free(seq)
        if why is FinishReason.KV_POOL:
            log.warning(
                "pic: request %d stopped after %d tokens: the KV pool is full", seq.request_id, len(seq.output_ids)
            )
        if not isinstance(why, Exception):
            text += self.decoder.flush(seq)
        seq.finish(why)
        out = finish_output(seq, text=text, token=token)
        del self._seqs[seq.request_id]
        seq.sink.put(out)
        return out
