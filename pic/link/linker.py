"""``Linker``: a request's link from its chunks to its recompute pass's result (layout, the policy's choice, the
probe and its second pass), apart from the pool work (``pic.engine.core.kv_manager``) and the scheduling.

The engine holds one ``LinkState`` per request; only the ``Linker`` writes it. A request goes:
``plan`` (order the chunks, lay out, check, choose the tokens, count the blocks) -> the KV manager takes the
blocks -> ``start`` (set up the pass) -> forwards -> for a query-aware policy, ``probe_done`` (the policy chooses
from its probe; the second pass is set up, to run in the next forward, and the caller copies the chunk blocks it
writes) -> ``pass_done``. A preempted request is planned again over its prompt and the tokens it generated, and
keeps its chunks' order and its probe's choice.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pic.config import AttentionBackendName
from pic.errors import PolicyError, linked_too_long
from pic.kv import ChunkInfo, ChunkKV, RequestKV
from pic.link.assemble import AssemblyPlan, plan_assembly
from pic.link.layout import Layout, lay_out
from pic.link.order import ChunkOrder, Order, TermStats, bm25, chunk_order, term_stats
from pic.link.policies import FullRecompute, Policy
from pic.link.recompute import PassResult, RecomputePass
from pic.model import ModelSpec


@dataclass
class LinkState:
    """One request's link (written by ``Linker`` only).

    Attributes:
        policy: the policy asked for, then (from the first plan on) its choice for the layout (``for_layout``).
        order: the chunk order asked for (``Order.POLICY``: ``Policy.order``).
        chunk_order: the order the chunks run in, fixed at the first plan (a preempted request keeps it).
        layout: the prompt (and the tokens generated before a preemption) laid out.
        selected: ``[T]`` bool, the tokens the next pass runs.
        pass_: the recompute pass under way.
        probed_chunks: a query-aware policy's choice among the chunk tokens (``[n]`` bool over the tokens before
            the query), kept so that a preempted request runs the same second pass, not a new probe.
        probe_result: the probe pass's result, until the second pass is done.
        first_pass: what the first complete pass ran (the request's statistics).
        laid_out: the chunk list (by identity) and query length ``layout`` was made for.
        lexical: the chunks' BM25 (caller's order), when the relevance order ranked them by it.
    """

    policy: Policy
    order: Order = Order.POLICY
    chunk_order: ChunkOrder | None = None
    layout: Layout | None = None
    selected: torch.Tensor | None = None
    pass_: RecomputePass | None = None
    probed_chunks: torch.Tensor | None = None
    probe_result: PassResult | None = None
    first_pass: PassResult | None = None
    laid_out: tuple[object, int] | None = None
    lexical: tuple[float, ...] | None = None

    @property
    def probes(self) -> bool:
        """Whether the next pass is a query-aware policy's probe."""
        return self.policy.is_query_aware and self.probed_chunks is None


@dataclass(frozen=True)
class LinkPlan:
    """What admitting a request takes now: the blocks (``assembly``), the tokens its pass runs (a probe's: the
    probe), the blocks a probe's second pass may take (``num_reserved``: copies of the shared chunk blocks it
    writes, set aside at admission), whether the pass may run in pieces (``RecomputePass.chunkable``)."""

    assembly: AssemblyPlan
    num_tokens: int
    num_reserved: int
    chunkable: bool


