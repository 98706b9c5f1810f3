"""The connector's scheduler side: per request, decide what pic loads (``plan_link``) or stores, and hand the
worker side its jobs each step.

It reads chunk metadata only (token ids, from the tiers' metadata records, remembered per namespace and id), never
KV. A request's ``cache_salt`` is its namespace (``pic.vllm.tenants``): its compile is stored under an id that hashes
the salt, and its link finds only the chunks whose id the salt reproduces, which the connector checks itself.
Nothing here raises into vLLM's scheduler: a malformed request, an unknown id, a chunk of another model or
an unreachable store make the request a plain prefill, logged, with the reason in its output's
``kv_transfer_params["pic"]`` (``pic.vllm.client`` turns it into a ``PicError`` when asked to).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from pic.config import CompileOptions
from pic.errors import PicError
from pic.ids import chunk_id
from pic.namespaces import DEFAULT, Namespace
from pic.vllm import tenants
from pic.vllm.jobs import LoadJob, PicConnectorMetadata, SaveJob, slots_of
from pic.vllm.params import CompileRequest, LinkRequest, parse_params
from pic.vllm.plan import ConnectorPlan, find_chunks, plan_link
from pic.vllm.setup import Setup

log = logging.getLogger("pic.vllm")
_MAX_REMEMBERED = 65536  # chunk ids whose token ids are remembered (a few KB each at most)


@dataclass(frozen=True)
class _Lookup:
    """What a lookup thread found for a linked request: the chunks' tokens and where they start, or why not."""

    chunks: list[tuple[int, ...]] = field(default_factory=list)
    start: int | None = None
    prefix_id: str | None = None
    prefix_stored: bool = False
    error: str | None = None


@dataclass
class _Tracked:
    """A request the connector acts on: its plan, its blocks, and what it reports when it finishes."""

    plan: ConnectorPlan | None = None
    save: tuple[str, list[int], CompileOptions] | None = None  # (cache id, tokens, options) to store after its prefill
    namespace: Namespace = DEFAULT  # whose chunks it links or stores (its cache_salt)
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    report: dict = field(default_factory=dict)


