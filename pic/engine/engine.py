"""The engine: owns the scheduler, the pool and the runner, and steps them; one forward per step.

Every step runs, in one batched forward, the recompute passes of the requests it admits and the next
token of every running one, then samples each request's next token with its own options and
generator (logits only for the rows it samples) and detokenizes incrementally. Other threads never
touch its state: ``add_request``, ``abort`` and the facade hand work to an inbox that the stepping
thread drains at the start of each step (see ``Driver``).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

import torch

from pic.config import PICConfig
from pic.engine.detokenizer import Detokenizer
from pic.engine.driver import Driver
from pic.engine.linker import Linker
from pic.engine.outputs import finish_output, token_output
from pic.engine.request import Request, RequestOutput, prompt_ids
from pic.engine.scheduler import ScheduledBatch, Scheduler
from pic.engine.sequence import Sequence, Status, decode_inputs
from pic.link import SamplingParams
from pic.link.generate import FinishReason
from pic.link.policies import Policy
from pic.link.sampling import sample_rows
from pic.model import ModelRunner

log = logging.getLogger("pic")


class Engine:
    """Continuous batching of linked requests over one model, KV pool and chunk store.

    Use it iteratively (``add_request``, then ``step`` until ``has_unfinished()`` is false), or through
    ``PIC``'s synchronous facade (``link``, ``generate_many``), which drives it for you. Only one thread
    steps at a time; ``add_request`` and ``abort`` may be called from any thread.
    """

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: object,
        linker: Linker,
        *,
        config: PICConfig,
        default_policy: Policy,
        bos_token_id: int | None,
        eos_token_ids: frozenset[int],
        lock: threading.RLock,
    ) -> None:
        self.runner, self.tokenizer, self.linker = runner, tokenizer, linker
        self.config, self.default_policy = config, default_policy
        self.bos_token_id, self.eos_token_ids = bos_token_id, eos_token_ids
        self.scheduler = Scheduler(
            linker, max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens
        )
        self.lock = lock  # held for each step; the store's methods take it too
        self.driver = Driver()
        self.num_steps = self.num_batched_seqs = 0  # steps that ran a forward, and the sequences in them
        # Work handed in by any thread, run by the owner at the start of a step. Deque appends and pops are
        # atomic, so handing work in takes no lock.
        self._inbox: deque[Callable[[], RequestOutput | None]] = deque()
        self._releases: deque[Sequence] = deque()
        self._stepping = False
        self._seqs: dict[int, Sequence] = {}
        self._ids = itertools.count()
        # Every step queues its kernels on one CUDA stream, whichever thread steps (a thread may have made
        # another stream current): the KV one step writes is then written before a later step reads it.
        device = runner.spec.device
        self._stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

    # -- handing work in (any thread) --------------------------------------------------------------

    def add_request(self, request: Request) -> int:
        """Queue a request; returns its id. Its outputs come from ``step``.

        Raises:
            InvalidInputError: an empty query, a bad token id.
        """
        return self.submit(request, watched=False).request_id

    def abort(self, request_id: int) -> None:
        """Stop a request at the next step (a final ``RequestOutput`` with ``FinishReason.ABORT``)."""
        self._inbox.append(lambda: self._abort(self._seqs.get(request_id)))

    def submit(self, request: Request, *, watched: bool, park: bool = False) -> Sequence:
        """Tokenize and queue a request; ``park`` stops it after its recompute pass (``PIC.link``)."""
        prefix_ids, query_ids = prompt_ids(
            request,
            self.tokenizer,
            vocab_size=self.runner.spec.vocab_size,
            bos_token_id=self.bos_token_id if self.config.add_bos else None,
        )
        seq = Sequence(
            next(self._ids),
            cache_ids=request.cache_ids,
            prefix_ids=prefix_ids,
            query_ids=query_ids,
            policy=request.policy or self.default_policy,
            sampling=None if park else request.sampling,
            watched=watched,
        )
        if not park:
            self._start_generation(seq, request.sampling)
        self._inbox.append(lambda: self._add(seq))
        return seq

    def resume(self, seq: Sequence, params: SamplingParams) -> None:
        """Start generating from a parked sequence."""
        self._inbox.append(lambda: self._resume(seq, params))

    def release(self, seq: Sequence) -> None:
        """Free a sequence's blocks (abort it if it is still generating): now if no thread is stepping the
        engine, else at the start of the next step. Safe from a finalizer, in any thread."""
        self._releases.append(seq)
        self.driver.try_run(self._drain_releases)

    def call(self, fn: Callable[[], object]) -> object:
        """Run ``fn`` on the thread that owns the engine, between two steps; returns its result."""
        future: Future = Future()

        def run() -> None:
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)

        self._inbox.append(run)
        self.run_until(future.done)
        return future.result()

    def run_until(self, done: Callable[[], bool]) -> None:
        """Step until ``done()`` (or wait while another thread steps)."""
        self.driver.run_until(done, step=self.step, has_work=self.has_unfinished)

    def has_unfinished(self) -> bool:
        """Whether a request is queued or running (parked ones do not count) or work was handed in."""
        return bool(self._inbox or self._releases) or self.scheduler.has_unfinished()

    # -- stepping (the owning thread) ---------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Admit, run one batched forward, sample; returns what each request produced."""
        with self.lock, torch.cuda.stream(self._stream):  # no-op off CUDA (None)
            outputs = self._drain_releases() + self._drain_inbox()
            self._stepping = True
            try:
                batch = self.scheduler.schedule()
                outputs += [self._finish(seq, why) for seq, why in batch.failed]
                if batch.prefills or batch.decodes or batch.resumed:
                    outputs += self._run(batch)
            finally:
                self._stepping = False
            self._deliver(outputs)
        self.driver.step_done()
        return outputs

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            seq = self._seqs[out.request_id]
            if seq.watched:
                seq.outbox.append(out)
            if out.finished:
                del self._seqs[out.request_id]

    def _drain_releases(self) -> list[RequestOutput]:
        """Abort the sequences handed to ``release`` (not from inside a step: a finalizer may run there)."""
        outputs = []
        with self.lock:
            while self._releases and not self._stepping:
                out = self._abort(self._releases.popleft())
                if out is not None:
                    outputs.append(out)
            self._deliver(outputs)
        return outputs

    def _drain_inbox(self) -> list[RequestOutput]:
        outputs = []
        while self._inbox:
            out = self._inbox.popleft()()
            if out is not None:
                outputs.append(out)
        return outputs

    def _add(self, seq: Sequence) -> None:
        self._seqs[seq.request_id] = seq
        self.scheduler.add(seq)

    def _resume(self, seq: Sequence, params: SamplingParams) -> None:
        self._start_generation(seq, params)
        seq.sampling, seq.resumed_s = params, time.perf_counter()
        self.scheduler.add(seq)

    def _abort(self, seq: Sequence | None) -> RequestOutput | None:
        return None if seq is None or seq.is_finished else self._finish(seq, FinishReason.ABORT)

    def _run(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """The forward over the batch's passes and decode tokens, then one token per sampling sequence."""
        start = time.perf_counter()
        for seq in batch.prefills:
            seq.scheduled_s = seq.scheduled_s or start
        device = self.runner.spec.device
        inputs = [seq.pass_.seq_input() for seq in batch.prefills] + decode_inputs(batch.decodes, device)
        try:
            hidden = self.runner.forward(inputs) if inputs else []
        except Exception as exc:  # the batch's requests fail; the engine and every other request go on
            log.exception("pic: a forward failed")
            return [self._finish(seq, exc) for seq in batch.prefills + batch.decodes]
        self.num_steps += bool(inputs)
        self.num_batched_seqs += len(inputs)
        now = time.perf_counter()
        rows: list[tuple[Sequence, torch.Tensor]] = []
        outputs = []
        for seq, h in zip(batch.prefills, hidden, strict=False):
            self.linker.pass_done(seq)
            seq.linked_s = seq.linked_s or now
            if seq.sampling is None:  # PIC.link: park with the query's hidden states (Linked.logits)
                seq.query_hidden, seq.status = h, Status.PARKED
            else:
                rows.append((seq, h[-1]))
        rows += [(seq, h[-1]) for seq, h in zip(batch.decodes, hidden[len(batch.prefills) :], strict=True)]
        rows += [(seq, seq.query_hidden[-1]) for seq in batch.resumed]
        for seq, _ in rows:
            if seq.sampling.max_new_tokens == 0:
                outputs.append(self._finish(seq, FinishReason.LENGTH))
        rows = [(seq, h) for seq, h in rows if not seq.is_finished]
        for (seq, _), token in zip(rows, self._sample(rows), strict=True):
            outputs.append(self._append(seq, token))
        return outputs

    def _sample(self, rows: list[tuple[Sequence, torch.Tensor]]) -> list[int]:
        """Each row's next token, with its sequence's options and generator; logits of these rows only."""
        if not rows:
            return []
        logits = self.runner.logits(torch.stack([h for _, h in rows]))  # [B, vocab_size] float32
        return sample_rows(logits, [seq.sampling for seq, _ in rows], [seq.generator for seq, _ in rows])

    def _append(self, seq: Sequence, token: int) -> RequestOutput:
        """Record a sampled token; finish the sequence when it ends the generation."""
        seq.first_token_s = seq.first_token_s or time.perf_counter()
        seq.output_ids.append(token)
        if token in self.eos_token_ids:
            return self._finish(seq, FinishReason.EOS, token=token)
        text = seq.detokenizer.add(token)
        if seq.detokenizer.stopped:
            reason = FinishReason.STOP
        elif len(seq.output_ids) >= seq.sampling.max_new_tokens:
            reason = FinishReason.LENGTH
        elif seq.num_prompt_tokens + len(seq.output_ids) >= self.runner.spec.max_context:
            reason = FinishReason.CONTEXT
        else:
            seq.status = Status.RUNNING
            return token_output(seq, text, token)
        return self._finish(seq, reason, text=text, token=token)

    def _finish(
        self, seq: Sequence, why: FinishReason | Exception, *, text: str = "", token: int | None = None
    ) -> RequestOutput:
        """Free the sequence's blocks and build its last output."""
        self.scheduler.remove(seq)
        self.linker.release(seq)
        if why is FinishReason.KV_POOL:
            log.warning(
                "pic: request %d stopped after %d tokens: the KV pool is full", seq.request_id, len(seq.output_ids)
            )
        return finish_output(seq, why, text=text, token=token)

    def _start_generation(self, seq: Sequence, params: SamplingParams) -> None:
        seq.detokenizer = Detokenizer(self.tokenizer, stop=params.stop)
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.runner.spec.device).manual_seed(params.seed)