class Linker:
    """Plans and follows the links of ``spec``'s model. ``is_resident``: whether the pool holds a chunk
    (``KVManager.is_resident``: the pool's one owner); ``share_chunk_blocks``: map clean chunk blocks without
    copying; ``attention_backend``: the runner's backend's name (a policy may need ``"torch"``)."""

    def __init__(
        self,
        spec: ModelSpec,
        *,
        is_resident: Callable[[str], bool],
        block_size: int,
        share_chunk_blocks: bool,
        attention_backend: AttentionBackendName,
    ) -> None:
        self.spec, self.is_resident, self.block_size = spec, is_resident, block_size
        self._share, self._backend = share_chunk_blocks, attention_backend
        # id(a chunk's token_ids) -> (a weak reference to it, its BM25 terms): made once while the tensor lives (a
        # resident chunk's ``ChunkInfo`` keeps it), not per link
        self._terms: dict[int, tuple[weakref.ref, TermStats]] = {}

    def specialise_and_plan(
        self,
        link: LinkState,
        *,
        prefix: list[int],
        chunks: Sequence[ChunkInfo | ChunkKV],
        query: list[int],
        num_generated: int,
        relevance: Sequence[float] | None,
    ) -> LinkPlan:
        """Lay the request out (``query`` ends with the ``num_generated`` tokens it generated before a
        preemption) unless it is already, and count what admitting it takes from the pool. ``chunks`` and
        ``relevance`` come in the caller's order. The first call fixes the order they run in and *replaces the
        request's policy* (``link.policy``) by the one it chooses for the layout (``Policy.for_layout``: ``auto``
        becomes a ``suffix`` or ``regions``); later calls (a preempted request) keep both.

        Raises:
            ContextLengthError, PolicyError: the request cannot run (nothing was taken).
        """
        if link.laid_out is None or link.laid_out[0] is not chunks or link.laid_out[1] != len(query):
            self._lay_out(link, prefix, chunks, query, num_generated, relevance)
        static = not link.policy.is_dynamic  # (its selection is what the pass writes in every layer)
        dirty = link.selected if self._share and static else torch.ones_like(link.selected)
        assembly = plan_assembly(
            link.layout, link.chunk_order.apply(chunks), dirty, rewritten=link.selected if static else None,
            is_resident=self.is_resident,
        )  # fmt: skip
        reserved = len(assembly.shared) if link.probes else 0
        return LinkPlan(assembly, int(link.selected.sum()), reserved, self._chunkable(link))

    def start(self, link: LinkState, plan: LinkPlan, kv: RequestKV, *, assembly, num_output_rows: int) -> None:
        """Set up the pass over the blocks the KV manager took (``assembly``); a policy that scales the query's
        attention over the chunks (APE) marks their slots in ``kv``."""
        scaling = link.policy.context_scaling()
        if scaling is not None:
            context = torch.zeros(kv.kv_positions.shape[0], dtype=torch.bool)
            context[link.layout.slots[link.layout.cached]] = True
            kv.context = (scaling, context.to(kv.cache.device))
        link.pass_ = RecomputePass(
            assembly, link.layout, link.selected, link.policy, num_layers=self.spec.num_layers,
            num_output_rows=num_output_rows, probe=link.probes, chunkable=plan.chunkable,
        )  # fmt: skip

    def probe_done(self, link: LinkState) -> list[int]:
        """After a probe pass: the policy chooses from it, and the second pass is set up. Returns the request's
        blocks the second pass writes into (the caller copies those it maps shared).

        Raises:
            Exception: whatever the policy raises on a malformed probe (it fails its request only).
        """
        probe_pass = link.pass_
        link.probe_result = probe_pass.result()
        layout = link.layout
        chosen = link.policy.probe_mask(link.probe_result.probe)  # [T]: chunk tokens and the query
        link.probed_chunks = (chosen & layout.cached)[: layout.query.token_start]
        link.selected = self._selection(link)  # what a preempted request's next admission runs
        link.pass_ = RecomputePass(
            probe_pass.assembly, layout, chosen, link.policy, num_layers=self.spec.num_layers,
            num_output_rows=probe_pass.num_output_rows_asked,
        )  # fmt: skip
        return (layout.slots[chosen & layout.cached] // self.block_size).unique().tolist()

    def pass_done(self, link: LinkState) -> PassResult:
        """After the forward that ended the pass: what it ran (a probe's pass and its second pass together)."""
        result = link.pass_.result()
        if link.probe_result is not None:
            result, link.probe_result = link.probe_result.after(result), None
        link.first_pass, link.pass_ = link.first_pass or result, None
        return result

    def forget_pass(self, link: LinkState) -> None:
        """A preempted request's pass is gone with its blocks (it is planned again at its next admission)."""
        link.pass_ = None

    def _lay_out(
        self,
        link: LinkState,
        prefix: list[int],
        chunks: Sequence[ChunkInfo | ChunkKV],
        query: list[int],
        num_generated: int,
        relevance: Sequence[float] | None,
    ) -> None:
        """``specialise_and_plan``'s layout and the tokens its pass runs. The first call fixes the chunks' order
        (``link.order``, or the policy's), ranked once: the order and a policy that ranks the chunks too (``regions``)
        read the same scores, the caller's or BM25 (``Layout.lexical``); then the policy chooses for the layout, and a
        Full Recompute chosen so (``auto``'s, for a prompt too short to win) is laid out again in the caller's order."""
        first = link.chunk_order is None
        asked = query[: len(query) - num_generated]  # the caller's query, not the tokens generated before
        if first:
            self._order(link, link.policy.order if link.order is Order.POLICY else link.order, asked, chunks, relevance)
        layout = self._layout(link, prefix, chunks, query, num_generated, relevance)
        if layout.num_tokens > self.spec.max_context:  # first: a prompt too long is that, whatever its policy
            raise linked_too_long(layout.num_tokens, self.spec.max_context, self.spec.architecture, layout.segments)
        if first:
            self._specialise(link)
            full = isinstance(link.policy, FullRecompute)
            if full and link.order is Order.POLICY and link.chunk_order.order is Order.RELEVANCE:
                # Full Recompute chosen for the layout (``auto``'s, for a prompt too short to win) is the model's own
                # prefill of the caller's prompt: in the caller's order
                self._order(link, Order.GIVEN, asked, chunks, relevance)
                self._layout(link, prefix, chunks, query, num_generated, relevance)
        link.laid_out = (chunks, len(query))
        link.selected = self._selection(link)

    def _order(
        self,
        link: LinkState,
        order: Order,
        asked: list[int],
        chunks: Sequence[ChunkInfo | ChunkKV],
        relevance: Sequence[float] | None,
    ) -> None:
        """Fix the chunks' order, ranked once: the order and a policy that ranks the chunks too (``regions``) read
        the same scores, the caller's or BM25 (``Layout.lexical``)."""
        units: list = [()] * len(chunks)  # (only BM25 reads the chunks' tokens)
        if order is Order.RELEVANCE and relevance is None and link.lexical is None:
            units = [self._term_stats(c.token_ids) for c in chunks]
            link.lexical = tuple(bm25(asked, units))
        link.chunk_order = chunk_order(order, asked, units, relevance if relevance is not None else link.lexical)

    def _layout(
        self,
        link: LinkState,
        prefix: list[int],
        chunks: Sequence[ChunkInfo | ChunkKV],
        query: list[int],
        num_generated: int,
        relevance: Sequence[float] | None,
    ) -> Layout:
        """``link.layout``: the chunks in ``link.chunk_order`` between ``prefix`` and ``query``."""
        order = link.chunk_order
        link.layout = lay_out(
            prefix=prefix, chunks=order.apply(chunks), query=query, block_size=self.block_size,
            parallel=link.policy.parallel_positions, num_generated=num_generated,
            relevance=None if relevance is None else order.apply(relevance),
            lexical=None if link.lexical is None else order.apply(link.lexical),
        )  # fmt: skip
        return link.layout

    def _term_stats(self, tokens: torch.Tensor) -> TermStats:
        """A chunk's BM25 terms (``[L]`` token ids), kept as long as the tensor is."""
        key = id(tokens)
        entry = self._terms.get(key)
        if entry is not None and entry[0]() is tokens:
            return entry[1]
        stats = term_stats(tokens)
        terms = self._terms
        self._terms[key] = (weakref.ref(tokens, lambda _, key=key: terms.pop(key, None)), stats)
        return stats

    def _specialise(self, link: LinkState) -> None:
        """The policy's choice for the first layout (``Policy.for_layout``), once, before anything is planned with it.

        Raises:
            PolicyError: a choice that lays chunks out otherwise, or that this model or backend cannot run.
        """
        chosen = link.policy.for_layout(link.layout)
        if chosen.parallel_positions != link.policy.parallel_positions:
            raise PolicyError(f"policy {link.policy.spec!r} chose {chosen.spec!r}, which lays chunks out otherwise")
        chosen.check_model(num_layers=self.spec.num_layers)
        if chosen.context_scaling() is not None and self._backend is not AttentionBackendName.TORCH:
            raise PolicyError(
                f"policy {chosen.spec!r} runs on the torch attention backend only, not on "
                f"'{self._backend}'; build the engine with PICConfig(attention_backend='torch')"
            )
        link.policy = chosen  # once it is known to run here

    @staticmethod
    def _selection(link: LinkState) -> torch.Tensor:
        """``[T]`` bool, the tokens the next pass runs: the policy's, or (a query-aware policy planned again after
        its probe) the chunk tokens its probe chose and every uncached token."""
        layout = link.layout
        if link.probed_chunks is None:
            return link.policy.recompute_mask(layout)
        chosen = torch.zeros(layout.num_tokens, dtype=torch.bool)
        chosen[: link.probed_chunks.shape[0]] = link.probed_chunks  # chunk tokens keep their indices
        return chosen | ~layout.cached

    @staticmethod
    def _chunkable(link: LinkState) -> bool:
        """Whether the next pass may run in pieces: a static policy, no probe, no context scaling, positions
        strictly increasing (then each piece sees only earlier positions, as one forward would)."""
        policy = link.policy
        if link.probes or policy.is_dynamic or policy.context_scaling() is not None:
            return False
        positions = link.layout.positions[link.selected]
        return bool((positions[1:] > positions[:-1]).all())
