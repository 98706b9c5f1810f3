"""``ChunkSources``: where a waiting request's chunks come from, without the engine thread waiting on any.

A chunk resident in the pool is used as it is. One that is not is fetched while the request waits alone and the
others step: loaded from a lower tier on the loader (``pic.engine.core.loader``), or, when no tier holds it,
compiled again from its tokens, which the engine remembers for every chunk it compiled or linked (a request always
has its documents' tokens). So an eviction, a preemption or a restarted Redis costs a request time, never its
chunks. The same queue holds the chunk prefills of ``compile`` calls: one prefill per chunk, however many wait for
it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from concurrent.futures import Future

import torch

from pic.compile import ChunkPrefill
from pic.compile.prefill import lead_tokens
from pic.config import CompileOptions
from pic.engine.core.loader import Loader
from pic.engine.core.sequence import Fetch, Sequence
from pic.errors import CompileOptionsMismatchError
from pic.kv import ChunkInfo, ChunkKV
from pic.store import TieredStore

# Tokens of the chunks the engine remembers how to compile again (the least recently used are forgotten beyond
# it): 4M tokens, 32 MB of int64 at most, shared with the pool's resident chunks' infos.
_MAX_RECIPE_TOKENS = 1 << 22


class ChunkSources:
    """Resolves sequences' chunks, and queues the chunk prefills that ``compile`` and resolution need
    (``prefills``: cache id -> its prefill, in arrival order: the compile work the scheduler runs)."""

    def __init__(self, store: TieredStore, loader: Loader, *, bos_token_id: int | None) -> None:
        self.store, self.loader, self.bos_token_id = store, loader, bos_token_id
        self.prefills: dict[str, ChunkPrefill] = {}
        self._recipes: OrderedDict[str, ChunkInfo] = OrderedDict()
        self._num_recipe_tokens = 0

    def drop_abandoned(self) -> list[ChunkPrefill]:
        """Take the prefills whose waiters all ended (a request that failed meanwhile) off the queue; returns them
        (the KV manager frees their blocks: ``KVManager.abort``)."""
        dropped = [p for p in self.prefills.values() if all(w.is_finished for w in p.waiters)]
        for prefill in dropped:
            del self.prefills[prefill.cache_id]
        return dropped

    def compile(self, cache_id: str, content: list[int], options: CompileOptions) -> ChunkPrefill:
        """The prefill of ``cache_id``: a new one, queued, unless one is under way (whoever waits for it joins its
        ``calls`` or ``requests``)."""
        if cache_id not in self.prefills:
            bos, order = self.bos_token_id, time.perf_counter()
            self.prefills[cache_id] = ChunkPrefill(cache_id, content, options, bos_token_id=bos, order=order)
        return self.prefills[cache_id]

    def remember(self, info: ChunkInfo) -> None:
        """Keep what compiling chunk ``info`` again takes (its tokens and options)."""
        if info.cache_id in self._recipes:
            self._recipes.move_to_end(info.cache_id)
            return
        self._recipes[info.cache_id] = info
        self._num_recipe_tokens += info.num_tokens
        while self._num_recipe_tokens > _MAX_RECIPE_TOKENS:
            _, old = self._recipes.popitem(last=False)
            self._num_recipe_tokens -= old.num_tokens

    def remember_content(self, cache_id: str, content: list[int], options: CompileOptions) -> None:
        """Keep the tokens of a ``compile`` call's chunk that is not prefilled here (a lower tier holds it), so that
        a link whose load finds that copy damaged or gone compiles it again instead of failing."""
        info = self._recipes.get(cache_id)  # (the common case: a server compiles inline documents on every request)
        if info is None:
            kept = (lead_tokens(options, self.bos_token_id) + content)[options.num_dropped :]  # as ChunkPrefill keeps
            info = ChunkInfo(cache_id=cache_id, token_ids=torch.tensor(kept, dtype=torch.long), options=options)
        self.remember(info)

    def forget(self, cache_id: str) -> None:
        """Forget a chunk's tokens (it was expired: linking its id again is an error)."""
        info = self._recipes.pop(cache_id, None)
        if info is not None:
            self._num_recipe_tokens -= info.num_tokens

    def fetch(self, seq: Sequence) -> bool:
        """Fetch ``seq``'s chunks: whether every one is at hand (then ``seq.fetch.chunks`` holds them: resident
        ``ChunkInfo`` or loaded ``ChunkKV``); those that are not start loading or compiling (a prefetch: it runs
        while others step).

        Raises:
            UnknownCacheIdError: a chunk no tier holds and the engine never saw.
            StoreUnavailableError: Redis failed (``on_redis_error="raise"``).
            CompileOptionsMismatchError: a chunk compiled with other options than the policy needs.
        """
        fetch = seq.fetch
        if fetch.chunks is not None and not self._evicted(fetch):
            return True
        if fetch.pending:  # (a load lands in ``loaded``; a compile done is no longer pending: ``compiled``)
            return False
        chunks = {cid: self._find(seq, cid) for cid in dict.fromkeys(seq.request.cache_ids)}
        if fetch.pending:
            return False
        lost = [cid for cid, chunk in chunks.items() if chunk is None]
        recipes = {cid: self._recipe(seq, cid) for cid in lost}  # every one known before any compile starts
        for cid, recipe in recipes.items():
            kept = recipe.token_ids.tolist()
            fetch.pending[cid] = self.compile(cid, kept[1:] if recipe.options.add_bos else kept, recipe.options)
            fetch.pending[cid].requests.append(seq)
        if fetch.pending:
            return False
        fetch.chunks = [_checked(seq, chunks[cid]) for cid in seq.request.cache_ids]  # (a new list: laid out again)
        fetch.found, fetch.lost = {}, set()
        return True

    def loaded(self, seq: Sequence) -> None:
        """Take in the loader's answers for ``seq``'s chunks (``Scheduler.update_from_output``): a chunk found is
        kept for its admission, one no tier held is compiled again at its next ``fetch``; ``StoreUnavailableError``
        when a lower tier failed the load (``on_redis_error="raise"``)."""
        fetch = seq.fetch
        for cid, pending in list(fetch.pending.items()):
            if isinstance(pending, Future) and pending.done():
                del fetch.pending[cid]
                chunk = pending.result()
                if chunk is None:
                    fetch.lost.add(cid)
                else:
                    fetch.found[cid] = chunk
                    self.remember(chunk.info)

    @staticmethod
    def compiled(seq: Sequence, cache_id: str) -> None:
        """A chunk compiled for ``seq`` is resident (and held for it): it is no longer pending."""
        seq.fetch.pending.pop(cache_id, None)

    def _evicted(self, fetch: Fetch) -> bool:
        return any(isinstance(c, ChunkInfo) and not self.store.device.contains(c.cache_id) for c in fetch.chunks)

    def _find(self, seq: Sequence, cid: str) -> ChunkInfo | ChunkKV | None:
        """The chunk if it is at hand; else ``None``: a load starts (``fetch.pending``) or, when no tier holds it
        (``fetch.lost``, or no lower tier), the caller compiles it again.

        Raises:
            UnknownCacheIdError: a resident chunk of a namespace ``seq`` may not read (as for an id nobody compiled).
        """
        fetch, access = seq.fetch, seq.request.access
        if cid in fetch.found:  # loaded for it, in its namespaces (asked of the pool once: a miss is counted once)
            return fetch.found[cid]
        info = self.store.resident(cid, readable=access.readable)
        if info is not None:
            if (copy := self.store.recheck_due(cid)) is not None:
                self.loader.write_back(copy, recheck=True)
            self.remember(info)
            return info
        if self.loader.has_lower_tiers and cid not in fetch.lost:
            fetch.pending[cid] = self.loader.load(cid, readable=access.readable)
        return None

    def _recipe(self, seq: Sequence, cid: str) -> ChunkInfo:
        """What compiling ``cid`` again takes: the tokens the engine kept, or those of the sequence's own chunk
        (``UnknownCacheIdError``: the engine has not seen its tokens, or they are another namespace's)."""
        fetch = seq.fetch
        recipe = self._recipes.get(cid) or next((c for c in fetch.chunks or () if c.cache_id == cid), None)
        if recipe is None or not seq.request.access.may_read(recipe.options.namespace):
            raise self.store.unknown(cid)
        return recipe


