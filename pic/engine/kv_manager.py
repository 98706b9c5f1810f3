"""``KVManager``: the one owner of the KV pool's blocks for the scheduler (vLLM's KVCacheManager), for linked
requests and chunk compiles alike: plan, admit, append, preempt, free.

The scheduler decides *who* runs; the KV manager does the pool work its decisions need. Every method runs on
the engine thread.
"""

from __future__ import annotations

import torch

from pic.compile import ChunkPrefill
from pic.engine.sequence import Sequence
from pic.errors import ContextLengthError, PolicyError
from pic.kv import BlockPool, KVCache
from pic.link import lay_out
from pic.link.assemble import AssemblyPlan, assemble, plan_assembly
from pic.link.recompute import RecomputePass
from pic.model import ModelSpec
from pic.store import TieredStore


class KVManager:
    """Block-level work on sequences and chunk prefills.

    Args:
        pool, cache: the KV pool's allocator and tensors.
        store: the chunk store (resolves cache ids; promotes chunks from the lower tiers into ``pool``).
        spec: the model's shapes (layers, context).
        block_size: tokens per block.
        share_chunk_blocks: map clean chunk blocks without copying (``PICConfig.share_chunk_blocks``).
        attention_backend: the runner's backend's name (a policy may need ``"torch"``).
    """

    def __init__(
        self,
        pool: BlockPool,
        cache: KVCache,
        store: TieredStore,
        spec: ModelSpec,
        *,
        block_size: int,
        share_chunk_blocks: bool,
        attention_backend: str = "torch",
    ) -> None:
        self.store, self.pool, self.cache, self.spec = store, pool, cache, spec
        self._block_size, self._share, self._backend = block_size, share_chunk_blocks, attention_backend

    def plan(self, seq: Sequence) -> AssemblyPlan:
        """What admitting ``seq`` takes from the pool now (its chunks are at hand: ``ChunkSources.ready``); lays
        it out (prompt and the tokens it generated before a preemption).

        Raises:
            ContextLengthError, PolicyError: the request cannot run (it fails; nothing was taken).
        """
        if seq.layout is None or seq.layout.num_tokens != seq.num_prompt_tokens + len(seq.output_ids):
            self._lay_out(seq)
        dynamic = seq.policy.is_dynamic
        dirty = seq.selected if self._share and not dynamic else torch.ones_like(seq.selected)
        return plan_assembly(self.pool, seq.layout, seq.chunks, dirty)

    def _lay_out(self, seq: Sequence) -> None:
        """Lay the sequence out (prompt and generated tokens), check it against the model and the backend, and
        set the tokens its next pass runs.

        Raises:
            ContextLengthError, PolicyError: as ``plan``.
        """
        seq.layout = lay_out(
            prefix=seq.prefix_ids,
            chunks=seq.chunks,
            query=seq.query_ids + seq.output_ids,
            block_size=self._block_size,
            parallel=seq.policy.parallel_positions,
            relevance=seq.relevance,
            num_generated=len(seq.output_ids),
        )
        self._check_length(seq)
        chosen = seq.policy.for_layout(seq.layout)
        if chosen.parallel_positions != seq.policy.parallel_positions:
            raise PolicyError(f"policy {seq.policy.spec!r} chose {chosen.spec!r}, which lays chunks out otherwise")
        seq.policy = chosen
        seq.policy.check_model(num_layers=self.spec.num_layers)
        if seq.policy.context_scaling() is not None and self._backend != "torch":
            raise PolicyError(
                f"policy {seq.policy.spec!r} runs on the torch attention backend only, not on "
                f"{self._backend!r}; build the engine with PICConfig(attention_backend='torch')"
            )
        seq.selected = self._selection(seq)

    def _selection(self, seq: Sequence) -> torch.Tensor:
        """``[T]`` bool, the tokens the sequence's next pass runs: the policy's, or (a query-aware policy
        admitted again after its probe) the chunk tokens its probe chose and every uncached token."""
        layout = seq.layout
        if seq.probed_chunks is None:
            return seq.policy.recompute_mask(layout)
        chosen = torch.zeros(layout.num_tokens, dtype=torch.bool)
        chosen[: seq.probed_chunks.shape[0]] = seq.probed_chunks  # chunk tokens keep their indices
        return chosen | ~layout.cached

    def can_chunk(self, seq: Sequence, plan: AssemblyPlan) -> bool:
        """Whether the sequence's next pass may run in pieces (``RecomputePass.chunkable``): a static policy, no
        probe, no context scaling, positions increasing."""
        policy = seq.policy
        if self.probes(seq) or policy.is_dynamic or policy.context_scaling() is not None:
            return False
        return _increasing(plan.layout.positions[seq.selected])

    def probes(self, seq: Sequence) -> bool:
        """Whether the sequence's next pass is a query-aware policy's probe."""
        return seq.policy.is_query_aware and seq.probed_chunks is None

    def probe_reserve(self, plan: AssemblyPlan, seq: Sequence) -> int:
        """Blocks a probing sequence may still take in its step: copies of the chunk blocks its second pass
        writes into (at most every block it maps shared). Admission sets them aside."""
        return len(plan.shared) if self.probes(seq) else 0

    def can_admit(self, plan: AssemblyPlan, seq: Sequence, *, reserved: int = 0) -> bool:
        """Whether the pool holds ``plan`` beside ``reserved`` blocks set aside for this step."""
        return self.pool.num_available(holding=self._to_hold(plan, seq)) >= plan.num_blocks_needed + reserved

    def check_admit(self, plan: AssemblyPlan, seq: Sequence, *, reserved: int = 0) -> None:
        """Raise ``KVPoolExhaustedError`` (blocks needed and available) unless ``can_admit``."""
        self.pool.check_available(
            plan.num_blocks_needed + reserved, holding=self._to_hold(plan, seq), what=plan.describe()
        )

    def _to_hold(self, plan: AssemblyPlan, seq: Sequence) -> list[str]:
        return [cid for cid in plan.resident if cid not in seq.held]

    def admit(self, plan: AssemblyPlan, seq: Sequence, *, num_output_rows: int) -> None:
        """Take the blocks (shared chunk blocks mapped, dirty ones copied) and set up the recompute pass."""
        assembly = assemble(self.pool, self.cache, self.store, plan, held=seq.held)
        seq.held = {}
        seq.kv = assembly.req
        scaling = seq.policy.context_scaling()
        if scaling is not None:  # APE: the request's query and generated tokens attend its chunks scaled
            context = torch.zeros(seq.kv.kv_positions.shape[0], dtype=torch.bool)
            context[plan.layout.slots[plan.layout.cached]] = True
            seq.kv.context = (scaling, context.to(self.cache.device))
        seq.shared_blocks = set(plan.shared)
        if seq.first_pass is None:
            seq.num_shared_blocks, seq.num_private_blocks = assembly.num_shared_blocks, assembly.num_private_blocks
        seq.pass_ = RecomputePass(
            assembly,
            plan.layout,
            seq.selected,
            seq.policy,
            num_layers=self.spec.num_layers,
            num_output_rows=num_output_rows,
            probe=self.probes(seq),
            chunkable=self.can_chunk(seq, plan),
        )

    def after_probe(self, seq: Sequence) -> None:
        """After a probe pass: the policy chooses from it, the chunk blocks the second pass writes into become
        private copies (in the blocks ``probe_reserve`` set aside), and the second pass is set up."""
        probe_pass = seq.pass_
        seq.probe_result = probe_pass.result()
        layout = seq.layout
        chosen = seq.policy.probe_mask(seq.probe_result.probe)  # [T]: chunk tokens and the query
        seq.probed_chunks = (chosen & layout.cached)[: layout.query.token_start]
        seq.selected = self._selection(seq)  # what a preempted sequence's next admission runs
        dirty = (layout.slots[chosen & layout.cached] // self._block_size).unique().tolist()
        shared = [i for i in dirty if i in seq.shared_blocks]
        seq.kv.copy_on_write(shared, self.pool.allocate(len(shared)))
        seq.shared_blocks -= set(shared)
        seq.num_shared_blocks -= len(shared)
        seq.num_private_blocks += len(shared)
        seq.pass_ = RecomputePass(
            probe_pass.assembly,
            layout,
            chosen,
            seq.policy,
            num_layers=self.spec.num_layers,
            num_output_rows=probe_pass.num_output_rows_asked,
        )

    def pass_done(self, seq: Sequence) -> None:
        """After the forward: the canonical blocks the request copied are no longer read."""
        result = seq.pass_.result()
        if seq.probe_result is not None:
            result, seq.probe_result = seq.probe_result.after(result), None
        if seq.first_pass is None:
            seq.first_pass = result
        seq.pass_ = None
        seq.kv.release_held()

    def can_start(self, prefill: ChunkPrefill, *, reserved: int = 0) -> bool:
        """Whether the pool has the blocks of a chunk prefill beside ``reserved`` set aside for this step."""
        return self.pool.num_available() >= prefill.num_blocks(self._block_size) + reserved

    def start(self, prefill: ChunkPrefill) -> None:
        """Take a chunk prefill's blocks."""
        prefill.start(self.pool, self.cache)

    def can_append(self, seq: Sequence) -> bool:
        """Whether ``append`` can take the slot of the sequence's next token."""
        kv = seq.kv
        return kv.num_slots < len(kv.blocks) * self._block_size or self.pool.num_available() >= 1

    def append(self, seq: Sequence) -> int:
        """Reserve the slot of the next token (a new private block when the last is full)."""
        return seq.kv.append_slot()

    def preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks but keep its chunks resident (held) until it is admitted again."""
        for cid in dict.fromkeys(seq.cache_ids):
            if cid not in seq.held and self.pool.is_resident(cid):
                seq.held[cid] = self.pool.hold(cid)
        seq.kv.release()
        seq.kv, seq.pass_ = None, None

    def release(self, seq: Sequence) -> None:
        """Drop every block reference the sequence owns (idempotent)."""
        if seq.kv is not None:
            seq.kv.release()
            seq.kv = None
        self.drop_holds(seq)

    def drop_holds(self, seq: Sequence) -> None:
        """Let the chunks a waiting sequence keeps resident go: when evicted, they are loaded from a lower tier or
        compiled again from their tokens before it is admitted (``ChunkSources``)."""
        held, seq.held = seq.held, {}
        self.pool.free(b for blocks in held.values() for b in blocks)

    def _check_length(self, seq: Sequence) -> None:
        num_tokens, context = seq.layout.num_tokens, self.spec.max_context
        if num_tokens > context:
            raise ContextLengthError(
                f"linked prompt has {num_tokens} tokens, more than the {context}-token context of "
                f"{self.spec.architecture}"
            )


def _increasing(positions: torch.Tensor) -> bool:
    """Whether ``positions`` ``[n]`` (a pass's tokens, in order) strictly increase: then a pass split in pieces
    attends exactly as one forward (each piece sees only earlier positions)."""
    return bool((positions[1:] > positions[:-1]).all())
