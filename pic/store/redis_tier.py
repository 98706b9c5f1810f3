"""The Redis tier: chunks shared by a fleet of workers, in the wire format of ``pic.store.serde``.

Keys are ``{namespace}:{model fingerprint}:{cache id}:meta`` and ``...:part:{i}``, so two models never
read each other's chunks. A damaged, foreign or unknown-format entry is logged, deleted and treated
as a miss: it can cost a recompile, never a wrong answer. So is one that fails the fleet's store key
(``pic.store.auth``: forged, altered, or written without the key), and a key of another type (a hash where a
chunk's metadata belongs). An entry that is whole but belongs to none of the reader's namespaces (``readable``)
is a plain miss: not logged above DEBUG, not counted as an error, not deleted (it may be another tenant's).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Collection, Mapping
from typing import Literal, TypeVar

import redis

from pic.errors import StoreUnavailableError
from pic.kv import ChunkKV
from pic.redis_url import redact
from pic.store import serde
from pic.store.auth import store_key as as_store_key
from pic.store.breaker import Breaker
from pic.store.guard import FailureGuard
from pic.store.lease import FleetLeases
from pic.store.redis_client import BreakingClient, connect
from pic.store.tier import Extent, TierStats

log = logging.getLogger("pic.store")
_DROP_BATCH = 64
_T = TypeVar("_T")


def _wrong_type(exc: BaseException) -> bool:
    """Whether a reply error says the key holds another type (``WRONGTYPE``): a damaged entry, not a failing Redis."""
    return isinstance(exc, redis.ResponseError) and str(exc).startswith("WRONGTYPE")


def _typed(call: Callable[[], _T], what: str) -> _T:
    """``call()``, with a ``WRONGTYPE`` reply as the ``CorruptEntryError`` it is (``what``: the key's role)."""
    try:
        return call()
    except redis.ResponseError as exc:
        if _wrong_type(exc):
            raise serde.CorruptEntryError(f"a key of another type where {what} belongs") from None
        raise


class RedisTier:
    """A Redis (or Redis-compatible) server as a chunk tier.

    Args:
        url: ``redis://[[user]:password@]host:port/db``, ``rediss://...``, ``unix:///path.sock``,
            ``redis-cluster://[:password@]host:port[,host:port...]`` or
            ``redis-sentinel://[:password@]host:port[,host:port...]/service_name`` (``pic.redis_url``).
        expected: what this engine's chunks look like (fingerprint, shape, dtype).
        on_error: ``"raise"``: an unreachable server raises ``StoreUnavailableError`` naming the URL;
            ``"miss"``: it is logged, counted and treated as a miss (``put`` then stores nothing).
        pin: decode chunks into page-locked memory.
        parts_ttl_s: a part's time to live until its entry's metadata is written (then it persists):
            what an interrupted write leaves behind expires after it. Longer than writing one chunk.
        read_from_replicas: a cluster or sentinel setup also reads from replicas (which may lag: a
            fresh chunk can read as a miss there, never as a wrong one).
        retry_s: after a command times out or cannot connect, every command fails at once for this long
            (a ``Breaker``: the tier's calls, the fleet's leases and the monitoring alike), then one is tried.
        store_key: the fleet's store key (``StoreConfig.store_key``): entries are written with its MACs and read
            only when they carry them; ``None``: no MAC written or checked.

    Every command touches one key (no MGET or multi-key DEL), so the tier works on a Redis Cluster:
    a chunk's metadata and parts hash to different slots, which spreads a hot chunk over the nodes.
    """

    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        expected: serde.Expected,
        namespace: str = "pic",
        part_bytes: int = 8 * 2**20,
        on_error: Literal["raise", "miss"] = "raise",
        timeout_s: float = 10.0,
        pin: bool = False,
        parts_ttl_s: float = 60.0,
        read_from_replicas: bool = False,
        retry_s: float = 5.0,
        store_key: bytes | None = None,
    ) -> None:
        self.url = redact(url)
        self.breaker = Breaker(f"Redis at {self.url}", retry_s=retry_s)
        client = connect(url, timeout_s=timeout_s, read_from_replicas=read_from_replicas)
        self._client = BreakingClient(client, self.breaker)
        self._expected, self.part_bytes, self._on_error, self._pin = expected, part_bytes, on_error, pin
        self.namespace, self.fingerprint = namespace, expected.fingerprint
        self._prefix = f"{namespace}:{expected.fingerprint}:"
        self._stats = TierStats(name=self.name)
        self._last_error: str | None = None
        self._parts_ttl_ms = max(1, round(parts_ttl_s * 1000))  # parts expire unless their metadata lands
        self._store_key = as_store_key(store_key)

    @property
    def last_error(self) -> str | None:
        """Why the latest call failed (the URL masked), for error messages upstream; ``None`` if it did not."""
        return self._last_error

    def _key(self, cache_id: str, part: int | None = None) -> str:
        return f"{self._prefix}{cache_id}:meta" if part is None else f"{self._prefix}{cache_id}:part:{part}"

    def get(self, cache_id: str, *, readable: Mapping[str, bytes] | None = None) -> ChunkKV | None:
        """The chunk, or ``None``: a miss, also for an entry none of ``readable``'s namespaces (name -> salt)
        reproduces (``None``: any namespace's, as before tenants). A damaged or forged entry is logged, counted as
        an error and deleted."""
        with self._guard():
            try:
                raw = self._get_meta(cache_id)
                if raw is None:
                    self._stats.misses += 1
                    return None
                meta = self._parse(raw, cache_id, readable)
                self._check_part_sizes(cache_id, meta)  # before reading (allocating) any of them
                # one GET per part, decoded as it arrives: redis-py reads a few MiB per reply far faster
                # than one huge MGET reply, and only one part is held at a time
                parts = (self._get_part(cache_id, i) for i in range(meta.num_parts))
                chunk = serde.decode(meta, parts, pin=self._pin, key=self._store_key)
            except serde.NotReadable:
                self._stats.misses += 1  # as an id nobody stored
                return None
            except serde.CorruptEntryError as exc:
                self._stats.misses += 1
                self._refuse(cache_id, exc)
                return None
            self._stats.hits += 1
            return chunk
        return None  # the server failed and on_error == "miss"

    def extent(self, cache_id: str, *, readable: Mapping[str, bytes] | None = None) -> Extent | None:
        """The chunk's size from its metadata record alone (one GET of a few bytes per token; no part is
        read), its MAC checked when there is a store key. A forged record is dropped (as by ``get``); a damaged
        one is a miss here, left for ``get`` to drop; one of another namespace is a plain miss."""
        with self._guard():
            try:
                raw = self._get_meta(cache_id)
                if raw is None:
                    return None
                meta = self._parse(raw, cache_id, readable)
            except serde.NotReadable:
                return None
            except serde.ForgedEntryError as exc:
                self._refuse(cache_id, exc)
                return None
            except serde.CorruptEntryError:
                return None
            return Extent(len(meta.token_ids), 2 * meta.tensor_bytes, meta.token_ids, meta.options.namespace)
        return None  # the server failed and on_error == "miss"

    def _get_meta(self, cache_id: str) -> bytes | None:
        return _typed(lambda: self._client.get(self._key(cache_id)), "a chunk's metadata")

    def _parse(self, raw: bytes, cache_id: str, readable: Mapping[str, bytes] | None) -> serde.Meta:
        """Raises: as ``serde.parse_meta`` (a miss logged at DEBUG for ``NotReadable``)."""
        try:
            return serde.parse_meta(
                raw, cache_id=cache_id, expected=self._expected, readable=readable, key=self._store_key
            )
        except serde.NotReadable:
            log.debug("pic: Redis entry %s is no namespace's the caller reads: a miss", cache_id[:32])
            raise

    def _refuse(self, cache_id: str, exc: serde.CorruptEntryError) -> None:
        """Log, count and drop an entry that failed its checks (the id cut: a caller's may be megabytes)."""
        log.warning("pic: dropping Redis entry %s at %s: %s", cache_id[:32], self.url, exc)
        self._stats.errors += 1
        self._drop(cache_id)

    def peek(self, cache_id: str) -> ChunkKV | None:
        """``None``: the chunk is on the server, and reading it is a download (``get``)."""
        return None

    def _check_part_sizes(self, cache_id: str, meta: serde.Meta) -> None:
        """Raise ``CorruptEntryError`` unless every part is there with its exact size. A missing part
        (STRLEN 0: Redis evicts keys independently, and an interrupted write's parts expire) is named as
        such, so the log tells eviction from damage."""
        pipe = self._client.pipeline(transaction=False)
        for i in range(meta.num_parts):
            pipe.strlen(self._key(cache_id, i))
        found, expected = pipe.execute(raise_on_error=False), serde.part_sizes(meta)
        for reply in found:
            if isinstance(reply, Exception):
                if _wrong_type(reply):
                    raise serde.CorruptEntryError("a key of another type where a chunk's part belongs")
                raise reply
        missing = [i for i, size in enumerate(found) if size == 0]
        if missing:
            raise serde.CorruptEntryError(f"evicted/expired part(s) {missing[:8]} of {meta.num_parts}")
        if found != expected:
            raise serde.CorruptEntryError(f"stored part sizes {found} differ from the expected {expected}")

    def _get_part(self, cache_id: str, index: int) -> bytes:
        """One part; one that vanished since the size check (evicted or expired meanwhile) is a miss."""
        part = _typed(lambda: self._client.get(self._key(cache_id, index)), "a chunk's part")
        if part is None:
            raise serde.CorruptEntryError(f"evicted/expired part {index} (gone while reading)")
        return part

    def put(self, chunk: ChunkKV, *, keep: Collection[str] = ()) -> bool:
        """Write ``chunk`` (``keep`` is for the bounded tiers: Redis evicts by its own policy).

        No orphans: the parts are written with a TTL, the metadata after them, and only then are the
        parts made persistent. A writer that dies before the metadata leaves parts that expire; one that
        dies before the PERSISTs leaves metadata whose parts expire, which the first reader finds
        incomplete, counts as a miss and deletes. A part that already expired (a write slower than the
        TTL, or an eviction) drops the entry: ``False``, nothing half-written stays behind."""
        encoded = serde.encode(
            chunk, fingerprint=self._expected.fingerprint, part_bytes=self.part_bytes, key=self._store_key
        )
        with self._guard():
            pipe = self._client.pipeline(transaction=False)
            for i, part in enumerate(encoded.parts):
                pipe.set(self._key(chunk.cache_id, i), part, px=self._parts_ttl_ms)
            pipe.execute()
            self._client.set(self._key(chunk.cache_id), encoded.meta)  # metadata last: parts are all there
            if not self._persist_parts(chunk.cache_id, len(encoded.parts)):
                log.warning("pic: a part of %s was evicted or expired before its metadata; not stored", chunk.cache_id)
                self._drop(chunk.cache_id)
                return False
            return True
        return False

    def _persist_parts(self, cache_id: str, num_parts: int) -> bool:
        """Clear the parts' TTLs (one pipeline of single-key commands, cluster-safe); ``False`` when a
        part is gone. PERSIST answers 0 for a key without a TTL too (a concurrent writer of the same
        chunk persisted it first), so presence is checked with EXISTS."""
        pipe = self._client.pipeline(transaction=False)
        for i in range(num_parts):
            pipe.persist(self._key(cache_id, i))
            pipe.exists(self._key(cache_id, i))
        return all(pipe.execute()[1::2])

    def can_fit(self, num_bytes: int, *, keep: Collection[str] = (), namespace: str = "") -> bool:
        """Always: Redis bounds its memory with its own eviction policy, not by pic's accounting."""
        return True

    def contains(self, cache_id: str) -> bool:
        with self._guard():
            return bool(self._client.exists(self._key(cache_id)))
        return False

    def delete(self, cache_id: str) -> bool:
        with self._guard():
            return self._drop(cache_id)
        return False

    def _drop(self, cache_id: str) -> bool:
        """Delete the metadata first (readers stop seeing the entry), then parts 0, 1, ... until a
        batch finds none (parts are written densely, so a damaged entry's count is not needed). One DEL
        per key in a pipeline: a multi-key DEL fails with CROSSSLOT on a cluster, whose pipeline routes
        each command to its node."""
        existed = bool(self._client.delete(self._key(cache_id)))
        start = 0
        while True:
            pipe = self._client.pipeline(transaction=False)
            for i in range(start, start + _DROP_BATCH):
                pipe.delete(self._key(cache_id, i))
            if not any(pipe.execute()):
                return existed
            start += _DROP_BATCH

    def pin(self, cache_id: str) -> bool:
        """``False``: Redis evicts by its own policy, which pic cannot steer."""
        return False

    def unpin(self, cache_id: str) -> None:
        """Nothing to undo (see ``pin``)."""

    def leases(self, lease_s: float) -> FleetLeases:
        """Compile-once leases and fleet counters beside this tier's chunks (see ``pic.store.lease``)."""
        return FleetLeases(self._client, namespace=self.namespace, fingerprint=self.fingerprint, lease_s=lease_s)

    def ids(self) -> list[str]:
        """Ids with metadata on the server (a cluster client scans every master)."""
        with self._guard():
            return self._scan_ids()
        return []

    def _scan_ids(self) -> list[str]:
        keys = self._client.scan_iter(match=_glob(self._prefix) + "*:meta", count=1000)
        return sorted(k.decode(errors="replace")[len(self._prefix) : -len(":meta")] for k in keys)

    def stats(self) -> TierStats:
        """This process's counters, with the entries and bytes found on the server (a scan). Never raises:
        monitoring needs it most while Redis is down (``up=False`` then, whatever ``on_error`` says; at once
        while the breaker is open)."""
        stats = dataclasses.replace(self._stats)
        try:
            self._count_entries(stats)
        except StoreUnavailableError:  # counted and remembered (last_error) by the guard
            return dataclasses.replace(self._stats, up=False, writable=False)
        return stats

    def _count_entries(self, stats: TierStats) -> None:
        """Count the whole entries on the server (every namespace's). What is not one is skipped, never a failure
        of the tier: a damaged, forged or vanished record, a key of another type (``WRONGTYPE``) where a record
        belongs."""
        with self._guard(always_raise=True):
            ids = self._scan_ids()
            pipe = self._client.pipeline(transaction=False)  # one GET per key: MGET is CROSSSLOT on a cluster
            for cache_id in ids:
                pipe.get(self._key(cache_id))
            replies = pipe.execute(raise_on_error=False) if ids else []
            for reply in replies:
                if isinstance(reply, Exception) and not _wrong_type(reply):
                    raise reply
            for cache_id, raw in zip(ids, replies, strict=True):
                num_bytes = self._entry_bytes(cache_id, raw)
                if num_bytes is not None:
                    stats.num_entries += 1
                    stats.num_bytes += num_bytes

    def _entry_bytes(self, cache_id: str, raw: object) -> int | None:
        """The KV bytes of a whole entry's record ``raw`` (any namespace's); ``None`` for anything else."""
        if not isinstance(raw, bytes):
            return None
        try:
            meta = serde.parse_meta(raw, cache_id=cache_id, expected=self._expected, key=self._store_key)
        except serde.NotReadable as exc:  # a salted namespace's: whole, and counted
            return 2 * exc.meta.tensor_bytes
        except serde.CorruptEntryError:
            return None
        return 2 * meta.tensor_bytes

    def _guard(self, *, always_raise: bool = False) -> FailureGuard:
        return FailureGuard(self, redis.RedisError, on_error=self._on_error, always_raise=always_raise)

    def _failed(self, exc: BaseException) -> str:
        self._stats.errors += 1
        return f"Redis at {self.url} failed: {type(exc).__name__}: {exc}"


def _glob(text: str) -> str:
    """``text`` with Redis glob characters escaped."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)
