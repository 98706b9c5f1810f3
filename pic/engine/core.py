"""``EngineCore``: the batched engine's state and its step, owned by one thread (``pic.engine.owner``).

Nothing here locks and nothing here is shared: the owner thread is the only one that calls it. Each step
admits waiting requests (their recompute passes), runs one batched forward over those passes and the next
token of every running request, samples each request's next token with its own options and generator
(logits only for the rows it samples), detokenizes incrementally, and puts every output in its request's
sink, in the order it was produced.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from pic.compile import compile_chunks
from pic.config import CompileOptions, PICConfig
from pic.engine.detokenizer import Detokenizer
from pic.engine.generation import FinishReason
from pic.engine.linker import Linker
from pic.engine.outputs import finish_output, link_output, token_output
from pic.engine.request import NewRequest, OutputSink, RequestOutput
from pic.engine.sampling import SamplingParams, sample_rows, seeded_generator
from pic.engine.scheduler import ScheduledBatch, Scheduler
from pic.engine.sequence import Sequence, Status, decode_inputs
from pic.errors import PicError
from pic.kv import BlockPool, KVCache
from pic.model import ModelRunner
from pic.store import TieredStore

log = logging.getLogger("pic")


@dataclass(frozen=True)
class CompileJob:
    """Chunks to compile (``PIC.compile``), tokenized and addressed by the caller.

    Attributes:
        tokens: cache id -> content tokens, for every chunk of the call.
        options: the compile options of every chunk.
        todo: the ids to compile when no tier holds them (the call's, or the ones a fleet lease gave it).
        progress: show a progress bar (``None``: for 8 or more new chunks).
    """

    tokens: Mapping[str, list[int]]
    options: CompileOptions
    todo: tuple[str, ...]
    progress: bool | None


# Compiling at least this many new chunks shows a progress bar (unless ``progress`` says otherwise).
_PROGRESS_MIN_CHUNKS = 8


class EngineCore:
    """Continuous batching of linked requests over one model, KV pool and chunk store (single-threaded).

    Args:
        runner: the model's batched forward.
        tokenizer: for incremental detokenization.
        pool, cache: the KV pool's allocator and tensors.
        store: the chunk store; its device tier is the pool's resident chunks.
        linker: the block work of admission, growth, preemption and release.
        config: the engine's options.
        bos_token_id: written before a chunk when compiling (``None``: the model has none).
        eos_token_ids: tokens that end a generation.
    """

    def __init__(
        self,
        *,
        runner: ModelRunner,
        tokenizer: object,
        pool: BlockPool,
        cache: KVCache,
        store: TieredStore,
        linker: Linker,
        config: PICConfig,
        bos_token_id: int | None,
        eos_token_ids: frozenset[int],
    ) -> None:
        self.runner, self.tokenizer, self.pool, self.cache = runner, tokenizer, pool, cache
        self.store, self.linker, self.config = store, linker, config
        self.bos_token_id, self.eos_token_ids = bos_token_id, eos_token_ids
        self.scheduler = Scheduler(
            linker, max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens
        )
        self.num_steps = self.num_batched_seqs = 0  # steps that ran a forward, and the sequences in them
        self._seqs: dict[int, Sequence] = {}  # every unfinished sequence (parked ones included)

    # -- commands ----------------------------------------------------------------------------------

    def add(self, new: NewRequest) -> None:
        """Queue a new request for its recompute pass (``sampling=None``: park it after the pass)."""
        seq = Sequence(new)
        self._seqs[seq.request_id] = seq
        if seq.sampling is not None:
            self._start_generation(seq, seq.sampling)
        self.scheduler.add(seq)

    def resume(self, request_id: int, params: SamplingParams, *, link_s: float, sink: OutputSink) -> bool:
        """Start generating from a parked sequence (``Linked.generate``), its outputs going to ``sink`` from
        now on; whether it was parked."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.status is not Status.PARKED:
            return False
        self._start_generation(seq, params)
        seq.sampling, seq.link_s, seq.resumed_s, seq.sink = params, link_s, time.perf_counter(), sink
        self.scheduler.add(seq)
        return True

    def abort(self, request_id: int) -> None:
        """Stop a sequence and free its blocks (a final output with ``FinishReason.ABORT``); unknown or
        finished ids are ignored (a release may arrive after the end)."""
        seq = self._seqs.get(request_id)
        if seq is not None:
            self._finish(seq, FinishReason.ABORT)

    def fail_all(self, error: Exception) -> None:
        """End every sequence with ``error`` and free its blocks (the engine is closing)."""
        for seq in list(self._seqs.values()):
            self._finish(seq, error)

    def has_unfinished(self, *, paced: bool = True) -> bool:
        """Whether a sequence is waiting or running (parked ones do not count); ``paced=False``: one
        that runs without its client asking for steps."""
        seqs = (*self.scheduler.waiting, *self.scheduler.running)
        return any(paced or not seq.paced for seq in seqs)

    def compile(self, job: CompileJob) -> list[str]:
        """Prefill the chunks of ``job.todo`` that no tier holds into the pool, through to the lower tiers,
        and write the resident ones back to lower tiers that lost them; returns the ids it compiled."""
        todo = {cid: job.tokens[cid] for cid in dict.fromkeys(job.todo) if not self.store.contains(cid)}
        for cid in dict.fromkeys(job.todo):  # resident already: make sure the lower tiers have it too
            if cid not in todo and self.pool.is_resident(cid):
                self.store.write_back(cid, keep=list(job.tokens))
        if todo:
            show = job.progress if job.progress is not None else len(todo) >= _PROGRESS_MIN_CHUNKS
            compile_chunks(
                self.runner, todo, pool=self.pool, cache=self.cache, store=self.store, options=job.options,
                bos_token_id=self.bos_token_id, keep=list(job.tokens), progress=show,
            )  # fmt: skip
        return list(todo)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, vocab_size]`` float32 logits of final hidden states ``hidden`` ``[N, hidden_size]``."""
        return self.runner.logits(hidden)

    # -- stepping -----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Admit, run one batched forward, sample; returns what each request produced (already in its sink)."""
        batch = self.scheduler.schedule()
        outputs = [self._finish(seq, why) for seq, why in batch.failed]
        if batch.prefills or batch.decodes or batch.resumed:
            outputs += self._run(batch)
        return outputs

    def _run(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """The forward over the batch's passes and decode tokens, then one token per sampling sequence."""
        start = time.perf_counter()
        for seq in batch.prefills:
            seq.scheduled_s = seq.scheduled_s or start
        device = self.runner.spec.device
        inputs = [seq.pass_.seq_input() for seq in batch.prefills] + decode_inputs(batch.decodes, device)
        try:
            hidden = self.runner.forward(inputs) if inputs else []
            hidden, failed = self._second_passes(batch.prefills, hidden)
        except Exception as exc:  # the batch's requests fail; the engine and every other request go on
            log.exception("pic: a forward failed")
            return [self._finish(seq, exc) for seq in batch.prefills + batch.decodes]
        outputs = [self._finish(seq, exc) for seq, exc in failed]
        self.num_steps += bool(inputs)
        self.num_batched_seqs += len(inputs)
        now = time.perf_counter()
        rows: list[tuple[Sequence, torch.Tensor]] = []
        parked = []
        for seq, h in zip(batch.prefills, hidden, strict=False):
            if seq.is_finished:  # its policy failed on its probe
                continue
            self.linker.pass_done(seq)
            seq.linked_s = seq.linked_s or now
            if seq.sampling is None:  # PIC.link: park with the query's hidden states (Linked.logits)
                parked.append((seq, h))
            else:
                rows.append((seq, h[-1]))
        if parked and device.type == "cuda":
            torch.cuda.synchronize(device)  # link returns with the pass done (its time is honest)
        for seq, h in parked:
            seq.sink.put(link_output(seq, h))
        rows += [(seq, h[-1]) for seq, h in zip(batch.decodes, hidden[len(batch.prefills) :], strict=True)]
        rows += [(seq, seq.query_hidden[-1]) for seq in batch.resumed]
        outputs += [self._finish(seq, FinishReason.LENGTH) for seq, _ in rows if seq.sampling.max_new_tokens == 0]
        rows = [(seq, h) for seq, h in rows if not seq.is_finished]
        for (seq, _), token in zip(rows, self._sample(rows), strict=True):
            outputs.append(self._append(seq, token))
        return outputs

    def _second_passes(
        self, prefills: list[Sequence], hidden: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[tuple[Sequence, Exception]]]:
        """After a forward that ran probes (query-aware policies): each policy chooses from its probe, and one
        more forward runs the second passes together; their hidden states replace the probes' (none). Returns
        the hidden states and the sequences whose policy failed on its probe (a malformed choice, an exception of
        its own), with why."""
        probed, failed = [], []
        for i, seq in enumerate(prefills):
            if seq.pass_.is_probe:
                try:
                    self.linker.after_probe(seq)
                    probed.append(i)
                except Exception as exc:  # a policy's own bug fails its request, not the batch
                    if not isinstance(exc, PicError):
                        log.exception("pic: policy %r failed on its probe", seq.policy.spec)
                    failed.append((seq, exc))
        if not probed:
            return hidden, failed
        second = self.runner.forward([prefills[i].pass_.seq_input() for i in probed])
        hidden = list(hidden)
        for i, h in zip(probed, second, strict=True):
            hidden[i] = h
        return hidden, failed

    def _sample(self, rows: Seq[tuple[Sequence, torch.Tensor]]) -> list[int]:
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
            out = token_output(seq, text, token)
            seq.sink.put(out)
            return out
        return self._finish(seq, reason, text=text, token=token)

    def _finish(
        self, seq: Sequence, why: FinishReason | Exception, *, text: str = "", token: int | None = None
    ) -> RequestOutput:
        """Free the sequence's blocks, build its last output and hand it over."""
        self.scheduler.remove(seq)
        self.linker.release(seq)
        if why is FinishReason.KV_POOL:
            log.warning(
                "pic: request %d stopped after %d tokens: the KV pool is full", seq.request_id, len(seq.output_ids)
            )
        out = finish_output(seq, why, text=text, token=token)
        del self._seqs[seq.request_id]
        seq.sink.put(out)
        return out

    def _start_generation(self, seq: Sequence, params: SamplingParams) -> None:
        seq.detokenizer = Detokenizer(self.tokenizer, stop=params.stop)
        if params.seed is not None:
            seq.generator = seeded_generator(params.seed, self.runner.spec.device)
