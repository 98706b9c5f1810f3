"""``Linked``: a linked prompt whose KV is ready, holding its blocks until generated from or released."""

from __future__ import annotations

import weakref
from collections.abc import Generator, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from pic.errors import InvalidInputError, LinkedReleasedError
from pic.link.generate import Generation
from pic.link.sampling import SamplingParams

if TYPE_CHECKING:
    from pic.engine import Engine
    from pic.engine.sequence import Sequence as EngineSequence


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
        link_s: seconds ``link`` took (waiting for the engine included).
        num_shared_blocks: blocks of the request's table that alias a chunk's canonical block (no
            copy: one physical copy serves every live request linking the chunk).
        num_private_blocks: blocks the request owns: prefix, query, and copies of chunk blocks it
            writes into (copy-on-write); decode blocks are added as it generates.

    The request's KV blocks are held until ``generate`` / ``stream`` finishes, ``release`` is
    called, the ``with`` block exits, or the object is garbage-collected.
    """

    def __init__(self, engine: Engine, seq: EngineSequence, *, link_s: float) -> None:
        result = seq.first_pass
        self.layout = seq.layout
        self.input_ids = seq.layout.token_ids
        self.recomputed = result.recomputed
        self.num_recomputed = int(result.recomputed.sum())
        self.recomputed_by_layer = result.recomputed_by_layer
        self.policy = seq.policy
        self.link_s = link_s
        self.num_shared_blocks = seq.num_shared_blocks
        self.num_private_blocks = seq.num_private_blocks
        self._engine, self._seq = engine, seq
        self._hidden = seq.query_hidden  # [num_query_tokens, hidden_size]
        self._logits: torch.Tensor | None = None
        self._block_ids = list(seq.kv.blocks)
        self._started = False
        self._finalizer = weakref.finalize(self, engine.release, seq)

    @property
    def logits(self) -> torch.Tensor:
        """``[num_query_tokens, vocab_size]`` float32, next-token logits at every query position (the
        last row predicts the first new token); computed on first access."""
        if self._logits is None:
            self._logits = self._engine.runner.logits(self._hidden)
        return self._logits

    def generate(
        self,
        max_new_tokens: int = 64,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
    ) -> Generation:
        """Generate (greedy unless ``temperature > 0``) and release the request. See ``SamplingParams``.

        Generation stops at ``max_new_tokens``, an EOS token, a stop string, the model's context, or
        when the KV pool has no block left for the next token; the tokens generated so far are
        returned in every case, and ``.stats.finish_reason`` says which it was.

        Raises:
            InvalidInputError: a bad sampling option (the request stays usable).
            LinkedReleasedError: the request was already generated from or released.
        """
        seq = self._start(
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop
        )
        self._engine.run_until(lambda: seq.is_finished)
        return self._result()

    def stream(
        self,
        max_new_tokens: int = 64,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
    ) -> Iterator[str]:
        """Like ``generate``, yielding text pieces as they are final; their concatenation is the text.

        The stream ends cleanly whatever stops it (``Generation.stats.finish_reason`` of ``generate``
        says why); closing it early aborts the generation and releases the request."""
        seq = self._start(
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop
        )
        return self._pieces(seq)

    def _start(self, **options: object) -> EngineSequence:
        params = SamplingParams(**options)
        if self._started or not self._finalizer.alive:
            raise LinkedReleasedError("this Linked request was already generated from or released; link it again")
        self._started = True
        self._seq.link_s = self.link_s
        self._engine.resume(self._seq, params)
        return self._seq

    def _pieces(self, seq: EngineSequence) -> Generator[str, None, Generation]:
        try:
            while True:
                self._engine.run_until(lambda: bool(seq.outbox))
                out = seq.outbox.popleft()
                if out.text:
                    yield out.text
                if out.finished:
                    return self._result()
        finally:
            self.release()

    def _result(self) -> Generation:
        if self._seq.error is not None:
            raise self._seq.error
        return self._seq.generation

    @property
    def block_ids(self) -> list[int]:
        """The physical KV blocks of the request's linked prompt, in slot order (a copy of its block table
        when ``link`` returned)."""
        return list(self._block_ids)

    def release(self) -> None:
        """Free the request's blocks now (idempotent); aborts a generation still running."""
        self._finalizer()
        seq = self._seq
        self._engine.run_until(lambda: seq.is_finished)

    def __enter__(self) -> Linked:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return (
            f"Linked(num_tokens={self.input_ids.shape[0]}, num_chunks={len(self.layout.chunks)}, "
            f"num_recomputed={self.num_recomputed}, policy={self.policy.spec!r})"
        )


def generate_together(linked: Sequence[Linked], max_new_tokens: int = 64, **options: object) -> list[Generation]:
    """``generate`` for several linked requests of one engine at once: they decode in shared forward steps
    (the engine batches them), and each gets the generation it gets alone. ``options``: ``generate``'s.

    Raises:
        InvalidInputError: a bad sampling option, or requests of more than one engine (before any starts).
        LinkedReleasedError: one of them was already generated from or released (before any starts).
    """
    if not linked:
        return []
    engine = linked[0]._engine
    num_engines = len({id(item._engine) for item in linked})
    if num_engines > 1:
        raise InvalidInputError(f"generate_together takes requests of one engine, got requests of {num_engines}")
    SamplingParams(max_new_tokens=max_new_tokens, **options)
    if any(item._started or not item._finalizer.alive for item in linked):
        raise LinkedReleasedError("a Linked request was already generated from or released; link it again")
    seqs = [item._start(max_new_tokens=max_new_tokens, **options) for item in linked]
    engine.run_until(lambda: all(seq.is_finished for seq in seqs))
    return [item._result() for item in linked]
