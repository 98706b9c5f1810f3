"""Compiling documents: the engine's methods ``compile``, ``compile_report``, ``compile_policy`` and
``compile_options``, defined here (``PIC`` inherits them) so that the engine's file keeps to linking and generating.
They validate and tokenize in the caller's thread and send the core a ``Compile`` command
(``pic.engine.caller.calls.compile_documents``)."""

from __future__ import annotations

from collections.abc import Sequence

from pic.compile import TextOrTokens
from pic.config import CompileOptions
from pic.engine.caller.calls import compile_documents
from pic.engine.caller.prepare import Preparer, documents
from pic.engine.caller.store_view import StoreView
from pic.engine.commands import Channel
from pic.engine.request import CompileReport
from pic.link import policies
from pic.model import ModelSpec


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
                where no lower tier can take them, beside each other (checked before any work; while requests
                run, the call waits for the blocks they free, and fails only if they still do not fit after).
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
            self._channel, found, options, fleet=fleet, has_chunk=has_chunk, progress=progress, lower_tiers=lower_tiers,
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
