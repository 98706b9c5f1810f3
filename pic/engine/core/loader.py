"""``Loader``: the engine's store I/O (CPU, disk and Redis tiers) on threads of its own.

The engine thread never waits on a lower tier: it hands each load or write to the loader and goes on stepping the
other requests; the loader wakes it when one is done (LMCache's asynchronous loading, with the engine's own thread
as vLLM's busy loop). A Redis that hangs costs its timeout to the requests and compiles that needed it, not to the
others. Results come back as ``concurrent.futures.Future`` objects, read by the engine thread once done, so no lock
guards engine state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

from pic.errors import EngineStepError, PicError
from pic.kv import ChunkKV
from pic.store import TieredStore
from pic.store.tier import LowerTier

log = logging.getLogger(__name__)

# Threads loading at once: enough that one request stuck on a hung Redis does not hold up loads from the CPU tier,
# few enough that a flood of requests does not open a connection each. Writes go through one thread, in the order
# the chunks were compiled: concurrent large writes would hold several parts in Redis's input buffers at once (a
# server near its maxmemory refuses them) and would store chunks out of order (its LRU keeps the newest).
_NUM_LOAD_THREADS = 4


class Loader:
    """Runs ``TieredStore``'s lower-tier operations on thread pools; ``wake`` is called (from a loader thread)
    after each, so the engine thread runs again."""

    def __init__(self, store: TieredStore, *, wake: Callable[[], None]) -> None:
        self.store, self._wake = store, wake
        self._loads = ThreadPoolExecutor(_NUM_LOAD_THREADS, thread_name_prefix="pic-loader") if store.lower else None
        self._writes = ThreadPoolExecutor(1, thread_name_prefix="pic-writer") if store.lower else None

    @property
    def has_lower_tiers(self) -> bool:
        return self._loads is not None

    def load(self, cache_id: str, *, readable: Mapping[str, bytes] | None = None) -> Future[ChunkKV | None]:
        """The chunk from the first lower tier that holds it in the namespaces ``readable`` names (name -> salt;
        ``TieredStore.load``), or ``None``."""
        return self._submit(self._loads, lambda cid: self.store.load(cid, readable=readable), cache_id)

    def missing(self, cache_id: str) -> Future[list[LowerTier]]:
        """The lower tiers that lack the chunk: a compile call's question, on the writer thread (in order with its
        writes)."""
        return self._submit(self._writes, self.store.missing, cache_id)

    def write(
        self, chunk: ChunkKV, *, keep: Collection[str] = (), tiers: Collection[LowerTier] | None = None
    ) -> Future[list[str]]:
        """A compile call's write of ``chunk`` to the lower tiers (of ``tiers``; default: all); the names of those
        that took it."""
        return self._submit(self._writes, lambda c: self.store.write_lower(c, keep=keep, tiers=tiers), chunk)

    def write_back(self, chunk: ChunkKV, *, recheck: bool = False) -> None:
        """Write a chunk to the lower tiers that lack it, fire and forget (a chunk compiled again for a request; a
        chunk a tier failed to take, retried: ``retry_writes``): a failure is logged, never a request's.
        ``recheck``: a resident chunk, to the shared tiers that lost it (a failure pauses the checks)."""
        tiers = self.store.shared_tiers if recheck else None

        def run(c: ChunkKV) -> None:
            try:
                self.store.write_lower(c, tiers=tiers, missing_only=True)
            except Exception as exc:
                if recheck:
                    self.store.recheck_failed(c.cache_id, exc)
                    return
                log.warning("pic: could not write chunk %s to the lower tiers that lack it: %s", c.cache_id, exc)
                self.store.backlog.errored(c.cache_id)  # a retry of the backlog's: due again, not under way forever

        self._submit(self._writes, run, chunk)

    def retry_writes(self) -> None:
        """Write the chunks a lower tier failed to take (``TieredStore.backlog``) again, when due: from the pool
        while they are resident there (``write_back``), else forgotten."""
        for cache_id in self.store.backlog.due():
            try:
                if self.store.device.contains(cache_id):
                    self.write_back(self.store.copy_for_lower(cache_id))
                    continue
            except Exception:  # a retry never stops the engine
                log.exception("pic: could not retry writing chunk %s to the lower tiers", cache_id)
            self.store.backlog.forget(cache_id, evicted=True)

    def settled(self) -> Future[None]:
        """Done once every write, check and write-back submitted before it has run (the writer thread runs them in
        order): what a caller waits on to see the lower tiers after the engine's fire-and-forget writes."""
        return self._submit(self._writes, lambda _: None, None)

    def _submit(self, threads: ThreadPoolExecutor | None, fn: Callable, arg: object) -> Future:
        """``fn(arg)`` on ``threads``; what it raises that is not a ``PicError`` (a tier's bug, a fault the tier does
        not map to ``StoreUnavailableError``) comes back as the ``EngineStepError`` it caused."""
        assert threads is not None, "no lower tier to do I/O with"

        def run(value: object) -> object:
            try:
                return fn(value)
            except PicError:
                raise
            except Exception as exc:
                raise EngineStepError.of(exc) from exc

        future = threads.submit(run, arg)
        future.add_done_callback(lambda _: self._wake())
        return future

    def close(self) -> None:
        """Stop taking work; running operations finish on their own (a hung Redis: at its timeout)."""
        for threads in (self._loads, self._writes):
            if threads is not None:
                threads.shutdown(wait=False, cancel_futures=True)
