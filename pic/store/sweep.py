"""Find and remove what a Redis tier should not hold: orphan parts, broken entries, other models' chunks.

The write protocol (``RedisTier.put``) leaves no orphan that outlives ``redis_parts_ttl_s``, but keys
written before it, metadata evicted under ``maxmemory`` with an ``allkeys-*`` policy, or the chunks of
a model no longer served stay until something removes them: ``pic store sweep``.

Only keys of the tier's form (``{namespace}:{fingerprint}:{cache id}:meta`` / ``...:part:{i}``) are
looked at; anything else under the namespace (fleet leases, counters) is left alone. Keys are found
with SCAN (never KEYS, which blocks the server) and deleted one key per command in a pipeline, so the
sweep also runs against a Redis Cluster.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

import msgpack
import redis

from pic.errors import StoreUnavailableError
from pic.redis_url import redact
from pic.store.redis_client import connect

_BATCH = 512


@dataclass(frozen=True)
class SweepReport:
    """What a sweep found (and removed).

    Attributes:
        entries: entries with metadata whose parts are all present (any fingerprint).
        orphan_parts: parts without metadata and without a TTL (a write in flight has one), plus the
            keys of broken entries (metadata whose parts are missing: evicted or expired).
        broken_entries: entries whose metadata is unreadable or whose parts are missing.
        entries_of_other_models: complete entries of fingerprints other than the given one.
        removed_keys: keys deleted (only with ``remove=True``).
        fingerprints: entries per fingerprint.
    """

    entries: int
    orphan_parts: int
    broken_entries: int
    entries_of_other_models: int
    removed_keys: int
    fingerprints: dict[str, int] = field(default_factory=dict)

    def render(self) -> str:
        """Lines for a terminal."""
        lines = [
            f"entries: {self.entries}",
            f"orphan parts: {self.orphan_parts}",
            f"broken entries: {self.broken_entries}",
            f"entries of other models: {self.entries_of_other_models}",
            f"removed keys: {self.removed_keys}",
        ]
        lines += [f"  fingerprint {fp}: {n} entries" for fp, n in sorted(self.fingerprints.items())]
        return "\n".join(lines)


@dataclass
class _Entry:
    meta: str | None = None
    parts: dict[int, str] = field(default_factory=dict)


def sweep(
    client_or_url: redis.Redis | str,
    *,
    namespace: str = "pic",
    fingerprint: str | None = None,
    remove: bool = False,
    other_models: bool = False,
) -> SweepReport:
    """Scan ``{namespace}:*`` and report; with ``remove``, delete orphans and broken entries (and, with
    ``other_models``, every entry whose fingerprint is not ``fingerprint``).

    Raises:
        ValueError: ``other_models`` without a ``fingerprint`` (which models are "other" is unknown).
        StoreUnavailableError: Redis failed (named with its password masked).
    """
    if other_models and fingerprint is None:
        raise ValueError("other_models needs the fingerprint of the model to keep")
    client = connect(client_or_url, timeout_s=30.0) if isinstance(client_or_url, str) else client_or_url
    try:
        return _sweep(client, namespace, fingerprint, remove=remove, other_models=other_models)
    except redis.RedisError as exc:
        where = redact(client_or_url) if isinstance(client_or_url, str) else "the given client"
        raise StoreUnavailableError(f"Redis at {where} failed: {type(exc).__name__}: {exc}") from exc


def _sweep(
    client: redis.Redis, namespace: str, fingerprint: str | None, *, remove: bool, other_models: bool
) -> SweepReport:
    entries = _scan(client, namespace)
    orphans, broken, foreign, complete = [], [], [], []
    per_fp: dict[str, int] = defaultdict(int)
    no_meta = [(key, e) for key, e in entries.items() if e.meta is None]
    ttls = _pttls(client, [k for _, e in no_meta for k in e.parts.values()])
    for _, e in no_meta:
        orphans += [k for k in e.parts.values() if ttls[k] == -1]  # -1: no TTL; >= 0: a write in flight
    with_meta = [(key, e) for key, e in entries.items() if e.meta is not None]
    counts = _num_parts(client, [e.meta for _, e in with_meta])
    for (fp, _), e in with_meta:
        n = counts[e.meta]
        if n is None or any(i not in e.parts for i in range(n)):
            broken.append(e)
            continue
        complete.append(e)
        per_fp[fp] += 1
        if fingerprint is not None and fp != fingerprint:
            foreign.append(e)
    removed = 0
    if remove:
        doomed = orphans + [k for e in broken for k in _keys(e)]
        doomed += [k for e in foreign for k in _keys(e)] if other_models else []
        removed = _delete(client, doomed)
    return SweepReport(
        entries=len(complete),
        orphan_parts=len(orphans) + sum(len(e.parts) for e in broken),
        broken_entries=len(broken),
        entries_of_other_models=len(foreign),
        removed_keys=removed,
        fingerprints=dict(per_fp),
    )


def _scan(client: redis.Redis, namespace: str) -> dict[tuple[str, str], _Entry]:
    """The tier's keys under ``namespace``, grouped by (fingerprint, cache id)."""
    pattern = re.compile(rf"^{re.escape(namespace)}:([^:]+):([^:]+):(?:(meta)|part:(\d+))$")
    entries: dict[tuple[str, str], _Entry] = defaultdict(_Entry)
    glob = re.sub(r"([*?\[\]\\])", r"\\\1", namespace) + ":*"
    for raw in client.scan_iter(match=glob, count=1000):
        key = raw.decode(errors="replace")
        found = pattern.match(key)
        if found is None:
            continue  # leases, counters, anything not ours
        fp, cache_id, meta, part = found.groups()
        entry = entries[(fp, cache_id)]
        if meta:
            entry.meta = key
        else:
            entry.parts[int(part)] = key
    return entries


def _pttls(client: redis.Redis, keys: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for start in range(0, len(keys), _BATCH):
        pipe = client.pipeline(transaction=False)
        batch = keys[start : start + _BATCH]
        for key in batch:
            pipe.pttl(key)
        out.update(zip(batch, pipe.execute(), strict=True))
    return out


def _num_parts(client: redis.Redis, meta_keys: list[str]) -> dict[str, int | None]:
    """Each metadata record's ``num_parts`` (``None``: gone, unreadable, or a key of another type). Bounded unpacking:
    only the count is needed, and the record is not trusted."""
    out: dict[str, int | None] = {}
    for start in range(0, len(meta_keys), _BATCH):
        pipe = client.pipeline(transaction=False)
        batch = meta_keys[start : start + _BATCH]
        for key in batch:
            pipe.get(key)
        for key, raw in zip(batch, pipe.execute(raise_on_error=False), strict=True):
            if isinstance(raw, redis.ResponseError) and not str(raw).startswith("WRONGTYPE"):
                raise raw  # (a key of another type is a broken entry; any other error reply, a failing Redis)
            try:
                n = msgpack.unpackb(raw, raw=False, max_bin_len=0, max_ext_len=0).get("num_parts")
            except Exception:  # garbage of any kind, a key of another type: a broken entry
                n = None
            out[key] = n if isinstance(n, int) and 0 < n < 2**20 else None
    return out


def _keys(entry: _Entry) -> list[str]:
    return ([entry.meta] if entry.meta else []) + list(entry.parts.values())


def _delete(client: redis.Redis, keys: list[str]) -> int:
    removed = 0
    for start in range(0, len(keys), _BATCH):
        pipe = client.pipeline(transaction=False)
        for key in keys[start : start + _BATCH]:
            pipe.delete(key)
        removed += sum(pipe.execute())
    return removed