def _checked(seq: Sequence, chunk: ChunkInfo | ChunkKV) -> ChunkInfo | ChunkKV:
    """Raises: CompileOptionsMismatchError: ``chunk`` was compiled with other options than the policy needs, or in a
    context the prompt does not start with (``check_context``)."""
    options, policy, cid = seq.request.compile_options.policy_options(), seq.link.policy, chunk.cache_id
    if chunk.options.policy_options() != options:
        raise CompileOptionsMismatchError(
            f"chunk {cid} was compiled with {chunk.options.policy_options()!r} but policy "
            f"{policy.spec!r} needs {options!r}; compile it with compile(docs, policy={policy.spec!r})"
        )
    if policy.needs_context and not chunk.options.context:
        raise CompileOptionsMismatchError(
            f"chunk {cid} was compiled without a context but policy {policy.spec!r} needs chunks "
            f"compiled in context; compile it with compile(docs, context=...) (PIC.chat_context for a chat)"
        )
    check_context(chunk, seq.request.prefix_ids)
    return chunk


def check_context(chunk: ChunkInfo | ChunkKV, prefix_ids: list[int]) -> None:
    """One rule for chunks compiled *in context* (``compile(docs, context=...)``, a chat's documents): such a chunk
    links only into prompts whose prefix starts with that context. Its KV is what it is after the context's text,
    which the linked prompt would otherwise never show: a chunk compiled after another system prompt carries that
    prompt's instructions into every chat that links it (HijackKV's condition), so it is refused, not warned about.
    A chunk compiled alone (no context) links anywhere: its KV starts a sequence and carries no one's context.

    Raises:
        CompileOptionsMismatchError: naming the chunk, its context's length and where the prompt departs from it.
    """
    context = chunk.options.context
    if not context or tuple(prefix_ids[: len(context)]) == context:
        return
    pairs = zip(context, prefix_ids, strict=False)  # (the prefix may be shorter)
    same = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(context), len(prefix_ids)))
    raise CompileOptionsMismatchError(
        f"chunk {chunk.cache_id} was compiled after a context of {len(context)} tokens that this prompt does not start "
        f"with (its prefix of {len(prefix_ids)} tokens departs from it at token {same}): a chunk compiled in context "
        "links only after that context (the same system prompt, for a chat's documents). Compile it again in this "
        "prompt's context (link_chat(documents=...), compile(docs, context=...)), or alone (no context), to link it "
        "anywhere"
    )
