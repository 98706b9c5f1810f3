"""``Linked``: a linked prompt whose KV is ready, holding its blocks until generated from or released."""

from __future__ import annotations

import weakref
from collections.abc import Generator, Iterator, Sequence

import torch
from typing_extensions import Unpack

from pic.engine.commands import Abort, Channel, Logits, RequestStream, Resume
from pic.engine.generation import Generation
from pic.engine.request import LinkOutput, RequestOutput
from pic.errors import EngineClosedError, InvalidInputError, LinkedReleasedError
from pic.sampling import SamplingOptions, SamplingParams, sampling_params


class Linked:
    """The result of ``link``: the recompute pass has run, so the first token can be sampled at once.

    Attributes:
        input_ids: ``[T]`` int64 (CPU), the linked prompt without padding.
        recomputed: ``[T]`` bool (CPU), the tokens the policy recomputed through the last layer
            (prefix and query included); for a static policy, through every layer.
        num_recomputed: ``recomputed.sum()``.
        recomputed_by_layer: tokens recomputed in each layer, first layer first. A dynamic policy
            (CacheBlend) recomputes more tokens in its early layers than ``num_recomputed``.
        layout: where every segment sits in the request's blocks.
        policy: the policy that chose the recomputed tokens.
        order: the order the chunks ran in (``ChunkOrder``: ``order.order`` is ``Order.GIVEN`` or
            ``Order.RELEVANCE``, ``order.indices`` the caller's chunk indices in prompt order).
        recomputed_whole: the chunks recomputed whole, as the caller's chunk indices in prompt order.
        cache_ids: the chunks' cache ids in prompt order.
        num_chunks, num_tokens: ``len(cache_ids)`` and ``len(input_ids)`` (as ``repr`` shows them).
        link_s: seconds ``link`` took (waiting for the engine included).
        num_shared_blocks: blocks of the request's table that alias a chunk's canonical block (no
            copy: one physical copy serves every live request linking the chunk).
        num_private_blocks: blocks the request owns: prefix, query, and copies of chunk blocks it
            writes into (copy-on-write); decode blocks are added as it generates.
        probe: for a query-aware policy, what the query saw in its probe pass (``pic.link.probe.Probe``:
            the attention each token received from the query, per layer); ``None`` otherwise.

    The request's KV blocks are held until ``generate`` / ``stream`` finishes, ``release`` is
    called, the ``with`` block exits, or the object is garbage-collected. Any thread may use it.
    """

    def __init__(self, link: LinkOutput, *, channel: Channel, engine: object, link_s: float) -> None:
        self.layout = link.layout
        self.input_ids = link.layout.token_ids
        self.recomputed = link.recomputed
        self.num_recomputed = int(link.recomputed.sum())
        self.recomputed_by_layer = link.recomputed_by_layer
        self.policy = link.policy
        self.order = link.order
        self.cache_ids = [seg.cache_id for seg in link.layout.chunks]
        self.link_s = link_s
        self.num_shared_blocks = link.num_shared_blocks
        self.num_private_blocks = link.num_private_blocks
        self.probe = link.probe
        self._engine = engine  # the Engine: kept alive while the request is (dropping it closes it)
        self._channel = channel
        self._request_id, self._block_ids = link.request_id, list(link.block_ids)
        self._stream: RequestStream | None = None  # the generation's outputs, once started
        self._hidden = link.query_hidden  # [num_query_tokens, hidden_size]
        self._logits: torch.Tensor | None = None
        self._started = False
        self._finalizer = weakref.finalize(self, _abort_quietly, self._channel, link.request_id)

    @property
    def logits(self) -> torch.Tensor:
        """``[num_query_tokens, vocab_size]`` float32, next-token logits at every query position (the
        last row predicts the first new token); computed on first access."""
        if self._logits is None:
            self._logits = self._channel.call(lambda reply: Logits(self._hidden, reply))
        return self._logits

    def generate(
        self,
        max_new_tokens: int | None = None,
        *,
        sampling: SamplingParams | None = None,
        **options: Unpack[SamplingOptions],
    ) -> Generation:
        """Generate (greedy unless ``temperature > 0``) and release the request. Options: ``SamplingParams``'
        fields as keywords (``generate(32, temperature=0.8, seed=1)``), or one ``sampling=SamplingParams(...)``.

        Generation stops at ``max_new_tokens``, an EOS token, a stop string, the model's context, or
        when the KV pool has no block left for the next token; the tokens generated so far are
        returned in every case, and ``.stats.finish_reason`` says which it was.

        Raises:
            InvalidInputError: a bad sampling option (the request stays usable).
            LinkedReleasedError: the request was already generated from or released.
        """
        self._start(sampling_params(sampling, options, max_new_tokens), pieces=False)
        return self._result()

    def stream(
        self,
        max_new_tokens: int | None = None,
        *,
        sampling: SamplingParams | None = None,
        **options: Unpack[SamplingOptions],
    ) -> Iterator[str]:
        """Like ``generate``, yielding text pieces as they are final; their concatenation is the text.

        The stream ends cleanly whatever stops it (``Generation.stats.finish_reason`` of ``generate``
        says why); closing it early aborts the generation and releases the request."""
        self._start(sampling_params(sampling, options, max_new_tokens), pieces=True)
        return self._pieces()

    def _start(self, params: SamplingParams, *, pieces: bool) -> None:
        """Resume the request; its outputs come to a new stream (every piece, or only the last one)."""
        if self._started or not self._finalizer.alive:
            raise LinkedReleasedError("this Linked request was already generated from or released; link it again")
        self._started = True
        self._stream = RequestStream(self._channel.alive, last_only=not pieces)
        self._channel.send(Resume(self._request_id, params, self.link_s, self._stream))

    def _next(self) -> RequestOutput:
        out = self._stream.get()
        assert isinstance(out, RequestOutput), out
        if out.finished:
            self._finalizer.detach()  # its blocks are free already
        return out

    def _result(self) -> Generation:
        while not (out := self._next()).finished:
            pass
        if out.error is not None:
            raise out.error
        return out.generation

    def _pieces(self) -> Generator[str, None, Generation]:
        try:
            while True:
                out = self._next()
                if out.text:
                    yield out.text
                if out.finished:
                    if out.error is not None:
                        raise out.error
                    return out.generation
        finally:
            self.release()

    @property
    def num_chunks(self) -> int:
        """The chunks linked (``len(cache_ids)``)."""
        return len(self.cache_ids)

    @property
    def num_tokens(self) -> int:
        """The linked prompt's tokens (``len(input_ids)``)."""
        return int(self.input_ids.shape[0])

    @property
    def block_ids(self) -> list[int]:
        """The physical KV blocks of the request's linked prompt, in slot order (a copy of its block table
        when ``link`` returned)."""
        return list(self._block_ids)

    def release(self) -> None:
        """Free the request's blocks now (idempotent); aborts a generation still running."""
        if self._finalizer.detach() is None:
            return  # released, or finished
        if self._channel.is_current:
            self._channel.send(Abort(self._request_id))
            return
        try:
            self._channel.call(lambda reply: Abort(self._request_id, reply))
        except EngineClosedError:
            pass  # a closed engine freed everything

    def __enter__(self) -> Linked:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    @property
    def recomputed_whole(self) -> tuple[int, ...]:
        """The chunks recomputed whole (every token, through the last layer), as the caller's chunk indices in prompt
        order: which documents the link read fresh, e.g. ``auto``'s most relevant one (``order.indices[-1]``)."""
        return self.layout.recomputed_whole(self.recomputed, self.order.indices)

    def __repr__(self) -> str:
        return (
            f"Linked(num_tokens={self.num_tokens}, num_chunks={self.num_chunks}, "
            f"num_recomputed={self.num_recomputed}, policy={self.policy.spec!r}, order={self.order.order.value!r})"
        )


