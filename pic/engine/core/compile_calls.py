"""The engine's ``compile`` calls: ``CompileCall``, one call from its chunks' prefills to its answer, and
``CompileCalls``, the open ones.

A call's chunks are prefilled as scheduled work (``ChunkSources.prefills``), between and beside other requests'
steps, and written through to the lower tiers on the loader. A call is checked against the lower tiers and the
pool first, and holds each of its chunks in the pool until a lower tier has it too (or, without one, until the
call ends), so every id it returns is held by some tier when ``compile`` returns, and it never evicts its own
chunks. Its answer says which tiers hold each chunk (``Stored``): a tier under ``on_*_error="miss"`` that failed
does not, and the caller is told so rather than assured of a copy that is not there."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np

from pic.compile import ChunkPrefill
from pic.engine.core.chunk_sources import ChunkSources
from pic.engine.core.kv_manager import KVManager
from pic.engine.core.sequence import Sequence
from pic.engine.request import CompileJob, Stored
from pic.store import TieredStore


class CompileCall:
    """A compile call's progress. ``reply`` gets its ``Stored`` answer, or the error that stopped it."""

    def __init__(self, job: CompileJob, reply: Future) -> None:
        self.job, self.reply = job, reply
        self.keep = list(job.tokens)  # its chunks: the lower tiers must not evict them for it
        self.checks: dict[str, Future] = {}  # cache id -> the loader's answer to "which lower tiers lack it?"
        self.new: list[str] = []  # the ids no tier holds, to prefill (known once every check is answered)
        self.prefilling: set[str] = set()  # ids whose prefill is queued or under way
        self.writes: dict[str, Future] = {}  # cache id -> the loader's write of it to the lower tiers
        self.held: dict[str, np.ndarray] = {}  # cache id -> the blocks the call holds of it
        self.compiled: list[str] = []  # the ids it prefilled, in order
        self.lower: defaultdict[str, set[str]] = defaultdict(set)  # cache id -> lower tiers known to hold it
        self.error: Exception | None = None

    @property
    def interactive(self) -> bool:
        """A request waits for the call: its prefills go before bulk compiles (``ChunkPrefill.is_interactive``)."""
        return self.job.interactive

    @property
    def is_finished(self) -> bool:
        """Failed: its chunks need not be prefilled for it any more."""
        return self.error is not None

    @property
    def done(self) -> bool:
        return self.error is not None or not (self.checks or self.prefilling or self.writes)

    def fail(self, error: Exception) -> None:
        self.error = self.error or error

    def end(self, kv: KVManager, store: TieredStore) -> None:
        """Answer the call (where its chunks are in ``store``, or its error) and release its holds."""
        if self.error is not None:
            self.reply.set_exception(self.error)
        else:  # (before the holds go: every chunk of the call is resident)
            tiers = {cid: self._tiers(cid, store) for cid in self.job.tokens}
            self.reply.set_result(Stored(compiled=self.compiled, tiers=tiers))
        self.release(kv)

    def release(self, kv: KVManager) -> None:
        for blocks in self.held.values():
            kv.free_blocks(blocks)
        self.held = {}

    def _tiers(self, cache_id: str, store: TieredStore) -> tuple[str, ...]:
        device = ("device",) if store.device.contains(cache_id) else ()
        return device + tuple(t.name for t in store.lower if t.name in self.lower.get(cache_id, ()))


