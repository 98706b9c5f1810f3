"""``EngineCore``, the batched engine's state and its step, and ``CoreThread``, the one thread that runs it (vLLM's
EngineCore and its busy loop, in-process): nothing else touches the core, its pool or its device tier, so nothing
locks. Outputs reach their clients through the requests' sinks, answers through the commands' futures.

A step is vLLM v1's: ``scheduler.schedule()``, one batched forward over what it chose, then
``scheduler.update_from_output(batch, output)``, the one place a step's results (and the store's answers) land; a
probe that ended has its second pass run at once, a second forward in the same step. The thread blocks on its
command queue while no work can run (an idle engine costs no CPU; a request waiting on the loader is woken by a
``Wake``), else runs every command that arrived (``pic.engine.commands``), then one step.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from typing import TypeVar

import torch

from pic.config import PICConfig
from pic.engine.commands import Close, Command, DeviceOp, ObserveAttention, Pause, StepCounts, Wake, wait
from pic.engine.core.batch import ForwardOutput, ScheduledBatch
from pic.engine.core.chunk_sources import ChunkSources
from pic.engine.core.compile_calls import CompileCalls
from pic.engine.core.decoding import Decoder
from pic.engine.core.kv_manager import KVManager
from pic.engine.core.loader import Loader
from pic.engine.core.scheduler import Scheduler
from pic.engine.core.sequence import Sequence, Status, Transition
from pic.engine.generation import FinishReason
from pic.engine.request import CompileJob, NewRequest, OutputSink
from pic.errors import EngineClosedError, EngineStepError
from pic.kv import KVStats
from pic.link.linker import Linker
from pic.model import ModelRunner
from pic.model.executor import Executor
from pic.model.inputs import AttentionObserver
from pic.sampling import SamplingParams

log = logging.getLogger("pic")
_T = TypeVar("_T")


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
        self.compiles = CompileCalls(self.sources, kv=kv, busy=lambda: self.scheduler.queues.num_active > 0)
        self.executor = Executor(runner)  # the device: forwards, the LM head and sampling
        max_context, generator = runner.spec.max_context, self.executor.generator
        self.decoder = Decoder(tokenizer, eos_token_ids=eos_token_ids, max_context=max_context, generator=generator)
        self.scheduler = Scheduler(kv, linker, self.sources, self.compiles, self.decoder, config=config)
        self.closed = False  # ``close`` ran: the core thread ends
        self.closed_error: Exception | None = None  # why (refused to every later command)
        self._observing: contextlib.AbstractContextManager | None = None  # an attention observer installed
        self.wake = lambda: None  # called from a loader thread when store I/O is done (the core thread sets it)

    def add(self, new: NewRequest) -> None:
        """Queue a new request for its recompute pass (``sampling=None``: park it after the pass)."""
        seq = Sequence(new)
        if seq.sampling is not None:
            seq.generate(seq.sampling, self.decoder.start(seq.sampling))
        self.scheduler.queues.add(seq)

    def resume(self, request_id: int, params: SamplingParams, *, link_s: float, sink: OutputSink) -> bool:
        """Start generating from a parked sequence (``Linked.generate``); whether it was parked."""
        queues = self.scheduler.queues
        seq = queues.requests.get(request_id)
        if seq is None or seq.status is not Status.PARKED:
            return False
        decoding = self.decoder.start(params)  # first: if it raises, the sequence stays parked
        queues.move(seq, Transition.RESUME)
        seq.generate(params, decoding, sink=sink, link_s=link_s)
        return True

    def abort(self, request_id: int) -> None:
        """Stop a sequence and free its blocks; unknown or finished ids are ignored (a release after the end)."""
        seq = self.scheduler.queues.requests.get(request_id)
        if seq is not None:
            self.scheduler.finish(seq, FinishReason.ABORT)

    def compile(self, job: CompileJob, reply: Future) -> None:
        """Start compiling ``job``'s chunks as scheduled work (``CompileCalls``)."""
        self.compiles.add(job, reply)

    def step_once(self, *, include_paced: bool = True) -> None:
        """One step, if any work can run (``include_paced=False``: not counting requests that wait for ``Step``). A step
        fails only its own requests (``_step_failed``)."""
        if not self.scheduler.has_work(include_paced=include_paced):
            return
        try:
            self.step()
        except Exception as exc:
            log.exception("pic: an engine step failed")
            self._step_failed(exc)

    def _step_failed(self, exc: Exception) -> None:
        """The one rule for a step that fails: what escaped it (a bug: a request's own errors fail it inside the
        step) fails the work the step may have touched, every open request but the parked links and every compile
        call, with an ``EngineStepError``; the loader, the writer and the pool go on, and the next request is
        served. Then the KV manager audits the pool against what still holds blocks: where it does not add up, the
        state cannot be trusted, and the engine closes (every later call: ``EngineClosedError``)."""
        error = EngineStepError.of(exc)
        for seq in list(self.scheduler.queues.requests.values()):
            if seq.status is not Status.PARKED:
                self.scheduler.fail(seq, error, quiet=True)
        self.compiles.fail_all(error)
        for prefill in self.sources.drop_abandoned():
            self.kv.abort(prefill)
        problem = self.kv.audit(self.scheduler.queues.requests.values(), self.sources.prefills.values())
        if problem is not None:
            log.error("pic: the KV pool does not add up after a failed step (%s): closing the engine", problem)
            self.close(EngineClosedError(f"the engine closed: a failed step left its KV pool inconsistent ({problem})"))

    def close(self, error: Exception) -> None:
        """Fail every open request and compile call with ``error``, stop the loader, and end the core thread."""
        for seq in list(self.scheduler.queues.requests.values()):
            self.scheduler.fail(seq, error, quiet=True)
        self.compiles.fail_all(error)
        self.loader.close()
        self.closed, self.closed_error = True, error

    def forget_chunk(self, cache_id: str) -> bool:
        """Drop a chunk from the pool and from the engine's memory of its tokens; whether the pool held it."""
        self.sources.forget(cache_id)
        return self.store.device.delete(cache_id)

    # -- the typed queries of the callers (``pic.engine.commands``) --------------------------------------------

    def step_counts(self) -> StepCounts:
        return StepCounts(self.executor.num_steps, self.executor.num_batched_seqs)

    def kv_stats(self) -> KVStats:
        return self.pool.stats()

    def reset_peak(self) -> None:
        self.kv.reset_peak()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, vocab_size]`` float32 logits of final hidden states ``hidden`` ``[N, hidden_size]``."""
        return self.executor.logits(hidden)

    def on_device(self, op: DeviceOp, cache_id: str, readable: Mapping[str, bytes] | None) -> object:
        device = self.store.device
        match op:
            case DeviceOp.CONTAINS:
                return device.contains(cache_id)
            case DeviceOp.EXTENT:
                return device.extent(cache_id, readable=readable)
            case DeviceOp.PEEK:
                return device.peek(cache_id, readable=readable)
            case DeviceOp.PIN:
                return device.pin(cache_id)
            case DeviceOp.UNPIN:
                return device.unpin(cache_id)
            case DeviceOp.IDS:
                return device.ids()
            case DeviceOp.STATS:
                return device.stats()
            case DeviceOp.FORGET:
                return self.forget_chunk(cache_id)
        raise AssertionError(op)

    def observe_attention(self, observer: AttentionObserver | None) -> None:
        """``ModelRunner.observe_attention`` from now on (``None``: no more)."""
        if self._observing is not None:
            self._observing.__exit__(None, None, None)
            self._observing = None
        if observer is not None:
            self._observing = self.runner.observe_attention(observer)
            self._observing.__enter__()

    def step(self) -> None:
        """Schedule, let the executor run the batch (forward and sampling), let the scheduler take its results in
        (each request's outputs go to its sink), then the second passes of the probes that ended."""
        batch = self.scheduler.schedule()
        self.scheduler.update_from_output(batch, self._execute(batch))
        second = self.scheduler.second_passes()
        if second.has_forward:
            self.scheduler.update_from_output(second, self._execute(second))

    def _execute(self, batch: ScheduledBatch) -> ForwardOutput:
        """The batch run by the executor (its forward, then the tokens it samples); a forward or a sampling that
        raises fails the batch's work only."""
        if not (batch.has_forward or batch.resumed):
            return ForwardOutput()
        try:
            plan, request_ids = batch.plan(self.runner.spec.device)
            result = self.executor.execute(plan)
        except Exception as exc:
            log.exception("pic: a step's forward or sampling failed")
            return ForwardOutput(error=EngineStepError.of(exc))
        return ForwardOutput(result.hidden, dict(zip(request_ids, result.tokens, strict=True)))


class CoreThread:
    """The thread that owns a core, and the one way in (``pic.engine.commands.Channel``). Holds no reference to the
    ``Engine`` it serves, so dropping the engine can close it."""

    def __init__(self, core: EngineCore) -> None:
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._core = core
        core.wake = lambda: self._commands.put(Wake())
        self._thread = threading.Thread(target=run, args=(core, self._commands), name="pic-engine", daemon=True)
        self._closed = False
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def is_current(self) -> bool:
        return threading.current_thread() is self._thread

    def send(self, command: Command) -> None:
        """Queue ``command`` (``EngineClosedError`` once the engine is closed)."""
        if self._closed:
            raise EngineClosedError("the engine was closed; build a new one")
        if self._core.closed:  # (closed itself: a failed step left it inconsistent)
            raise EngineClosedError(f"{self._core.closed_error}; build a new one")
        self._commands.put(command)

    def call(self, make: Callable[[Future], Command]) -> object:
        reply: Future = Future()
        self.send(make(reply))
        return wait(reply, self.alive)

    @contextlib.contextmanager
    def paused(self) -> Iterator[EngineCore]:
        entered, resume = Future(), threading.Event()
        self.send(Pause(entered, resume))
        try:
            yield wait(entered, self.alive)
        finally:
            resume.set()

    @contextlib.contextmanager
    def observing(self, observer: AttentionObserver) -> Iterator[None]:
        """``ModelRunner.observe_attention`` on the core's runner while the block runs."""
        self.call(lambda reply: ObserveAttention(observer, reply))
        try:
            yield
        finally:
            self.call(lambda reply: ObserveAttention(None, reply))

    def close(self) -> None:
        """Close the engine: open requests fail with ``EngineClosedError``; waits for the thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._commands.put(Close())
        if not self.is_current:
            self._thread.join(timeout=60)


def run(core: EngineCore, commands: queue.SimpleQueue[Command]) -> None:
    """Serve ``commands`` until one closes the core; then refuse whatever is still queued. An idle core sleeps
    until a command comes or a retry of failed writes is due (``Loader.retry_writes``)."""
    while not core.closed:
        if core.store.lower:  # (only a lower tier fails writes)
            core.loader.retry_writes()
        idle = not core.scheduler.has_work(include_paced=False)
        due_s = core.store.backlog.next_due_s() if idle and core.store.lower else None  # (a retry of failed writes)
        command = _next(commands, wait=idle, timeout_s=due_s)
        while command is not None and not core.closed:
            try:
                command.run(core)
            except Exception as exc:  # its exception is its answer
                command.refuse(exc)
            command = _next(commands) if not core.closed else None
        if not core.closed:
            core.step_once(include_paced=False)
    error = core.closed_error or EngineClosedError("the engine was closed")
    while (command := _next(commands)) is not None:  # no client waits forever
        command.refuse(error)


def _next(commands: queue.SimpleQueue, *, wait: bool = False, timeout_s: float | None = None) -> Command | None:
    try:
        return commands.get(block=wait, timeout=timeout_s)
    except queue.Empty:
        return None
