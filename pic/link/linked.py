"""``Linked``: a linked prompt whose KV is ready, holding its blocks until generated or released."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Generator, Iterator, Sequence

from pic.errors import LinkedReleasedError
from pic.kv import RequestKV
from pic.link.generate import DecodeContext, Generation, decode
from pic.link.layout import Layout
from pic.link.policies import Policy
from pic.link.recompute import Recomputed
from pic.link.sampling import SamplingParams
from pic.model import ModelRunner


class Linked:
    """The result of ``link``: the recompute pass has run, so the first token's logits are ready.

    Attributes:
        input_ids: ``[T]`` int64 (CPU), the linked prompt without padding.
        logits: ``[num_query_tokens, vocab_size]`` float32, next-token logits at every query
            position; the last row predicts the first new token.
        recomputed: ``[T]`` bool (CPU), the tokens the policy recomputed through the last layer
            (prefix and query included); for a static policy, through every layer.
        num_recomputed: ``recomputed.sum()``.
        recomputed_by_layer: tokens recomputed in each layer, first layer first. A dynamic policy
            (CacheBlend) recomputes more tokens in its early layers than ``num_recomputed``.
        layout: where every segment sits in the request's blocks.
        policy: the policy that chose the recomputed tokens.
        link_s: seconds ``link`` took.
        num_shared_blocks: blocks of the request's table that alias a chunk's canonical block (no
            copy: one physical copy serves every live request linking the chunk).
        num_private_blocks: blocks the request owns: prefix, query, and copies of chunk blocks it
            writes into (copy-on-write); decode blocks are added as it generates.

    The request's KV blocks are held until ``generate`` / ``stream`` finishes, ``release`` is
    called, the ``with`` block exits, or the object is garbage-collected.
    """

    def __init__(
        self,
        *,
        runner: ModelRunner,
        tokenizer: object,
        layout: Layout,
        policy: Policy,
        result: Recomputed,
        link_s: float,
        eos_token_ids: frozenset[int],
        lock: threading.RLock,
    ) -> None:
        self.input_ids = layout.token_ids
        self.logits = result.logits
        self.recomputed = result.recomputed
        self.num_recomputed = int(result.recomputed.sum())
        self.recomputed_by_layer = result.recomputed_by_layer
        self.layout = layout
        self.policy = policy
        self.link_s = link_s
        self.num_shared_blocks = result.num_shared_blocks
        self.num_private_blocks = result.num_private_blocks
        self._runner, self._tokenizer, self._eos, self._lock = runner, tokenizer, eos_token_ids, lock
        self._req = result.req
        self._started = False
        self._finalizer = weakref.finalize(self, _release, lock, result.req)

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
        steps = self._start(
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop
        )
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

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
        says why); closing it early releases the request."""
        return self._start(
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop
        )

    def _start(self, **options: object) -> Generator[str, None, Generation]:
        params = SamplingParams(**options)
        if self._started or not self._finalizer.alive:
            raise LinkedReleasedError("this Linked request was already generated from or released; link it again")
        self._started = True
        return self._run(params)

    def _run(self, params: SamplingParams) -> Generator[str, None, Generation]:
        ctx = DecodeContext(
            runner=self._runner,
            tokenizer=self._tokenizer,
            req=self._req,
            first_logits=self.logits[-1],
            num_prompt_tokens=self.input_ids.shape[0],
            num_recomputed=self.num_recomputed,
            link_s=self.link_s,
            eos_token_ids=self._eos,
            max_context=self._runner.spec.max_context,
            lock=self._lock,
        )
        try:
            return (yield from decode(ctx, params))
        finally:
            self.release()

    @property
    def block_ids(self) -> list[int]:
        """The physical KV blocks of the request, in slot order (a copy of its block table)."""
        return list(self._req.blocks)

    def release(self) -> None:
        """Free the request's blocks now (idempotent)."""
        self._finalizer()

    def __enter__(self) -> Linked:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return (
            f"Linked(num_tokens={self.input_ids.shape[0]}, num_chunks={len(self.layout.chunks)}, "
            f"num_recomputed={self.num_recomputed}, policy={self.policy.spec!r})"
        )


def _release(lock: threading.RLock, req: RequestKV) -> None:
    """The finalizer: free the request's blocks under the engine lock."""
    with lock:
        req.release()
