"""``EngineCore``: the batched engine's state and its step, owned by one thread (``pic.engine.core_thread``).

Nothing here locks and nothing here is shared: the core thread is the only one that calls it. A step reads
top to bottom: take in the loader's answers, schedule (decodes, then prefill work under one token budget),
run one batched forward over recompute passes, chunk-prefill pieces and decode tokens, then postprocess:
finish the chunks compiled, sample each request's next token with its own options and generator, and put
every output in its request's sink, in the order it was produced.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future

import torch

from pic.config import PICConfig
from pic.engine.chunk_sources import ChunkSources
from pic.engine.compile_call import CompileCalls
from pic.engine.decoding import Decoder
from pic.engine.generation import FinishReason
from pic.engine.kv_manager import KVManager
from pic.engine.loader import Loader
from pic.engine.outputs import finish_output, link_output
from pic.engine.request import CompileJob, NewRequest, OutputSink, RequestOutput
from pic.engine.sampling import SamplingParams
from pic.engine.scheduler import ScheduledBatch, Scheduler
from pic.engine.sequence import Sequence, Status, decode_inputs
from pic.kv import BlockPool, KVCache
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
        config: PICConfig,
        bos_token_id: int | None,
        eos_token_ids: frozenset[int],
    ) -> None:
        self.runner, self.pool, self.cache, self.store, self.kv = runner, pool, cache, store, kv
        self.loader = Loader(store, wake=lambda: self.wake())
        self.sources = ChunkSources(store, self.loader, bos_token_id=bos_token_id, next_order=time.perf_counter)
        self.compiles = CompileCalls(self.sources, self.loader, pool, kv_bytes_per_token=runner.spec.kv_bytes_per_token)
        self.scheduler = Scheduler(
            kv, self.sources, max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            prefill_order=config.prefill_order, compile_share=config.compile_share,
            frees_soon=lambda: self.compiles.num_writing > 0,
        )  # fmt: skip
        self.decoder = Decoder(runner, tokenizer, eos_token_ids=eos_token_ids, finish=self._finish)
        self.num_steps = self.num_batched_seqs = 0  # steps that ran a forward, and the sequences in them
        self._seqs: dict[int, Sequence] = {}  # every unfinished sequence (parked ones included)
        self.wake = lambda: None  # set by the core thread

    # -- commands ----------------------------------------------------------------------------------

    def add(self, new: NewRequest) -> None:
        """Queue a new request for its recompute pass (``sampling=None``: park it after the pass)."""
        seq = Sequence(new)
        self._seqs[seq.request_id] = seq
        if seq.sampling is not None:
            self.decoder.start(seq, seq.sampling)
        self.scheduler.add(seq)

    def resume(self, request_id: int, params: SamplingParams, *, link_s: float, sink: OutputSink) -> bool:
        """Start generating from a parked sequence (``Linked.generate``), its outputs going to ``sink`` from
        now on; whether it was parked."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.status is not Status.PARKED:
            return False
        self.decoder.start(seq, params)
        seq.sampling, seq.link_s, seq.resumed_s, seq.sink = params, link_s, time.perf_counter(), sink
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
        ready = any(s.status is Status.RUNNING or not s.pending or any(f.done() for f in s.pending.values()
                    if isinstance(f, Future)) for s in seqs)  # fmt: skip
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

    # -- the step: schedule -> run -> postprocess --------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Take in store answers, schedule, run one batched forward, postprocess; returns what each request
        produced (already in its sink)."""
        self.compiles.poll()
        batch = self.scheduler.schedule()
        outputs = [self._finish(seq, why) for seq, why in batch.failed]
        for prefill, error in batch.failed_prefills:
            outputs += [self._finish(seq, error) for seq in self.compiles.prefill_failed(prefill, error)]
        if batch.resumed:  # their first token comes from the hidden state their pass left: no need to wait
            outputs += self._start_generating(batch.resumed)  # for this step's forward
        if batch.has_forward:
            outputs += self._run(batch)
        self.compiles.poll()
        return outputs

    def _run(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """The forward over the batch's passes, pieces and decode tokens, then one token per sampling sequence."""
        start = time.perf_counter()
        passes = batch.prefills + batch.partial  # (passes that end this step first: second passes index them)
        for seq in passes:
            seq.scheduled_s = seq.scheduled_s or start
        inputs = [seq.pass_.seq_input(seq.num_piece_tokens) for seq in passes] + [piece for _, piece in batch.pieces]
        inputs += decode_inputs(batch.decodes, self.runner.spec.device)
        try:
            hidden = self.runner.forward(inputs) if inputs else []
            hidden, failed = self.decoder.second_passes(self.kv, batch.prefills, hidden)
        except Exception as exc:  # the batch's work fails; the engine and every other request go on
            log.exception("pic: a forward failed")
            outputs = [self._finish(seq, exc) for seq in passes + batch.decodes]
            for prefill, _ in batch.pieces:
                outputs += [self._finish(seq, exc) for seq in self.compiles.prefill_failed(prefill, exc)]
            return outputs
        outputs = [self._finish(seq, exc) for seq, exc in failed]
        self.num_steps += bool(inputs)
        self.num_batched_seqs += len(inputs)
        for prefill, _ in batch.pieces:
            if prefill.is_done:
                self.compiles.chunk_done(prefill)
        return outputs + self._postprocess(batch, hidden)

    def _postprocess(self, batch: ScheduledBatch, hidden: list[torch.Tensor]) -> list[RequestOutput]:
        """Park the linked sequences, sample a token for every sequence that generates."""
        now = time.perf_counter()
        rows: list[tuple[Sequence, torch.Tensor]] = []
        parked = []
        for seq, h in zip(batch.prefills, hidden, strict=False):
            if seq.is_finished:  # its policy failed on its probe
                continue
            self.kv.pass_done(seq)
            seq.linked_s = seq.linked_s or now
            if seq.sampling is None:  # PIC.link: park with the query's hidden states (Linked.logits)
                seq.park(h)
                parked.append(seq)
            else:
                seq.run()
                rows.append((seq, h[-1]))
        if parked and self.runner.spec.device.type == "cuda":
            torch.cuda.synchronize(self.runner.spec.device)  # link returns with the pass done (its time is honest)
        for seq in parked:
            seq.sink.put(link_output(seq))
        num_before = len(batch.prefills) + len(batch.partial) + len(batch.pieces)
        rows += [(seq, h[-1]) for seq, h in zip(batch.decodes, hidden[num_before:], strict=True)]
        return self.decoder.sample_and_append(rows)

    def _start_generating(self, resumed: list[Sequence]) -> list[RequestOutput]:
        """The first token of each parked sequence whose generation starts, from its query's last hidden state."""
        for seq in resumed:
            seq.run()
        return self.decoder.sample_and_append([(seq, seq.query_hidden[-1]) for seq in resumed])

    def _finish(
        self, seq: Sequence, why: FinishReason | Exception, *, text: str = "", token: int | None = None
    ) -> RequestOutput:
        """Free the sequence's blocks, end it, and hand its last output over."""
        self.scheduler.remove(seq)
        self.kv.release(seq)
        if why is FinishReason.KV_POOL:
            log.warning(
                "pic: request %d stopped after %d tokens: the KV pool is full", seq.request_id, len(seq.output_ids)
            )
        if not isinstance(why, Exception) and seq.detokenizer is not None:
            text += seq.detokenizer.flush()
        seq.finish(why)
        out = finish_output(seq, text=text, token=token)
        del self._seqs[seq.request_id]
        seq.sink.put(out)
        return out
