"""A request and the messages of the command channel (``pic.engine.commands``): what a user hands the engine
(``Request``, a ``CompileJob``), what the caller's thread makes of a request (``Preparer``: a ``NewRequest``) and what
the engine hands back (``RequestOutput``, ``LinkOutput``, a compile's ``Stored``)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from typing_extensions import Unpack

from pic.compile import TextOrTokens, encode, max_token_chars
from pic.config import CompileOptions, PICConfig
from pic.engine.generation import Generation
from pic.errors import InvalidInputError, PolicyError
from pic.ids import cache_id_list
from pic.link import Layout, policies
from pic.link.order import ChunkOrder, Order, parse_order, relevance_scores
from pic.link.policies import Policy
from pic.link.probe import Probe
from pic.model import ModelSpec
from pic.namespaces import OPEN, Access, Names, Namespace, access_of
from pic.sampling import SamplingOptions, SamplingParams, sampling_params


class Request:
    """One generation: link ``cache_ids`` with ``query`` (after ``prefix``) under ``policy``, then generate.

    The prompt is ``prefix + chunk_1 + ... + chunk_n + query``, as in ``PIC.link``. Sampling is either a
    ``SamplingParams`` (``sampling=``) or its fields as keywords (``max_new_tokens=32, temperature=0.8``).
    A request's output does not depend on what it is batched with: seeded sampling uses the request's own
    generator.

    ``relevance`` gives a score per chunk (higher: more relevant to the query), as a retriever ranks them;
    policies that rank chunks (``regions``) and the relevance order use it instead of their own ranking.
    ``order``: the chunks' order in the prompt, ``"given"`` (the caller's), ``"relevance"`` (most relevant
    last), or ``"policy"`` / ``None`` (the default: the policy's choice, ``Policy.order``).
    ``namespace``: whose request it is and whose chunks it may link (``pic.namespaces.access_of``: a name, a
    ``Namespace`` or an ``Access``; ``None``: the default namespace): an id outside it is unknown to it.

    Raises:
        InvalidInputError: cache ids that are not strings, an empty query, a bad or unknown sampling option,
            relevance scores that are not one finite number per cache id, an unknown order, a bad namespace.
        PolicyError: an unknown policy spec.
    """

    def __init__(
        self,
        cache_ids: Sequence[str],
        query: TextOrTokens,
        *,
        prefix: TextOrTokens = "",
        policy: str | policies.Policy | None = None,
        relevance: Sequence[float] | None = None,
        order: str | Order | None = None,
        namespace: str | Namespace | Access | None = None,
        sampling: SamplingParams | None = None,
        **options: Unpack[SamplingOptions],
    ) -> None:
        self.cache_ids = cache_id_list(cache_ids)
        self.access = access_of(namespace)
        if isinstance(query, str | list | tuple) and len(query) == 0:
            raise InvalidInputError(f"query {query!r} has no tokens; link needs at least one query token")
        self.query, self.prefix = query, prefix
        self.policy = None if policy is None else policies.resolve(policy)
        self.relevance = relevance_scores(relevance, len(self.cache_ids))
        self.order = Order.POLICY if order is None else parse_order(order)
        self.sampling = sampling_params(sampling, options)

    @property
    def num_chunks(self) -> int:
        """The chunks the request links (``len(cache_ids)``, as ``repr`` shows it)."""
        return len(self.cache_ids)

    def __repr__(self) -> str:
        shown = f"num_chunks={self.num_chunks}, query={self.query!r}, policy={self.policy}"
        if not self.access.own.is_default:
            shown += f", namespace={self.access.own.name!r}"
        return f"Request({shown}, sampling={self.sampling!r})"


class Preparer:
    """Turns a ``Request`` into the ``NewRequest`` the core runs, in the caller's thread, so a bad input fails there
    before any command reaches the engine. One per engine (``PIC`` and its ``Stepper``); ``compile`` takes its chunks'
    options from here too. ``bos_token_id``: the tokenizer's BOS (``None``: none); ``names``: the engine's rule of one
    salt per namespace name, checked for every request and compile."""

    def __init__(
        self,
        tokenizer: object,
        spec: ModelSpec,
        *,
        config: PICConfig,
        bos_token_id: int | None,
        names: Names | None = None,
    ) -> None:
        self.tokenizer, self.spec, self.config, self.bos_token_id = tokenizer, spec, config, bos_token_id
        self.names = Names() if names is None else names
        self.default_policy = policies.resolve(config.default_policy)
        # Longer text cannot fit the context, so it is refused untokenized (twice the bound: a normalizer may
        # compose characters, "e" + U+0301 -> "é", before the tokens are counted).
        self.max_chars = 2 * spec.max_context * max_token_chars(tokenizer)
        self._ids = itertools.count()

    def encode(self, value: TextOrTokens, what: str) -> list[int]:
        """``value``'s token ids (text tokenized without special tokens); ``what`` names it in errors."""
        return encode(self.tokenizer, value, what=what, vocab_size=self.spec.vocab_size, max_chars=self.max_chars)

    def compile_options(self, policy: Policy, context: Sequence[int] = ()) -> CompileOptions:
        """The options chunks are compiled with for ``policy`` (part of their cache ids), after ``context``; raises
        ``PolicyError`` for a policy that needs extra BOS tokens with a tokenizer that has none."""
        options = policy.compile_options(CompileOptions(add_bos=self.config.add_bos, context=tuple(context)))
        if self.bos_token_id is None:  # no BOS to add: normalise so ids do not depend on the flag
            if options.num_extra_bos:
                raise PolicyError(f"policy {policy.spec!r} needs extra BOS tokens but the tokenizer has no BOS token")
            options = options.model_copy(update={"add_bos": False})
        return options

    def new_request(
        self, request: Request, *, sink: OutputSink, link_only: bool = False, paced: bool = False
    ) -> NewRequest:
        """``request`` as the core runs it, its outputs going to ``sink``: tokenized, the BOS (when the engine writes
        one) first, on the prefix, or on the query when there is neither a prefix nor a chunk (a chunk brings its own).
        ``link_only``: its sampling options are not used (``Linked.generate`` takes its own).

        Raises:
            InvalidInputError: a bad token id or text, a query of no tokens, a namespace name used with another salt.
            PolicyError: as ``compile_options``.
        """
        if not isinstance(request, Request):  # (every way in comes here: ``submit``, ``add_request``, ``_submit``)
            raise InvalidInputError(f"request is {request!r:.80}; expected a pic.Request")
        self.names.check(request.access)
        query_ids, prefix_ids = self.encode(request.query, "query"), self.encode(request.prefix, "prefix")
        if not query_ids:  # text that tokenizes to nothing (``Request`` refused the empty query itself)
            raise InvalidInputError(f"query {request.query!r} has no tokens; link needs at least one query token")
        if self.config.add_bos and self.bos_token_id is not None and (prefix_ids or not request.cache_ids):
            (prefix_ids or query_ids).insert(0, self.bos_token_id)
        policy = self.default_policy if request.policy is None else request.policy
        return NewRequest(
            request_id=next(self._ids), cache_ids=list(request.cache_ids), prefix_ids=prefix_ids, query_ids=query_ids,
            policy=policy, order=request.order, relevance=request.relevance,
            compile_options=self.compile_options(policy), sampling=None if link_only else request.sampling,
            sink=sink, paced=paced, access=request.access,
        )  # fmt: skip


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request.

    Attributes:
        request_id: the id ``Stepper.add_request`` or ``Engine.submit`` returned.
        text: text that became final in this step (the pieces of a request concatenate to its text).
        token_ids: tokens sampled in this step (0 or 1).
        finished: the request is done (finished, failed or aborted) and its blocks are freed.
        generation: the whole result, once finished (``None`` when it failed).
        error: why the request failed (``PicError``: an unknown cache id, a prompt longer than the
            context, a pool that can never hold it ...), else ``None``.
    """

    request_id: int
    text: str
    token_ids: tuple[int, ...]
    finished: bool
    generation: Generation | None = None
    error: Exception | None = None

    @classmethod
    def failure(cls, request_id: int, error: Exception) -> RequestOutput:
        """The last output of a request that ends with ``error`` before it produced anything."""
        return cls(request_id=request_id, text="", token_ids=(), finished=True, error=error)


@dataclass(frozen=True)
class LinkOutput:
    """A linked request after its recompute pass, parked until it is generated from or released (``PIC.link``).

    Attributes:
        request_id: the engine's id.
        layout: where every segment sits in the request's blocks.
        recomputed: ``[T]`` bool (CPU), the tokens that ran the last layer fresh.
        recomputed_by_layer: tokens run fresh in each layer, first layer first.
        num_shared_blocks / num_private_blocks: the request's block table, aliased / owned.
        block_ids: its physical blocks, in slot order.
        query_hidden: ``[num_query_tokens, hidden_size]`` the query's final hidden states (model dtype).
        policy: the policy that chose the recomputed tokens (``Policy.for_layout``'s choice).
        order: the order the chunks ran in (the caller's chunk indices in prompt order).
        probe: what the query saw in the probe pass of a query-aware policy, else ``None``.
    """

    request_id: int
    layout: Layout
    recomputed: torch.Tensor
    recomputed_by_layer: tuple[int, ...]
    num_shared_blocks: int
    num_private_blocks: int
    block_ids: tuple[int, ...]
    query_hidden: torch.Tensor
    policy: Policy
    order: ChunkOrder
    probe: Probe | None = None


class OutputSink(Protocol):
    """Where a request's outputs go, from the engine's thread: ``put`` must not block (a queue)."""

    def put(self, item: RequestOutput | LinkOutput) -> None: ...


@dataclass(frozen=True)
class NewRequest:
    """A request as the engine's thread runs it, its options resolved and validated once, by its caller's thread
    (``Preparer``); the core's ``Sequence`` keeps it as it came.

    Attributes:
        request_id: the engine's id.
        cache_ids: the chunks, in the caller's order.
        prefix_ids, query_ids: the prefix's and the query's token ids, the BOS placed (``Preparer.new_request``).
        policy: the policy asked for (the engine's default resolved); the linker specialises it for the layout.
        order: the chunk order asked for (``Order.POLICY``: the policy's choice).
        relevance: one score per chunk (the caller's), or ``None``.
        compile_options: the options the policy needs its chunks compiled with.
        sampling: ``None`` parks the request after its recompute pass (``link``).
        sink: where its outputs go.
        paced: it runs only in steps its client asks for (``Stepper.step``) or that other requests need.
        access: the namespaces it may link chunks of (``pic.namespaces``); ``access.own.name`` is whose request it
            is (its quota, its turn among waiting requests).
    """

    request_id: int
    cache_ids: list[str]
    prefix_ids: list[int]
    query_ids: list[int]
    policy: Policy
    order: Order
    relevance: tuple[float, ...] | None
    compile_options: CompileOptions
    sampling: SamplingParams | None
    sink: OutputSink
    paced: bool = False
    access: Access = OPEN


@dataclass(frozen=True)
class CompileJob:
    """Chunks to compile (``PIC.compile``), tokenized and addressed by the caller.

    Attributes:
        tokens: cache id -> content tokens, for every chunk of the call.
        options: the compile options of every chunk.
        todo: the ids to compile when no tier holds them (the call's, or the ones a fleet lease gave it).
        on_chunk: called (on the engine thread) as each chunk of ``todo`` is stored: a progress bar.
        lower_tiers: write the chunks through to the lower tiers; ``False``: the KV pool only, nothing asked of
            or written to the CPU, disk and Redis tiers (``pic check``'s scratch chunks).
        interactive: a request waits for these chunks (a chat's inline documents): their prefills go with the
            requests' passes, before bulk compiles (``PICConfig.prefill_order``).
    """

    tokens: Mapping[str, list[int]]
    options: CompileOptions
    todo: tuple[str, ...]
    on_chunk: Callable[[], None] = lambda: None
    lower_tiers: bool = True
    interactive: bool = False


@dataclass(frozen=True)
class Stored:
    """A compile call's answer (the ``Compile`` command's reply): ``compiled``, the ids it prefilled, in order;
    ``tiers``, every id of the call -> the names of the tiers holding its chunk when the call ended, fastest first."""

    compiled: list[str]
    tiers: dict[str, tuple[str, ...]]