def generate_together(
    linked: Sequence[Linked], max_new_tokens: int | None = None, *, sampling: SamplingParams | None = None,
    **options: Unpack[SamplingOptions],
) -> list[Generation]:  # fmt: skip
    """``generate`` for several linked requests of one engine at once: they decode in shared forward steps
    (the engine batches them), and each gets the generation it gets alone. Options: ``generate``'s.

    Raises:
        InvalidInputError: a bad sampling option, or requests of more than one engine (before any starts).
        LinkedReleasedError: one of them was already generated from or released (before any starts).
    """
    if not linked:
        return []
    num_engines = len({id(item._channel) for item in linked})
    if num_engines > 1:
        raise InvalidInputError(f"generate_together takes requests of one engine, got requests of {num_engines}")
    params = sampling_params(sampling, options, max_new_tokens)
    if any(item._started or not item._finalizer.alive for item in linked):
        raise LinkedReleasedError("a Linked request was already generated from or released; link it again")
    for item in linked:
        item._start(params, pieces=False)
    return [item._result() for item in linked]


def _abort_quietly(channel: Channel, request_id: int) -> None:
    """The finalizer of a ``Linked`` dropped unreleased (any thread, even the engine's own, mid-step): queue
    the release; never wait, never raise."""
    try:
        channel.send(Abort(request_id))
    except EngineClosedError:
        pass