class CompileCalls:
    """The engine's open compile calls and the chunk prefills they wait for (queued in ``sources``, one per chunk,
    shared with requests that need it compiled again). ``busy``: whether requests run or prefill (they will free
    their blocks): a call is then not refused for the room they take now; its prefills wait for it (``Admission``),
    and fail only if they still do not fit once nothing runs."""

    def __init__(self, sources: ChunkSources, *, kv: KVManager, busy: Callable[[], bool]) -> None:
        self.sources, self.loader, self.store = sources, sources.loader, sources.store
        self.kv, self.busy = kv, busy
        self.open: list[CompileCall] = []

    def add(self, job: CompileJob, reply: Future) -> None:
        """Start a call: hold its resident chunks, ask the lower tiers which of its chunks they lack (resident ones
        are written back to them, ``_checked``), queue the prefills of those no tier holds. ``KVPoolExhaustedError``:
        the new chunks cannot fit in the pool (nothing is started), and no request runs that will free blocks."""
        call = CompileCall(job, reply)
        for cid, content in job.tokens.items():  # also those a lower tier holds: its copy may prove bad
            self.sources.remember_content(cid, content, job.options)
        for cid in call.keep:  # every resident chunk of the call's documents stays for its length
            if self.store.device.contains(cid):
                call.held[cid] = self.kv.hold_chunk(cid)
        for cid in dict.fromkeys(job.todo):  # which lower tiers lack each: write back, or compile
            if self.loader.has_lower_tiers and job.lower_tiers:
                call.checks[cid] = self.loader.missing(cid)
            elif cid not in call.held:
                call.new.append(cid)
        if not call.checks:
            self._start_prefills(call)  # KVPoolExhaustedError: refused before any work (holds released)
        self.open.append(call)
        self._end_done()

    def _start_prefills(self, call: CompileCall) -> None:
        """Once the call knows which of its chunks no tier holds: check that they fit (unless running requests will
        free blocks), queue their prefills."""
        try:
            if not self.busy():
                self.kv.check_compile(call.job, call.new, bos_token_id=self.sources.bos_token_id)
        except Exception:
            call.release(self.kv)  # not answered: the caller raises
            raise
        for cid in call.new:
            self.sources.compile(cid, call.job.tokens[cid], call.job.options).calls.append(call)
            call.prefilling.add(cid)

    def poll(self) -> None:
        """Take in the loader's answers (``Scheduler.update_from_output``) and answer the calls that are done."""
        for call in self.open:
            for cid, check in list(call.checks.items()):
                if check.done():
                    del call.checks[cid]
                    self._checked(call, cid, check)
                    if not call.checks and call.error is None:
                        try:
                            self._start_prefills(call)
                        except Exception as exc:  # KVPoolExhaustedError
                            call.fail(exc)
            for cid, write in list(call.writes.items()):
                if write.done():
                    del call.writes[cid]
                    try:
                        tiers = write.result()  # those that hold it now: the call's hold on it can go
                    except Exception as exc:  # StoreUnavailableError: on_redis_error="raise"
                        call.fail(exc)
                        continue
                    call.lower[cid].update(tiers)
                    if tiers and cid in call.held:
                        self.kv.free_blocks(call.held.pop(cid))
        self._end_done()

    def _end_done(self) -> None:
        for call in [c for c in self.open if c.done]:
            self.open.remove(call)
            call.end(self.kv, self.store)

    def _checked(self, call: CompileCall, cid: str, check: Future) -> None:
        """The lower tiers that lack ``cid`` are known: a resident chunk is written back to them (copied out of the
        pool only then); one no tier holds is to be compiled."""
        try:
            missing = check.result()
        except Exception as exc:
            call.fail(exc)
            return
        call.lower[cid].update(t.name for t in self.store.lower if t not in missing)
        if cid not in call.held and self.store.device.contains(cid):  # compiled meanwhile
            call.held[cid] = self.kv.hold_chunk(cid)
        if cid in call.held:
            if missing:
                copy = self.store.copy_for_lower(cid)
                call.writes[cid] = self.loader.write(copy, keep=call.keep, tiers=missing)
        elif len(missing) == len(self.store.lower):
            call.new.append(cid)

    @property
    def num_writing(self) -> int:
        """Chunk writes to the lower tiers under way: when they end, their calls' holds may go."""
        return sum(len(call.writes) for call in self.open)

    @property
    def has_news(self) -> bool:
        """Whether a loader answer waits to be taken in (``poll`` has work)."""
        return any(f.done() for call in self.open for f in (*call.checks.values(), *call.writes.values()))

    def chunk_done(self, prefill: ChunkPrefill) -> list[Sequence]:
        """A prefill's last piece ran: make the chunk resident, hand each call waiting for it a hold on it, write it
        through; returns the requests that waited for it (the engine holds it for them)."""
        info, blocks = self.kv.finish(prefill)
        del self.sources.prefills[prefill.cache_id]
        calls = prefill.calls
        through = [call for call in calls if call.job.lower_tiers]
        self.store.add(info, blocks, pool_only=bool(calls) and not through)
        self.sources.remember(info)
        # Written through for compile calls (which wait for it); a chunk compiled again for a request (no tier held
        # it, or its copy proved damaged) is written back to the tiers that lack it, and nobody waits; one that only
        # scratch calls asked for (``CompileJob.lower_tiers=False``) stays in the pool.
        write = None
        if through and self.loader.has_lower_tiers:
            keep = {c for call in through for c in call.keep}
            write = self.loader.write(self.store.copy_for_lower(info.cache_id), keep=keep)
        elif not calls and self.loader.has_lower_tiers:
            self.loader.write_back(self.store.copy_for_lower(info.cache_id))
        for call in calls:
            call.prefilling.discard(info.cache_id)
            call.held[info.cache_id] = self.kv.hold_chunk(info.cache_id)
            call.compiled.append(info.cache_id)
            call.job.on_chunk()
            if write is not None and call.job.lower_tiers:
                call.writes[info.cache_id] = write
        self.kv.free_blocks(blocks)  # (resident: the requests that waited for it hold it next, before any allocation)
        return prefill.requests

    def prefill_failed(self, prefill: ChunkPrefill, error: Exception) -> list[Sequence]:
        """A prefill cannot run: its blocks go, its calls fail; returns the requests that waited for it."""
        self.kv.abort(prefill)
        self.sources.prefills.pop(prefill.cache_id, None)
        for call in prefill.calls:
            call.prefilling.discard(prefill.cache_id)
            call.fail(error)
        return [seq for seq in prefill.requests if not seq.is_finished]

    def fail_all(self, error: Exception) -> None:
        for call in self.open:
            call.fail(error)
            call.end(self.kv, self.store)
        self.open = []
