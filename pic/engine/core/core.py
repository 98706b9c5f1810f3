"""``EngineCore``: the batched engine's state and its step, owned by one thread (``pic.engine.core.core_thread``).

Nothing here locks and nothing here is shared: the core thread is the only one that calls it. A step is vLLM v1's:
``scheduler.schedule()`` (decodes, then prefill work under one token budget), one batched forward over what it
chose (recompute passes, chunk-prefill pieces, decode tokens), then ``scheduler.update_from_output(batch,
output)``, the one place a step's results (and the store's answers) land; a probe that ended has its second pass
run at once, a second forward in the same step. The commands (``pic.engine.commands``) call the rest between two
steps.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future

import torch

from pic.config import PICConfig
from pic.engine.core.batch import ForwardOutput, ScheduledBatch
from pic.engine.core.chunk_sources import ChunkSources
from pic.engine.core.compile_calls import CompileCalls
from pic.engine.core.decoding import Decoder
from pic.engine.core.kv_manager import KVManager
from pic.engine.core.loader import Loader
from pic.engine.core.scheduler import Scheduler
from pic.engine.core.sequence import Sequence, Status, Transition
from pic.engine.generation import FinishReason
from pic.engine.request import CompileJob, NewRequest, OutputSink, RequestOutput
from pic.engine.sampling import SamplingParams
from pic.link.linker import Linker
from pic.model import ModelRunner

log = logging.getLogger("pic")


class EngineCore:
    """Continuous batching of linked requests and chunk compiles over one model (``runner``), KV pool (its blocks
    are ``kv``'s) and chunk store (``kv.store``: its device tier is the pool's resident chunks); ``linker`` plans each
    request's link and its recompute pass."""

    def __init__(
        self,
        *,
        runner: ModelRunner,
        tokenizer: object,
        kv: KVManager,
        linker: Linker,
        config: PICConfig,
        bos_token_id: int | None,
        eos_token_ids: frozenset[int],
    ) -> None:
        self.runner, self.kv, self.pool, self.cache, self.store = runner, kv, kv.pool, kv.cache, kv.store
        self.loader = Loader(self.store, wake=lambda: self.wake())
        self.sources = ChunkSources(self.store, self.loader, bos_token_id=bos_token_id)
        self.compiles = CompileCalls(self.sources, kv.pool, kv=kv, busy=lambda: self.scheduler.queues.num_active > 0)
        self.decoder = Decoder(runner, tokenizer, eos_token_ids=eos_token_ids)
        self.scheduler = Scheduler(
            kv, linker, self.sources, self.compiles, self.decoder, device=runner.spec.device, config=config
        )
        self.num_steps = self.num_batched_seqs = 0  # steps that ran a forward, and the sequences in them
        self.closed = False  # ``close`` ran: the core thread ends
        self.wake = lambda: None  # called from a loader thread when store I/O is done (the core thread sets it)

    # -- commands (``pic.engine.commands.Core``) --------------------------------------------------------------

    def add(self, new: NewRequest) -> None:
        """Queue a new request for its recompute pass (``sampling=None``: park it after the pass)."""
        seq = Sequence(new)
        if seq.sampling is not None:
            seq.generate(seq.sampling, self.decoder.start(seq.sampling))
        self.scheduler.queues.add(seq)

    def resume(self, request_id: int, params: SamplingParams, *, link_s: float, sink: OutputSink) -> bool:
        """Start generating from a parked sequence (``Linked.generate``), its outputs going to ``sink`` from now on;
        whether it was parked."""
        queues = self.scheduler.queues
        seq = queues.requests.get(request_id)
        if seq is None or seq.status is not Status.PARKED:
            return False
        queues.move(seq, Transition.RESUME)
        seq.generate(params, self.decoder.start(params), sink=sink, link_s=link_s)
        return True

    def abort(self, request_id: int) -> None:
        """Stop a sequence and free its blocks; unknown or finished ids are ignored (a release after the end)."""
        seq = self.scheduler.queues.requests.get(request_id)
        if seq is not None:
            self.scheduler.finish(seq, FinishReason.ABORT)

    def compile(self, job: CompileJob, reply: Future) -> None:
        """Start compiling ``job``'s chunks as scheduled work; ``reply`` gets the ids compiled once every chunk is
        held by some tier (``CompileCalls``)."""
        self.compiles.add(job, reply)

    def step_once(self, *, paced: bool = True) -> None:
        """One step, if any work can run (``paced=False``: not counting requests that wait for ``Step``). A step
        fails only its own requests; anything that escapes it is a bug, which fails every open request."""
        if not self.scheduler.has_work(paced=paced):
            return
        try:
            self.step()
        except Exception as exc:
            log.exception("pic: an engine step failed; failing the open requests")
            self.fail_all(exc)

    def close(self, error: Exception) -> None:
        self.fail_all(error)
        self.closed = True

    def fail_all(self, error: Exception) -> None:
        """End every sequence and compile call with ``error`` and free their blocks."""
        for seq in list(self.scheduler.queues.requests.values()):
            self.scheduler.fail(seq, error, quiet=True)
        self.compiles.fail_all(error)
        self.loader.close()

    def retry_writes(self) -> None:
        """Write the chunks a lower tier failed to take (``TieredStore.backlog``) again, when due: from the pool
        while they are resident there (on the loader's writer thread, nobody waiting), else forgotten."""
        for cache_id in self.store.backlog.due() if self.store.lower else ():
            try:
                if self.store.device.contains(cache_id):
                    self.loader.write_back(self.store.copy_for_lower(cache_id))
                    continue
            except Exception:  # a retry never stops the engine
                log.exception("pic: could not retry writing chunk %s to the lower tiers", cache_id)
            self.store.backlog.forget(cache_id, evicted=True)

    def next_timer_s(self) -> float | None:
        """Seconds until ``retry_writes`` has work (``None``: none pending): how long an idle core may sleep."""
        return self.store.backlog.next_due_s() if self.store.lower else None

    def forget_chunk(self, cache_id: str) -> bool:
        """Drop a chunk from the pool and the engine's memory of its tokens (an expired id is unknown); whether the
        pool held it."""
        self.sources.forget(cache_id)
        return self.store.device.delete(cache_id)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, vocab_size]`` float32 logits of final hidden states ``hidden`` ``[N, hidden_size]``."""
        return self.runner.logits(hidden)

    # -- the step: schedule -> execute -> update ---------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the batch's forward, let the scheduler take its results in, then the second passes of the
        probes that ended; returns what each request produced (already in its sink)."""
        batch = self.scheduler.schedule()
        outputs = self.scheduler.update_from_output(batch, self._execute(batch))
        second = self.scheduler.second_passes()
        if second.has_forward:
            outputs += self.scheduler.update_from_output(second, self._execute(second))
        return outputs

    def _execute(self, batch: ScheduledBatch) -> ForwardOutput:
        """The batch's forward (none without work for one); a forward that raises fails the batch's work only."""
        if not batch.has_forward:
            return ForwardOutput()
        try:
            inputs = batch.inputs(self.runner.spec.device)
            hidden = self.runner.forward(inputs)
        except Exception as exc:
            log.exception("pic: a forward failed")
            return ForwardOutput(error=exc)
        self.num_steps += 1
        self.num_batched_seqs += len(inputs)
        return ForwardOutput(hidden)
