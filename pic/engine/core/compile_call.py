"""``CompileCall``: one ``compile`` call inside the engine, from its chunks' prefills to its answer.

A call's chunks are prefilled as scheduled work (``ChunkSources.prefills``), between and beside other
requests' steps, and written through to the lower tiers on the loader. The call holds each of its
chunks in the pool until a lower tier has it too (or, without one, until the call ends), so every id
it returns is held by some tier when ``compile`` returns, and it never evicts its own chunks. Its answer
says which tiers hold each chunk (``Stored``): a tier under ``on_*_error="miss"`` that failed does not, and the
caller is told so rather than assured of a copy that is not there.
"""

from __future__ import annotations

from collections import defaultdict
from concurrent.futures import Future

from pic.engine.request import CompileJob, Stored
from pic.kv import BlockPool
from pic.store import TieredStore


class CompileCall:
    """A compile call's progress (engine thread). ``reply`` gets its ``Stored`` answer, or the error that
    stopped it; ``done`` says when.

    Attributes:
        checks: cache id -> the loader's answer to "which lower tiers lack it?" (for every id of ``todo``).
        new: the ids no tier holds, to prefill (known once every check is answered).
        prefilling: ids whose prefill is queued or under way.
        writes: cache id -> the loader's write of it to the lower tiers.
        held: cache id -> the blocks the call holds of it.
        compiled: the ids it prefilled, in order.
        lower: cache id -> names of the lower tiers known to hold it (found by the check, or written).
    """

    def __init__(self, job: CompileJob, reply: Future) -> None:
        self.job, self.reply = job, reply
        self.keep = list(job.tokens)  # what the lower tiers must not evict for the call's chunks
        self.checks: dict[str, Future] = {}
        self.new: list[str] = []  # the ids no tier holds: to prefill
        self.prefilling: set[str] = set()
        self.writes: dict[str, Future] = {}
        self.held: dict[str, list[int]] = {}
        self.compiled: list[str] = []
        self.lower: defaultdict[str, set[str]] = defaultdict(set)
        self.error: Exception | None = None

    @property
    def interactive(self) -> bool:
        """A request waits for the call (``CompileJob.interactive``): its prefills go before bulk compiles."""
        return self.job.interactive

    @property
    def is_finished(self) -> bool:
        """Failed: its chunks need not be prefilled for it any more."""
        return self.error is not None

    @property
    def done(self) -> bool:
        return self.error is not None or not (self.checks or self.prefilling or self.writes)

    def chunk_ready(self, cache_id: str, blocks: list[int]) -> None:
        """Its prefill of ``cache_id`` is resident; the call holds ``blocks`` (one reference each)."""
        self.prefilling.discard(cache_id)
        self.held[cache_id] = blocks
        self.compiled.append(cache_id)
        self.job.on_chunk()

    def written(self, cache_id: str, tiers: list[str], pool: BlockPool) -> None:
        """A lower tier (``tiers``: those that hold it now) has ``cache_id``: the call's hold on it can go."""
        del self.writes[cache_id]
        self.lower[cache_id].update(tiers)
        if tiers and cache_id in self.held:
            pool.free(self.held.pop(cache_id))

    def fail(self, error: Exception) -> None:
        self.error = self.error or error

    def end(self, pool: BlockPool, store: TieredStore) -> None:
        """Answer the call (where its chunks are in ``store``, or its error) and release its holds."""
        if self.error is not None:
            self.reply.set_exception(self.error)
        else:  # (before the holds go: every chunk of the call is resident)
            tiers = {cid: self._tiers(cid, store) for cid in self.job.tokens}
            self.reply.set_result(Stored(compiled=self.compiled, tiers=tiers))
        self.release(pool)

    def release(self, pool: BlockPool) -> None:
        """Free the call's holds on its chunks."""
        for blocks in self.held.values():
            pool.free(blocks)
        self.held = {}

    def _tiers(self, cache_id: str, store: TieredStore) -> tuple[str, ...]:
        device = ("device",) if store.device.contains(cache_id) else ()
        return device + tuple(t.name for t in store.lower if t.name in self.lower.get(cache_id, ()))
