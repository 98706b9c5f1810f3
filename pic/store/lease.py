"""Compile once across a fleet: a short-lived lease per chunk being compiled, kept in the shared Redis.

Workers that share a Redis tier would otherwise all prefill a popular new document at once. Before
compiling chunks no tier holds, a worker claims each one's lease (``SET lease NX PX``); it compiles the
chunks it claimed, renewing their leases from a background thread while the prefill runs, and releases
them once the chunks are written through (compare-and-delete: only its own). A chunk whose lease another
worker holds is waited on, polling with a bounded backoff, until the chunk lands in a tier (nothing to
compile) or the lease disappears without it (its holder died or failed: the lease expired or was
released), and is then claimed again. So a dead worker delays the others by at most its lease.

Every prefill is counted fleet-wide, and a prefill of a chunk that some worker compiled in the hour
before (its ``compiled`` marker, which expires after an hour, exists) counts as a duplicate. Redis
failing is never fatal here: the worker then compiles on its own, as it would without a fleet.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import redis

log = logging.getLogger("pic.store")
_MARKER_MS = 3600 * 1000  # a compile within an hour of the chunk's previous one is a duplicate

# Delete the lease only if this worker still holds it (a lease that expired may be someone else's now).
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"
_RENEW = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end"
)


@dataclass(frozen=True)
class FleetStats:
    """Fleet-wide counters in the shared Redis: prefills of new chunks, and those of chunks that some
    worker had already compiled (what the leases exist to prevent)."""

    num_compiles: int
    num_duplicate_compiles: int


@dataclass
class Backoff:
    """Sleeps of 10 ms doubling to 200 ms, until ``deadline`` (then ``expired``)."""

    deadline: float
    delay: float = 0.01

    @property
    def expired(self) -> bool:
        return time.monotonic() > self.deadline

    def sleep(self) -> None:
        time.sleep(self.delay)
        self.delay = min(2 * self.delay, 0.2)


class FleetLeases:
    """Leases and counters of one model's chunks in a shared Redis.

    Args:
        client: the Redis tier's client (single node, cluster or sentinel: every command is single-key).
        namespace, fingerprint: the Redis tier's; leases and counters live under
            ``{namespace}:fleet:{fingerprint}:``.
        lease_s: how long a lease lives without renewal (a dead worker's chunks wait at most this).

    Attributes:
        max_wait_s: the longest a worker waits on others' leases before compiling anyway.
    """

    max_wait_s: float = 300.0

    def __init__(self, client, *, namespace: str, fingerprint: str, lease_s: float = 10.0) -> None:
        # Apart from the chunks' own keys (``{namespace}:{fingerprint}:{id}:...``), so that deleting or
        # sweeping an entry's keys never sees them.
        self._client, self._prefix = client, f"{namespace}:fleet:{fingerprint}:"
        self.lease_ms = max(1, int(lease_s * 1000))
        self.token = uuid.uuid4().hex  # this worker's name on its leases

    def compile_once(
        self,
        cache_ids: Sequence[str],
        *,
        has_chunk: Callable[[str], bool],
        compile: Callable[[list[str]], Sequence[str]],
    ) -> None:
        """Have ``cache_ids`` compiled, each by one worker of the fleet: ``compile`` (called with the ids
        whose leases this worker took, while it holds them; returns the ids it prefilled) runs here for
        some, other workers' compiles land the rest. Returns once ``has_chunk`` holds for every id, or
        after ``max_wait_s`` of waiting, having compiled the stragglers itself.

        Never waits while holding leases: two workers each holding half and waiting on the other's half
        would both wait out the leases, then both compile all.
        """
        pending = [cid for cid in dict.fromkeys(cache_ids) if not has_chunk(cid)]
        waited = Backoff(deadline=time.monotonic() + self.max_wait_s)
        while pending:
            mine, pending = self._claim(pending, has_chunk=has_chunk, force=waited.expired)
            if mine:
                with self._held(mine):
                    self._record_compiles(compile(mine))
            if pending:
                waited.sleep()

    def _lease(self, cache_id: str) -> str:
        return f"{self._prefix}lease:{cache_id}"

    def _claim(
        self, cache_ids: list[str], *, has_chunk: Callable[[str], bool], force: bool = False
    ) -> tuple[list[str], list[str]]:
        """Without waiting: the ids whose leases this worker took (it must compile them) and the ids other
        workers hold leases on (wait, then ask again); ids that landed in a tier are neither. ``force``
        (waited too long) takes every id, as if there were no fleet."""
        mine, others = [], []
        for cache_id in cache_ids:
            if has_chunk(cache_id):
                continue
            if force or self._try(lambda c=cache_id: self._acquire(c)):
                mine.append(cache_id)
            else:
                others.append(cache_id)
        if force and mine:
            log.warning("pic: waited %.0f s on other workers' leases; compiling %d chunks anyway", self.max_wait_s,
                        len(mine))  # fmt: skip
        return mine, others

    def _acquire(self, cache_id: str) -> bool:
        return bool(self._client.set(self._lease(cache_id), self.token, nx=True, px=self.lease_ms))

    def _try(self, command: Callable[[], object]) -> bool:
        """Run a lease command; with Redis down, act as if there were no fleet (the lease is ours)."""
        try:
            return bool(command())
        except redis.RedisError as exc:  # (a refusal of the tier's open breaker repeats a failure logged already)
            level = logging.DEBUG if getattr(exc, "not_tried", False) else logging.WARNING
            log.log(level, "pic: fleet lease unavailable (%s: %s); compiling without one", type(exc).__name__, exc)
            return True

    @contextlib.contextmanager
    def _held(self, cache_ids: list[str]) -> Iterator[None]:
        """Keep ``cache_ids``' leases alive while the block runs (a thread renews them every third of a
        lease), then release them."""
        stop = threading.Event()
        renewer = threading.Thread(target=self._renew_until, args=(cache_ids, stop), daemon=True)
        if cache_ids:
            renewer.start()
        try:
            yield
        finally:
            stop.set()
            if cache_ids:
                renewer.join()
            for cache_id in cache_ids:
                self._try(lambda c=cache_id: self._client.eval(_RELEASE, 1, self._lease(c), self.token))

    def _renew_until(self, cache_ids: list[str], stop: threading.Event) -> None:
        while not stop.wait(self.lease_ms / 3000):
            for cache_id in cache_ids:
                self._try(lambda c=cache_id: self._client.eval(_RENEW, 1, self._lease(c), self.token, self.lease_ms))

    def _record_compiles(self, cache_ids: Sequence[str]) -> None:
        """Count this worker's prefills of ``cache_ids`` fleet-wide (a chunk marked compiled before is a
        duplicate)."""
        for cache_id in cache_ids:
            try:
                first = self._client.set(f"{self._prefix}compiled:{cache_id}", 1, nx=True, px=_MARKER_MS)
                self._client.incr(f"{self._prefix}compiles")
                if not first:
                    self._client.incr(f"{self._prefix}duplicate_compiles")
            except redis.RedisError as exc:
                level = logging.DEBUG if getattr(exc, "not_tried", False) else logging.WARNING
                log.log(level, "pic: fleet counters unavailable (%s: %s)", type(exc).__name__, exc)
                return

    def stats(self) -> FleetStats:
        values = [self._client.get(f"{self._prefix}{name}") for name in ("compiles", "duplicate_compiles")]
        return FleetStats(*(int(v or 0) for v in values))