class SchedulerSide:
    """One per vLLM scheduler: requests' plans, their blocks as steps allocate them, and their reports.

    vLLM calls it from its scheduler loop only; store lookups run on ``_pool``'s threads (``_lookup``).
    """

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self._tokens: OrderedDict[tuple[Namespace, str], tuple[int, ...]] = OrderedDict()
        self._requests: dict[str, _Tracked] = {}
        self._pending_loads: set[str] = set()
        self._lock = threading.Lock()  # guards _tokens, which lookup threads fill
        self._lookups: dict[str, Future[_Lookup]] = {}
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="pic-vllm-lookup")

    def num_new_matched_tokens(self, request: object, num_computed: int) -> int | None:
        """Tokens pic loads beyond the ``num_computed`` vLLM holds (0: a plain prefill; ``None``: not known yet,
        vLLM asks again at its next step while the request waits and every other request runs)."""
        try:
            params = parse_params(request.kv_transfer_params)
        except PicError as error:
            self._refuse(request.request_id, str(error))
            return 0
        if params is None:
            return 0
        prompt = list(request.prompt_token_ids or [])
        if isinstance(params, CompileRequest):
            return self._compile(request.request_id, prompt, request.cache_salt)
        return self._link(request, params, prompt, num_computed)

    def _compile(self, req_id: str, prompt: list[int], cache_salt: str | None) -> int:
        """Track a compile: its id hashes the tenant's salt (the request's whole ``cache_salt``), as ``pic serve``'s
        id of the same document for a tenant of that salt does."""
        try:
            namespace = tenants.namespace_of(cache_salt)
        except PicError as error:
            self._refuse(req_id, str(error))
            return 0
        options, lead = self._options(namespace), self._lead()
        if prompt[: len(lead)] != lead or len(prompt) <= len(lead):
            self._refuse(req_id, f"a compile prompt starts with the model's lead tokens {lead} and holds a document")
            return 0
        cache_id = chunk_id(self.setup.expected.fingerprint, prompt[len(lead) :], options, namespace.salt)
        self._requests[req_id] = _Tracked(save=(cache_id, prompt, options), namespace=namespace,
                                          report={"cache_id": cache_id, **_label(namespace)})  # fmt: skip
        return 0

    def _link(self, request: object, params: LinkRequest, prompt: list[int], num_computed: int) -> int | None:
        req_id = request.request_id
        try:  # the salt is the link's (vLLM's blocks of approximate KV shared with it only) after the tenant's
            namespace = tenants.namespace_of(params.tenant_of(request.cache_salt))
        except PicError as error:
            self._refuse(req_id, str(error))
            return 0
        future = self._lookups.get(req_id)
        if future is None:  # store I/O off vLLM's scheduler loop: a slow tier delays this request only
            self._lookups[req_id] = self._pool.submit(self._lookup, params, prompt, namespace)
            return None
        if not future.done():
            return None
        lookup = self._lookups.pop(req_id).result()
        if lookup.error is not None:
            self._refuse(req_id, lookup.error)
            return 0
        lengths = [len(c) for c in lookup.chunks]
        plan = plan_link(
            prompt, params.ids, lookup.chunks, start=lookup.start, num_computed=num_computed,
            num_recomputed=params.policy.num_recomputed(lengths, len(prompt) - sum(lengths)),
            prefix_id=lookup.prefix_id, prefix_stored=lookup.prefix_stored,
        )  # fmt: skip
        tracked = _Tracked(plan=plan, num_computed=num_computed, namespace=namespace)
        tracked.report = {"policy": params.policy.name, "order": params.order, "num_loaded": plan.num_external,
                          "num_prefix": plan.num_prefix, "num_chunk_tokens": plan.num_chunk_tokens,
                          "num_recomputed": plan.num_recomputed, "linked": plan.reason is None,
                          "reason": plan.reason, **_label(namespace)}  # fmt: skip
        if plan.save_prefix is not None:
            tracked.save = (plan.save_prefix, prompt[: lookup.start], self._prefix_options(namespace))
        if plan.reason is not None:
            log.warning("pic: request %s is a plain prefill: %s", req_id, plan.reason)
        self._requests[req_id] = tracked
        return plan.num_external

    def _lookup(self, params: LinkRequest, prompt: list[int], namespace: Namespace) -> _Lookup:
        """On a lookup thread: the chunks' tokens (each seen in a tier now, and ``namespace``'s), where they start in
        the prompt, and whether a tier holds the prefix before them (a chunk of ``namespace`` too)."""
        try:
            chunks = [self._chunk_tokens(cache_id, namespace) for cache_id in params.ids]
            start = find_chunks(prompt, chunks)
            if not start:
                return _Lookup(chunks=chunks, start=start)
            options = self._prefix_options(namespace)
            prefix_id = chunk_id(self.setup.expected.fingerprint, prompt[:start], options, namespace.salt)
            return _Lookup(chunks=chunks, start=start, prefix_id=prefix_id, prefix_stored=self._stored(prefix_id))
        except PicError as error:
            return _Lookup(error=str(error))
        except Exception as error:  # a tier's unexpected failure is this request's plain prefill, not vLLM's crash
            log.exception("pic: the lookup of %s failed", list(params.ids))
            return _Lookup(error=f"the store lookup failed: {type(error).__name__}: {error}")

    def after_alloc(self, request: object, num_external: int) -> None:
        if num_external > 0 and request.request_id in self._requests:
            self._pending_loads.add(request.request_id)

    def build_meta(self, scheduler_output: object) -> PicConnectorMetadata:
        """This step's jobs: loads for newly scheduled linked requests, saves for prefills that end this step."""
        self._track_blocks(scheduler_output)
        meta, bs = PicConnectorMetadata(), self.setup.block_size
        for req_id in sorted(self._pending_loads):
            tracked = self._requests[req_id]
            for seg in tracked.plan.segments:
                slots = slots_of(tracked.block_ids, bs, seg.start, seg.num_tokens)
                meta.loads.append(LoadJob(req_id, seg, slots, tracked.namespace))
        self._pending_loads.clear()
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            tracked = self._requests.get(req_id)
            if tracked is None or tracked.save is None:
                continue
            cache_id, tokens, options = tracked.save
            if tracked.num_computed + num_scheduled >= len(tokens):  # the prefill holding them all ends this step
                slots = slots_of(tracked.block_ids, bs, 0, len(tokens))
                meta.saves.append(SaveJob(req_id, cache_id, tokens, slots, options))
                tracked.save = None
                tracked.report["stored"] = cache_id
        return meta

    def _track_blocks(self, scheduler_output: object) -> None:
        """Follow the blocks and computed tokens of the requests the connector acts on (a chunked prefill's
        blocks come over several steps; a resumed request's are given whole again)."""
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._requests.get(new.req_id)
            if tracked is not None:
                tracked.block_ids, tracked.num_computed = list(new.block_ids[0]), new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._requests.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                resumed = req_id in cached.resumed_req_ids
                tracked.block_ids = list(new_ids[0]) if resumed else tracked.block_ids + list(new_ids[0])
            tracked.num_computed = cached.num_computed_tokens[i]

    def finished(self, request: object) -> dict | None:
        self._lookups.pop(request.request_id, None)  # aborted while its lookup ran: the result is dropped
        tracked = self._requests.pop(request.request_id, None)
        self._pending_loads.discard(request.request_id)
        return None if tracked is None else {"pic": tracked.report}

    def close(self) -> None:
        """Stop the lookup threads (a lookup under way ends at its tier's timeout; its result is dropped)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _refuse(self, req_id: str, reason: str) -> None:
        log.warning("pic: request %s is a plain prefill: %s", req_id, reason)
        self._requests[req_id] = _Tracked(report={"linked": False, "reason": reason})

    def _chunk_tokens(self, cache_id: str, namespace: Namespace) -> tuple[int, ...]:
        """The chunk's tokens (remembered per namespace: what one tenant read is never another's), once a tier is
        seen to hold it now (a tier can lose it, or go down). Another namespace's chunk is an id nobody compiled:
        the same reason, word for word."""
        key = (namespace, cache_id)
        with self._lock:
            tokens = self._tokens.get(key)
            if tokens is not None:
                self._tokens.move_to_end(key)
        if tokens is not None and self._stored(cache_id):
            return tokens
        reads = (tenants.read_tokens(tier, cache_id, namespace) for tier in self.setup.tiers)
        tokens = next((found for found in reads if found is not None), None)
        if tokens is None:
            errors = "; ".join(f"{t.name}: {t.last_error}" for t in self.setup.tiers if t.last_error)
            names = ", ".join(t.name for t in self.setup.tiers)
            raise PicError(
                f"cache id {cache_id!r} is in no tier of this model ({names})"
                + (f"; {errors}" if errors else "")
                + "; ids belong to one model: compile it for this one"
                + ("" if namespace.is_default else ", under this request's tenant salt (its cache_salt)")
            )
        with self._lock:
            self._tokens[key] = tokens
            if len(self._tokens) > _MAX_REMEMBERED:
                self._tokens.popitem(last=False)
        return tokens

    def _stored(self, cache_id: str) -> bool:
        try:
            return any(t.contains(cache_id) for t in self.setup.tiers)
        except PicError:
            return False

    def _lead(self) -> list[int]:
        bos = self.setup.bos_token_id
        return [bos] if self.setup.options.add_bos and bos is not None else []

    def _options(self, namespace: Namespace) -> CompileOptions:
        """The options of the chunks the connector compiles in ``namespace`` (the label it stores with them)."""
        return self.setup.options.model_copy(update={"namespace": namespace.name})

    def _prefix_options(self, namespace: Namespace) -> CompileOptions:
        return self._options(namespace).model_copy(update={"add_bos": False})


def _label(namespace: Namespace) -> dict[str, str]:
    """A tenant's namespace in its report (its label: a hash of the salt, never the salt); nothing for the default."""
    return {} if namespace.is_default else {"namespace": namespace.name}
