"""Compiling documents: the engine's methods ``compile``, ``compile_report``, ``compile_policy`` and
``compile_options``, defined here (``PIC`` inherits them) so that the engine's file keeps to linking and generating.
They validate, tokenize and address the documents in the caller's thread, then send the core ``Compile`` commands."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pic.compile import TextOrTokens, encode_documents
from pic.config import CompileOptions
from pic.engine.caller.store_view import StoreView
from pic.engine.commands import Channel, Compile
from pic.engine.request import CompileJob, Preparer, Stored
from pic.errors import ContextLengthError, InvalidInputError
from pic.ids import chunk_id
from pic.link import policies
from pic.model import ModelSpec
from pic.namespaces import Access, Namespace, access_of
from pic.progress import tqdm

# Compiling this many new documents, or running this many requests (``generate_many``), shows a progress bar
# unless ``progress`` says otherwise.
PROGRESS_MIN = 8


@dataclass(frozen=True)
class CompileReport:
    """What a ``compile`` call stored, and where (``PIC.compile_report``).

    Attributes:
        ids: one cache id per document, in order.
        tiers: per id, the tiers that held its chunk when the call returned, fastest first (``"device"`` is the
            KV pool; then ``"cpu"``, ``"disk"``, ``"redis"``). A tier configured with ``on_*_error="miss"`` that
            failed is absent: the chunk is written to it once it works again (``StoreConfig.tier_retry_s``), if
            still resident then. A tier that had no room for the chunk is absent too.
        num_compiled: chunks prefilled by this call (the others were held by a tier already).
    """

    ids: list[str]
    tiers: list[tuple[str, ...]]
    num_compiled: int


class CompileMethods:
    """The compile methods of ``PIC``, over its tokenizer, model spec, fingerprint, store and channel."""

    tokenizer: object
    spec: ModelSpec
    fingerprint: str
    store: StoreView
    _channel: Channel
    _prepare: Preparer

    def compile(
        self,
        docs: TextOrTokens | Sequence[TextOrTokens],
        *,
        policy: str | policies.Policy | None = None,
        context: TextOrTokens | None = None,
        progress: bool | None = None,
        interactive: bool = False,
        namespace: str | Namespace | Access | None = None,
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
            namespace: the namespace the chunks go into (``pic.namespaces``: a name, a ``Namespace``, or an
                ``Access``, whose ``own`` namespace it is; ``None``: the default one). Their ids hash its salt (or,
                without one, its name), so the same document gets another id in every namespace; only ``link`` calls
                given that namespace (or reading it) can link them.

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
                where no lower tier can take them, beside each other (checked before any work; while requests
                run, the call waits for the blocks they free, and fails only if they still do not fit after).
        """
        return self.compile_report(
            docs, policy=policy, context=context, progress=progress, interactive=interactive, namespace=namespace
        ).ids

    def compile_report(
        self,
        docs: TextOrTokens | Sequence[TextOrTokens],
        *,
        policy: str | policies.Policy | None = None,
        context: TextOrTokens | None = None,
        progress: bool | None = None,
        lower_tiers: bool = True,
        interactive: bool = False,
        namespace: str | Namespace | Access | None = None,
    ) -> CompileReport:
        """``compile``, saying which tiers hold each chunk when it returns (``CompileReport.tiers``): under
        ``on_*_error="miss"`` a tier that failed does not, and a caller that promised its users a durable copy
        (a server acknowledging a compile) can say so or retry.

        ``lower_tiers=False``: the chunks go into the KV pool only: nothing is asked of or written to the CPU,
        disk and Redis tiers (scratch chunks, such as ``pic check``'s, that must not touch a user's store).

        Raises:
            as ``compile``.
        """
        own = self._prepare.names.check(access_of(namespace)).own
        context_ids = () if context is None else self._context_ids(context)
        options = self._prepare.compile_options(self.compile_policy(policy), context_ids)
        options = options.model_copy(update={"namespace": own.name}) if own.name else options
        ids, tokens = self._documents(docs, options, salt=own.salt)
        show = len(tokens) >= PROGRESS_MIN if progress is None else progress
        num_compiled = 0
        with tqdm(total=len(tokens), desc="pic compile", unit="chunk", disable=not show) as bar:

            def compile_ids(todo: Sequence[str]) -> Stored:
                nonlocal num_compiled
                job = CompileJob(
                    tokens=tokens, options=options, todo=tuple(todo), on_chunk=lambda: bar.update(1),
                    lower_tiers=lower_tiers, interactive=interactive,
                )  # fmt: skip
                stored = self._channel.call(lambda reply: Compile(job, reply))
                num_compiled += len(stored.compiled)
                return stored

            fleet = self.store.fleet  # workers sharing the Redis tier compile each chunk once between them
            if fleet is not None and lower_tiers:
                fleet.compile_once(ids, has_chunk=self.store.contains, compile=lambda todo: compile_ids(todo).compiled)
            stored = compile_ids(ids)  # the rest; resident chunks are written back where a lower tier lost them
            bar.update(bar.total - bar.n)  # (the chunks a tier held already)
        return CompileReport(ids=ids, tiers=[stored.tiers[cid] for cid in ids], num_compiled=num_compiled)

    def compile_policy(self, policy: str | policies.Policy | None = None) -> policies.Policy:
        """The policy ``compile`` and ``link`` use for ``policy`` (``None``: the engine's default); raises
        ``PolicyError`` for an unknown spec or a bad argument."""
        return self._prepare.default_policy if policy is None else policies.resolve(policy)

    def compile_options(self, policy: str | policies.Policy | None = None) -> CompileOptions:
        """The options chunks are compiled with for ``policy`` (part of the cache id); raises ``PolicyError`` for
        a policy that needs extra BOS tokens with a tokenizer that has none."""
        return self._prepare.compile_options(self.compile_policy(policy))

    def _context_ids(self, context: TextOrTokens) -> list[int]:
        """The token ids of a compile context, after the BOS when the engine starts prompts with one (a context is
        a prompt's start, as a prefix is).

        Raises:
            InvalidInputError: an empty context, a bad token id or text.
        """
        ids = self._prepare.encode(context, "context")
        if not ids:
            raise InvalidInputError(f"context {context!r:.80} has no tokens; leave it out to compile without one")
        bos = self._prepare.bos_token_id
        if self._prepare.config.add_bos and bos is not None and ids[0] != bos:
            ids.insert(0, bos)
        return ids

    def _documents(
        self, docs: TextOrTokens | Sequence[TextOrTokens], options: CompileOptions, *, salt: bytes = b""
    ) -> tuple[list[str], dict[str, list[int]]]:
        """Each document's cache id (repeats included; hashing ``salt``, its namespace's) and each distinct chunk's
        content tokens under its id.

        Raises:
            InvalidInputError: no documents, an empty document, a bad token id, bytes.
            ContextLengthError: a document that leaves no room for its BOS tokens and a query token.
        """
        spec = self.spec
        token_lists = encode_documents(
            self.tokenizer, docs, vocab_size=spec.vocab_size, max_chars=self._prepare.max_chars
        )
        most = spec.max_context - options.add_bos - max(1, options.num_dropped)
        for i, tokens in enumerate(token_lists):
            if len(tokens) > most:
                raise ContextLengthError(
                    f"document {i} has {len(tokens)} tokens; at most {most} fit the {spec.max_context}-token context "
                    f"of {spec.architecture} with its {options.add_bos + options.num_extra_bos} BOS tokens, "
                    f"{len(options.context)} context tokens and at least one query token; split it into smaller chunks"
                )
        ids = [chunk_id(self.fingerprint, tokens, options, salt) for tokens in token_lists]
        return ids, dict(zip(ids, token_lists, strict=True))
