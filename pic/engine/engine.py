"""``Engine``: continuous batching of linked requests, run by a thread of its own.

The engine builds its parts from the configs (``build_core``) and hands them to one owner thread
(``pic.engine.owner``). Every method here runs in the caller's thread: it validates and tokenizes, then
sends the owner a typed command and waits on the answer or on the request's outputs. Any number of
threads may call it at once; their requests share the owner's forwards. ``close()`` (or dropping the
engine) stops the thread.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import Future

import torch
from tqdm.auto import tqdm

from pic.compile import TextOrTokens, tokenizer_adds_bos
from pic.config import CompileOptions, PICConfig, StoreConfig
from pic.engine.build import build_core
from pic.engine.commands import Abort, Compile, Pause, Query, Submit
from pic.engine.core import CompileJob, EngineCore
from pic.engine.generation import Generation
from pic.engine.linked import Linked
from pic.engine.owner import OwnerThread
from pic.engine.prepare import Preparer, documents
from pic.engine.request import OutputSink, Request, RequestOutput, check_request_id
from pic.engine.stepper import Stepper
from pic.engine.store_view import StoreView
from pic.engine.streams import RequestStream
from pic.errors import InvalidInputError
from pic.ids import model_fingerprint
from pic.kv import KVStats
from pic.link import policies
from pic.model import ModelSpec
from pic.model.loading import model_eos_ids
from pic.model.runner import AttentionObserver

# Running at least this many requests shows a progress bar (unless ``progress`` says otherwise).
_PROGRESS_MIN_REQUESTS = 8


class Engine:
    """Compile chunks, link them with queries, generate: many requests per forward, from any thread.

    Args:
        model: a supported ``*ForCausalLM`` (Llama, Mistral, Qwen2, Qwen3 families), on its device.
        tokenizer: its tokenizer.
        config: engine options (``PICConfig``); ``self.config`` holds them with ``add_bos`` resolved.
        store: where chunks live besides the KV pool (``StoreConfig``: CPU and Redis tiers; default: none).

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
        if config.add_bos is None:  # the model's prompts start with a BOS exactly when its tokenizer writes one
            config = config.model_copy(update={"add_bos": tokenizer_adds_bos(tokenizer)})
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
        self._owner = OwnerThread(core)
        self.store = StoreView(self._owner, fleet=core.store.fleet)
        self._finalizer = weakref.finalize(self, self._owner.close)
        self._prepare = Preparer(tokenizer, self.spec, config=config, bos_token_id=self.bos_token_id)
        self._stepper = Stepper(self._owner, self._prepare)
        self.default_policy = self._prepare.default_policy

    # -- linking and generating ----------------------------------------------------------------------

    def link(
        self,
        cache_ids: Sequence[str],
        query: TextOrTokens,
        *,
        prefix: TextOrTokens = "",
        policy: str | policies.Policy | None = None,
        relevance: Sequence[float] | None = None,
    ) -> Linked:
        """Link cached chunks with a query (prompt: ``prefix + chunks + query``) and run the
        recompute pass, so the first token's logits are ready on return.

        ``relevance``: one score per cache id (higher: more relevant), e.g. a retriever's; a policy that
        ranks chunks (``regions``) recomputes the most relevant ones first.

        Raises:
            UnknownCacheIdError: an id no store tier holds.
            StoreUnavailableError: Redis failed (``StoreConfig.on_redis_error="raise"``).
            CompileOptionsMismatchError: a chunk compiled with other options than ``policy`` needs.
            InvalidInputError: an empty query, a bad token id.
            ContextLengthError: the linked prompt is longer than the model's context.
            KVPoolExhaustedError: the KV pool cannot hold the request beside the live ones (nothing
                is taken; the message gives the blocks needed and available).
        """
        return self.link_many([Request(cache_ids, query, prefix=prefix, policy=policy, relevance=relevance)])[0]

    def link_many(self, requests: Sequence[Request]) -> list[Linked]:
        """``link`` for several requests at once: their recompute passes share forwards. Their sampling
        options are not used (``Linked.generate`` takes its own). If one fails, the others are released
        and its error is raised."""
        _check_requests(requests)
        start = time.perf_counter()
        streams = [RequestStream(self._owner.alive, last_only=True) for _ in requests]
        news = [self._prepare.new_request(r, sink=s, sampling=None) for r, s in zip(requests, streams, strict=True)]
        self._owner.send(Submit(tuple(news)))
        try:
            firsts = [stream.get() for stream in streams]
        except BaseException:  # interrupted: nobody will hold these requests, so free them
            for new in news:
                self._owner.send(Abort(new.request_id))
            raise
        link_s = time.perf_counter() - start
        linked = [
            Linked(first, owner=self._owner, engine=self, policy=new.policy, link_s=link_s)
            for new, first in zip(news, firsts, strict=True)
            if not isinstance(first, RequestOutput)
        ]
        failed = next((first.error for first in firsts if isinstance(first, RequestOutput)), None)
        if failed is not None:
            for item in linked:
                item.release()
            raise failed
        return linked

    def generate_many(self, requests: Sequence[Request], *, progress: bool | None = None) -> list[Generation]:
        """Run many requests together (continuous batching) and return their generations, in order.

        Args:
            requests: ``pic.Request`` objects (chunks, query, policy and sampling options each).
            progress: show a progress bar (``None``, the default: for 8 or more requests).

        A request's generation is what it gets alone, whatever it is batched with. Every request is
        validated before any runs (a bad one raises ``InvalidInputError`` and none runs); every request
        runs to its end; then the first failure, if any, is raised (see ``link`` for the errors).
        """
        _check_requests(requests)
        streams = [RequestStream(self._owner.alive, last_only=True) for _ in requests]
        news = [
            self._prepare.new_request(r, sink=s, sampling=r.sampling) for r, s in zip(requests, streams, strict=True)
        ]
        self._owner.send(Submit(tuple(news)))
        show = progress if progress is not None else len(news) >= _PROGRESS_MIN_REQUESTS
        lasts: list[RequestOutput] = []
        try:
            with tqdm(total=len(news), desc="pic generate", unit="request", disable=not show) as bar:
                for stream in streams:
                    lasts.append(_last(stream))
                    bar.update(1)
        finally:
            for new in news[len(lasts) :]:  # interrupted: stop the rest
                self._owner.send(Abort(new.request_id))
        failed = next((out.error for out in lasts if out.error is not None), None)
        if failed is not None:
            raise failed
        return [out.generation for out in lasts]

    # -- compiling -----------------------------------------------------------------------------------

    def compile(
        self,
        docs: TextOrTokens | Sequence[TextOrTokens],
        *,
        policy: str | policies.Policy | None = None,
        context: TextOrTokens | None = None,
        progress: bool | None = None,
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

        Ids are content addresses: compiling a document that is already cached does no work, and
        compiling one whose chunk was evicted compiles it again. Each chunk is prefilled straight into
        canonical blocks of the KV pool (resident: the device tier) and written through to the CPU
        and Redis tiers. Every id returned is held by some tier when ``compile`` returns: the call
        never evicts its own chunks to make room for its other chunks. Workers sharing a Redis tier
        compile each chunk once between them (``pic.store.lease``).

        Raises:
            InvalidInputError: no documents, an empty document, a bad token id, bytes.
            ContextLengthError: a document that leaves no room for a query in the model's context.
            StoreUnavailableError: Redis failed (``StoreConfig.on_redis_error="raise"``).
            KVPoolExhaustedError: the new chunks do not fit in the KV pool beside the chunks in use and,
                where no lower tier can take them, beside each other (checked before any work).
        """
        options = self._prepare.compile_options(policy, context=context)
        found = documents(
            self.tokenizer, docs, options=options, spec=self.spec, fingerprint=self.fingerprint,
            max_chars=self._prepare.max_chars,
        )  # fmt: skip

        def compile_ids(todo: Sequence[str]) -> list[str]:
            job = CompileJob(tokens=found.tokens, options=options, todo=tuple(todo), progress=progress)
            return self._owner.call(lambda reply: Compile(job, reply))

        fleet = self.store.fleet
        if fleet is not None:  # workers sharing the Redis tier compile each chunk once between them
            fleet.compile_once(found.ids, has_chunk=self.store.contains, compile=compile_ids)
        compile_ids(found.ids)  # the rest; resident chunks are written back where a lower tier lost them
        return found.ids

    def compile_policy(self, policy: str | policies.Policy | None = None) -> policies.Policy:
        """The policy ``compile`` and ``link`` use for ``policy`` (``None``: the engine's default).

        Raises:
            PolicyError: an unknown spec or a bad argument.
        """
        return self._prepare.policy(policy)

    def compile_options(self, policy: str | policies.Policy | None = None) -> CompileOptions:
        """The options chunks are compiled with for ``policy`` (they are part of the cache id).

        Raises:
            PolicyError: a policy that needs extra BOS tokens with a tokenizer that has none.
        """
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
        return self._owner.ask(Query.KV_STATS)

    def reset_peak(self) -> None:
        """Restart ``KVStats.peak_used_blocks`` from the blocks in use now."""
        self._owner.ask(Query.RESET_PEAK)

    @contextlib.contextmanager
    def paused(self) -> Iterator[EngineCore]:
        """Stop the engine between two steps and lend its core to the caller (tests and debugging read
        the pool, store and runner here); the engine goes on when the block exits."""
        entered, resume = Future(), threading.Event()
        self._owner.send(Pause(entered, resume))
        try:
            yield self._owner.wait(entered)
        finally:
            resume.set()

    @contextlib.contextmanager
    def observe_attention(self, observer: AttentionObserver) -> Iterator[None]:
        """Within the block, every layer of every forward calls ``observer`` (on the engine's thread) with
        its attention's inputs: ``ModelRunner.observe_attention``, for analysis such as
        ``pic.evaluation.sinks``. Not reentrant."""
        with self.paused() as core:
            observing = core.runner.observe_attention(observer)
            observing.__enter__()
        try:
            yield
        finally:
            with self.paused():
                observing.__exit__(None, None, None)

    def engine(self) -> Stepper:
        """The iterative interface: ``add_request``, ``step``, ``abort``, ``has_unfinished``, and the
        engine's step counters (one object per engine)."""
        return self._stepper

    def close(self) -> None:
        """Stop the engine's thread and free its requests (open ones fail with ``EngineClosedError``);
        later calls raise ``EngineClosedError``. Idempotent; dropping the engine does the same."""
        self._finalizer()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_requests(requests: object) -> None:
    """Raises: InvalidInputError: ``requests`` is not a sequence of ``pic.Request`` (naming the first that is not)."""
    if not isinstance(requests, Sequence) or isinstance(requests, str):
        raise InvalidInputError(f"requests is {requests!r:.80}; expected a list of pic.Request")
    bad = next((i for i, r in enumerate(requests) if not isinstance(r, Request)), None)
    if bad is not None:
        raise InvalidInputError(f"requests[{bad}] is {requests[bad]!r:.80}; expected a pic.Request")


def _last(stream: RequestStream) -> RequestOutput:
    """Wait for a request's last output."""
    while not (out := stream.get()).finished:
        pass
    return out
