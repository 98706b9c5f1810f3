"""``TieredStore``: the device tier (chunks resident in the KV pool), then CPU, disk and Redis tiers.

Writes go through to every tier (a fleet shares what one worker compiles): ``compile`` prefills a
chunk straight into the pool and the store copies it down. Reads look in the pool first; a chunk found
only in a lower tier comes back as a ``ChunkKV`` for the engine to promote into fresh blocks, and is
promoted into the lower tiers above the one that had it (Redis -> disk -> CPU). The CPU and disk tiers
are byte-bounded LRUs; the pool evicts unreferenced chunks when it needs blocks. A chunk evicted from one
tier stays in the tiers below. Pinned chunks are never evicted.

Every tier answers the same protocol (``pic.store.tier``), so the store never asks which kind a tier
is. A write that a tier under ``on_*_error="miss"`` failed is remembered (``WriteBacklog``) and retried by the
engine once the tier works again. Threads: the device tier is the engine thread's alone (``add``, ``promote``,
``resident``); the lower tiers are safe from any thread, and the engine calls them only from its loader (``load``,
``write_lower``), so a slow or hung Redis never stops its steps. Other threads reach the store through ``view``.

Reads by a caller of some namespaces (``readable``: name -> salt, ``pic.namespaces.Access.readable``) see only
those namespaces' chunks: ``load``, ``get``, ``describe`` and ``expire`` answer for any other chunk exactly as for
an id nobody stored. ``readable=None`` (every caller before tenants) reads every namespace's, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping

from pic.config import Quota, StoreConfig
from pic.errors import StoreUnavailableError, UnknownCacheIdError, cache_id_hint, shown_id
from pic.kv import ChunkInfo, ChunkKV
from pic.store import serde
from pic.store.backlog import WriteBacklog
from pic.store.description import ChunkDescription
from pic.store.device import DeviceTier
from pic.store.disk import DiskTier
from pic.store.guard import failed_here
from pic.store.lease import FleetLeases
from pic.store.limits import check_cpu_tier
from pic.store.lru import LruTier
from pic.store.recheck import SharedRechecks
from pic.store.redis_tier import RedisTier
from pic.store.tier import LowerTier, Tier, TierStats

logger = logging.getLogger(__name__)


class TieredStore:
    """The device tier, then lower tiers, fastest first.

    Args:
        device: the KV pool's resident chunks.
        lower: the CPU and/or Redis tiers, fastest first (may be empty).
        lease_s: the fleet's compile leases' life in a shared tier (``StoreConfig.redis_lease_s``).
        recheck_s: ``StoreConfig.shared_recheck_s``.
        retry_s: ``StoreConfig.tier_retry_s``: the backlog of failed writes is retried no more often.
        pinned: the set of pinned ids, when another ``TieredStore`` over the same tiers shares it (``view``).

    Attributes:
        backlog: the chunks a lower tier failed to take (under ``"miss"``), to write once it works again.
    """

    def __init__(
        self,
        device: DeviceTier,
        lower: list[LowerTier],
        *,
        lease_s: float = 10.0,
        recheck_s: float | None = 30.0,
        retry_s: float = 5.0,
        pinned: set[str] | None = None,
    ) -> None:
        self.device, self.lower = device, lower
        self.tiers: list[Tier] = [device, *lower]
        self._pinned: set[str] = set() if pinned is None else pinned
        self.backlog = WriteBacklog(retry_s)
        self._pool_only: set[str] = set()  # resident chunks compiled for the pool alone (``CompileJob.lower_tiers``)
        # The tiers a fleet shares (Redis): those that keep compile leases; the first one holds the fleet's.
        self._shared = [(tier, leases) for tier in lower if (leases := tier.leases(lease_s)) is not None]
        self._rechecks = SharedRechecks(recheck_s if self._shared else None)

    @classmethod
    def from_config(
        cls,
        config: StoreConfig,
        *,
        device: DeviceTier,
        expected: serde.Expected,
        quotas: Mapping[str, Quota] | None = None,
    ) -> TieredStore:
        """The tiers ``config`` names below ``device``; ``quotas``: the engine's (``PICConfig.quotas``), whose
        ``store_share``s the CPU tier keeps per namespace."""
        # Page-locked CPU memory only for an engine on CUDA: its copies to the pool can then be asynchronous.
        # (Pinning for a CPU engine on a machine that has a GPU would lock host memory for nothing.)
        shares = {name: q.store_share for name, q in (quotas or {}).items()}
        lower = lower_tiers(config, expected=expected, pin=device.kv_device.type == "cuda", store_shares=shares)
        return cls(
            device, lower, lease_s=config.redis_lease_s, recheck_s=config.shared_recheck_s, retry_s=config.tier_retry_s
        )

    def add(self, info: ChunkInfo, block_ids: list[int], *, pool_only: bool = False) -> None:
        """Make a chunk prefilled into ``block_ids`` resident (engine thread; pinned if its id is). ``pool_only``: it
        was compiled for the pool alone, and no link's recheck writes it to the shared tiers (until a compile
        writes it through)."""
        self.device.add(info, block_ids)
        if pool_only:
            self._pool_only.add(info.cache_id)
        if info.cache_id in self._pinned:
            self.device.pin(info.cache_id)

    def copy_for_lower(self, cache_id: str) -> ChunkKV:
        """A copy of a resident chunk's KV out of the pool, for ``write_lower`` on another thread (engine thread).
        The shared tiers are about to get it: it counts as checked (``SharedRechecks``)."""
        self._rechecks.written(cache_id)
        self._pool_only.discard(cache_id)
        chunk = self.device.peek(cache_id)
        assert chunk is not None, f"chunk {cache_id} is not resident"
        return chunk

    def write_lower(
        self,
        chunk: ChunkKV,
        *,
        keep: Collection[str] = (),
        tiers: Collection[LowerTier] | None = None,
        missing_only: bool = False,
    ) -> list[str]:
        """Copy ``chunk`` down to the lower tiers (of ``tiers``; default: all), lowest first (the shared copy
        exists before the local ones); returns the names of the tiers that took it. Any thread.

        ``missing_only``: write only to the tiers that lost it (Redis restarted without persistence, or the
        chunk was compiled while Redis was down under ``on_redis_error="miss"``): ``compile`` does so for
        resident chunks (``missing``, then ``tiers=`` those), so compiling a document again restores the fleet's
        shared copy, and a link of a resident chunk does so for the shared tiers every
        ``StoreConfig.shared_recheck_s``.

        A tier under ``on_*_error="miss"`` that fails is skipped, and the chunk goes into ``backlog`` for it (a
        later write that it takes takes it out).

        Args:
            keep: cache ids the lower tiers must not evict for it (the other chunks of a ``compile`` call).

        Raises:
            StoreUnavailableError: a tier failed under ``"raise"``.
        """
        targets = [t for t in self.lower if tiers is None or t in tiers]
        held = []
        if missing_only:
            lacking = self.missing(chunk.cache_id)
            targets, held = [t for t in targets if t in lacking], [t.name for t in targets if t not in lacking]
        took, failed = [], []
        for tier in reversed(targets):
            if tier.put(chunk, keep=keep):
                took.append(tier.name)
            elif failed_here(tier):  # (not: no room for it)
                failed.append(tier.name)
        self.backlog.record(chunk.cache_id, took=took + held, failed=failed)
        return took[::-1]

    def missing(self, cache_id: str) -> list[LowerTier]:
        """The lower tiers that do not hold ``cache_id``, fastest first. Any thread.

        Raises:
            StoreUnavailableError: Redis failed (``on_redis_error="raise"``).
        """
        return [tier for tier in self.lower if not tier.contains(cache_id)]

    def recheck_due(self, cache_id: str) -> ChunkKV | None:
        """A resident chunk's KV when a check that the shared tiers still hold it is due (``SharedRechecks``;
        engine thread): the caller runs ``write_lower(chunk, tiers=shared_tiers, missing_only=True)`` off the
        engine thread and reports a failure with ``recheck_failed``."""
        if not self._shared or cache_id in self._pool_only or not self._rechecks.is_due(cache_id):
            return None
        self._rechecks.forget(self.device.contains)
        return self.device.peek(cache_id)

    def recheck_failed(self, cache_id: str, error: Exception) -> None:
        self._rechecks.failed()
        logger.warning("pic: could not check that the shared tier holds chunk %s: %s", cache_id, error)

    @property
    def shared_tiers(self) -> list[LowerTier]:
        return [tier for tier, _ in self._shared]

    def promote(self, chunk: ChunkKV, *, owner: str | None = None) -> list[int]:
        """Load a chunk that ``load`` found in a lower tier into fresh canonical blocks of the pool
        (resident, pinned if it was pinned); returns its blocks, held once for the caller. ``owner``: whose work
        it is (``DeviceTier.promote``)."""
        blocks = self.device.promote(chunk, owner=owner)
        if chunk.cache_id in self._pinned:
            self.device.pin(chunk.cache_id)
        return blocks

    def lower_can_fit(self, num_bytes: int, *, keep: Collection[str] = (), namespace: str = "") -> bool:
        """Whether a lower tier can take ``num_bytes`` more of ``namespace``'s without evicting pinned chunks, ``keep``
        or other namespaces' chunks within their share (no I/O)."""
        return any(t.can_fit(num_bytes, keep=keep, namespace=namespace) for t in self.lower)

    def resident(self, cache_id: str, *, readable: Mapping[str, bytes] | None = None) -> ChunkInfo | None:
        """The chunk's ``ChunkInfo`` if it is resident in the pool in one of the namespaces ``readable`` names
        (``None``: any; engine thread; counts a hit or a miss)."""
        return self.device.info(cache_id, readable=readable) if isinstance(cache_id, str) else None

    def describe(self, cache_id: str, *, readable: Mapping[str, bytes] | None = None) -> ChunkDescription:
        """What the tiers know of ``cache_id`` from metadata alone: no KV is read, nothing is promoted
        and no hit or miss is counted (a Redis-only chunk costs one small GET, not a download). With
        ``readable``, only a chunk of those namespaces is described (``namespace``: the name that reads it).

        Raises:
            UnknownCacheIdError: no tier holds it (as ``resolve``), or none of ``readable``'s namespaces'.
            StoreUnavailableError: Redis failed (``on_redis_error="raise"``).
        """
        held, failed = [], None
        for tier in self.tiers if isinstance(cache_id, str) else ():
            try:
                extent = tier.extent(cache_id, readable=readable)
            except StoreUnavailableError as exc:  # described by the tiers that answer, if any holds it
                failed = failed or exc
                continue
            if extent is not None:
                held.append((tier.name, extent))
        if not held:
            raise failed or self.unknown(cache_id)
        first = held[0][1]
        return ChunkDescription(
            cache_id=cache_id,
            tiers=tuple(name for name, _ in held),
            num_tokens=first.num_tokens,
            num_bytes=first.num_bytes,
            token_ids=first.token_ids,
            namespace=first.namespace,
        )

    def unknown(self, cache_id: object) -> UnknownCacheIdError:
        """The error for an id no tier holds (or none of the caller's namespaces'): the id cut to its first 32
        characters, as long as a cache id is (a caller's may be megabytes)."""
        failures = [t.last_error for t in self.tiers if t.last_error]
        return UnknownCacheIdError(
            f"unknown cache id {shown_id(cache_id)}{cache_id_hint(cache_id)}: "
            f"in no tier ({', '.join(t.name for t in self.tiers)}); "
            + (f"{'; '.join(failures)}; " if failures else "")
            + "compile its document first (an evicted chunk compiles again). Ids belong to one model and its compile "
            "options: an id that a server of another model returned is unknown here"
        )

    def load(self, cache_id: str, *, readable: Mapping[str, bytes] | None = None) -> ChunkKV | None:
        """The chunk from the first lower tier that has it (of one of ``readable``'s namespaces, by whose name its
        ``options.namespace`` is labelled), promoted into the lower tiers above that one (``None``: none has it).
        Any thread: the engine runs it on a loader.

        Raises:
            StoreUnavailableError: Redis failed (``on_redis_error="raise"``).
        """
        for level, tier in enumerate(self.lower):
            chunk = tier.get(cache_id, readable=readable)
            if chunk is not None:
                for upper in reversed(self.lower[:level]):
                    if upper.put(chunk):
                        chunk = upper.peek(cache_id) or chunk  # the copy nearest the device
                        if cache_id in self._pinned:
                            upper.pin(cache_id)
                return chunk
        return None

    def get(self, cache_id: str, *, readable: Mapping[str, bytes] | None = None) -> ChunkKV | None:
        """The chunk's KV from the fastest tier that holds it (a copy out of the pool for the device
        tier), on the engine's device, without promoting it; ``None`` when no tier does (of ``readable``'s
        namespaces)."""
        chunk = self.device.peek(cache_id, readable=readable)
        if chunk is None:
            found = (t.get(cache_id, readable=readable) for t in self.lower)
            chunk = next((c for c in found if c is not None), None)
        return None if chunk is None else chunk.to(self.device.kv_device)

    def contains(self, cache_id: str) -> bool:
        return any(tier.contains(cache_id) for tier in self.tiers)

    def lookup(self, cache_id: str) -> tuple[str, ...]:
        """Names of the tiers that hold ``cache_id``, fastest first (as ``CompileReport.tiers`` holds them)."""
        return tuple(tier.name for tier in self.tiers if tier.contains(cache_id))

    def pin(self, cache_id: str) -> None:
        """Never evict ``cache_id`` from the tiers that evict (the pool, the CPU tier), also once promoted
        into them.

        Raises:
            UnknownCacheIdError: no tier holds it.
        """
        if not self.contains(cache_id):
            raise UnknownCacheIdError(f"cannot pin unknown cache id {shown_id(cache_id)}")
        self._pinned.add(cache_id)
        for tier in self.tiers:
            tier.pin(cache_id)

    def unpin(self, cache_id: str) -> None:
        self._pinned.discard(cache_id)
        for tier in self.tiers:
            tier.unpin(cache_id)

    def expire(self, cache_id: str, *, readable: Mapping[str, bytes] | None = None) -> bool:
        """Remove ``cache_id`` from every tier (pinned or not); ``True`` if any held it. Live requests that link it
        keep its blocks until they are released. With ``readable``: only a chunk of one of those namespaces (one
        tier's metadata says so: ``describe``); any other answers ``False``, as an id nobody holds, and stays.

        The lowest tier goes first, and a tier that fails stops the removal there, whatever its ``on_*_error``
        says (under "miss" the delete would answer "deleted" and the chunk would be back once the tier is: a
        delete has no miss to fall back on). The tiers above the failed one still hold the chunk; the failed one
        may or may not (a command that timed out may still run when the server wakes): delete it again.

        Raises:
            StoreUnavailableError: a tier failed; the tiers above it still hold the chunk (or, with ``readable``,
                a tier failed while no other could say whose the chunk is).
        """
        if readable is not None:
            try:
                self.describe(cache_id, readable=readable)
            except UnknownCacheIdError:
                return False
        found = []
        for tier in reversed(self.tiers):
            found.append(tier.delete(cache_id))
            if failed_here(tier):
                raise StoreUnavailableError(
                    f"chunk {cache_id} could not be deleted from the {tier.name} tier ({tier.last_error}); the tiers "
                    f"above it still hold it, and it may still be there: delete it again once the tier works"
                )
        self._pinned.discard(cache_id)
        self._pool_only.discard(cache_id)
        self.backlog.forget(cache_id)
        return any(found)

    def ids(self) -> list[str]:
        """Every cache id in any tier."""
        return sorted({cid for tier in self.tiers for cid in tier.ids()})

    def stats(self) -> list[TierStats]:
        """One snapshot per tier, fastest first."""
        return [tier.stats() for tier in self.tiers]

    def view(self, device: Tier) -> TieredStore:
        """A store over the same lower tiers and pins whose device tier is ``device`` (one that runs its calls on
        the engine's thread): what other threads use, so their store I/O never runs on the engine's thread."""
        view = TieredStore(device, self.lower, recheck_s=None, pinned=self._pinned)  # type: ignore[arg-type]
        view.backlog = self.backlog  # an expire through the view stops the engine's retries of the chunk
        return view

    @property
    def fleet(self) -> FleetLeases | None:
        """Compile-once leases and fleet counters in the shared tier (``None`` without one)."""
        return self._shared[0][1] if self._shared else None


def lower_tiers(
    config: StoreConfig, *, expected: serde.Expected, pin: bool, store_shares: Mapping[str, float] | None = None
) -> list[LowerTier]:
    """The tiers below the pool that ``config`` names, fastest first (CPU, disk, Redis).

    Args:
        expected: what this model's chunks look like (entries that disagree are refused).
        pin: keep the CPU copies in page-locked memory (for a CUDA consumer).
        store_shares: namespace -> the share of the CPU tier's bytes its chunks keep (``Quota.store_share``).

    Raises:
        InvalidInputError: a CPU tier larger than this machine's physical memory (``check_cpu_tier``).
        StoreUnavailableError: an unreachable Redis (``on_redis_error="raise"``).
    """
    check_cpu_tier(config.cpu_bytes)
    lower: list[LowerTier] = []
    if config.cpu_bytes != 0:
        lower.append(LruTier(capacity_bytes=config.cpu_bytes, pin=pin, shares=store_shares))
    if config.disk_path is not None:
        disk = DiskTier(
            config.disk_path,
            expected=expected,
            capacity_bytes=config.disk_bytes,
            on_error=config.on_disk_error,
            part_bytes=config.part_bytes,
            pin=pin,
            retry_s=config.tier_retry_s,
            store_key=config.store_key,
        )
        lower.append(disk)
    if config.redis_url is not None:
        redis = RedisTier(
            config.redis_url,
            expected=expected,
            namespace=config.namespace,
            part_bytes=config.part_bytes,
            on_error=config.on_redis_error,
            timeout_s=config.redis_timeout_s,
            parts_ttl_s=config.redis_parts_ttl_s,
            pin=pin,
            read_from_replicas=config.redis_read_from_replicas,
            retry_s=config.tier_retry_s,
            store_key=config.store_key,
        )
        lower.append(redis)
    return lower
