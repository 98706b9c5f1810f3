"""Compile once across a fleet: a short-lived lease per chunk being compiled, kept in the shared Redis.

Workers that share a Redis tier would otherwise all prefill a popular new document at once. Before
compiling chunks no tier holds, a worker claims each one's lease (``SET lease NX PX``); it compiles the
chunks it claimed, renewing their leases from a background thread while the prefill runs, and releases
them once the chunks are written through (compare-and-delete: only its own). A chunk whose lease another
worker holds is waited on, polling with a bounded backoff, until the chunk lands in a tier (nothing to
compile) or the lease disappears without it (its holder died or failed: the lease expired or was
released), and is then claimed again. So a dead worker delays the others by at most its lease.

Leases cannot be abused to stall a worker (anyone who can write Redis could plant them):
- A lease lives at most ``lease_s``: the store sets it so (``SET NX PX``, renewed to the same life), and a lease
  found with no expiry (PTTL -1), with a longer one than ``lease_s``, or of another type than a string, is no live
  worker's: it is replaced by this worker's (one atomic script, logged) and the chunk compiled at once. Workers of
  one fleet must share ``redis_lease_s`` (a worker with a longer one has its leases taken over by the others: a
  duplicate prefill, never a wrong answer).
- A worker waits on others' leases at most ``WAIT_LEASES`` lease lives in one ``compile_once`` (a holder that keeps
  renewing a lease without ever landing the chunk is not waited on forever), then compiles the rest itself.
- At most ``MAX_WAITERS`` threads of a process wait on leases at once (``_WAITERS``): a compile that finds every
  slot taken does not wait but compiles itself. So leases can never hold more of a server's store threads than
  that, whatever is planted in Redis: the other threads answer ``GET /v1/chunks``, ``/metrics`` and compiles.

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
WAIT_LEASES = 3  # one compile_once waits on others' leases at most this many lease lives
MAX_WAITERS = 8  # threads of one process that may wait on leases at once; the others compile without waiting
_WAITERS = threading.BoundedSemaphore(MAX_WAITERS)

# Take the lease if it is free, or if what holds its name is no live worker's lease: no expiry (PTTL -1), a longer
# one than a lease lives (ARGV[3] ms), or a key of another type. Returns {taken, the PTTL found (-2: none), its
# type}. One key: atomic, and cluster-safe.
_ACQUIRE = """
local ttl = redis.call('pttl', KEYS[1])
local kind = redis.call('type', KEYS[1])['ok']
if ttl >= 0 and ttl <= tonumber(ARGV[3]) and kind == 'string' then return {0, ttl, kind} end
redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2])
return {1, ttl, kind}
"""

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
        max_wait_s: the longest one ``compile_once`` waits on others' leases before compiling anyway
            (``WAIT_LEASES`` lease lives).
        waiters: the process's slots for threads waiting on leases (``MAX_WAITERS``; shared by every instance).
    """

    waiters: threading.BoundedSemaphore = _WAITERS

    def __init__(self, client, *, namespace: str, fingerprint: str, lease_s: float = 10.0) -> None:
        # Apart from the chunks' own keys (``{namespace}:{fingerprint}:{id}:...``), so that deleting or
        # sweeping an entry's keys never sees them.
        self._client, self._prefix = client, f"{namespace}:fleet:{fingerprint}:"
        self.lease_ms = max(1, int(lease_s * 1000))
        self.max_wait_s = WAIT_LEASES * self.lease_ms / 1000
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
        would both wait out the leases, then both compile all. Waits only in one of the process's ``waiters``
        slots: with none free it compiles what others hold at once, as if there were no fleet.
        """
        pending = [cid for cid in dict.fromkeys(cache_ids) if not has_chunk(cid)]
        waited = Backoff(deadline=time.monotonic() + self.max_wait_s)
        slot: bool | None = None  # a waiter's slot: None not asked for yet, True held, False none was free
        try:
            while pending:
                if waited.expired:
                    force = f"waited {self.max_wait_s:.0f} s on other workers' leases"
                else:
                    force = f"{MAX_WAITERS} threads wait on leases already" if slot is False else None
                mine, pending = self._claim(pending, has_chunk=has_chunk, force=force)
                if mine:
                    with self._held(mine):
                        self._record_compiles(compile(mine))
                if pending:
                    if slot is None:
                        slot = self.waiters.acquire(blocking=False)
                        if not slot:
                            continue  # no wait: the next round compiles them
                    waited.sleep()
        finally:
            if slot:
                self.waiters.release()

    def _lease(self, cache_id: str) -> str:
        return f"{self._prefix}lease:{cache_id}"

    def _claim(
        self, cache_ids: list[str], *, has_chunk: Callable[[str], bool], force: str | None = None
    ) -> tuple[list[str], list[str]]:
        """Without waiting: the ids whose leases this worker took (it must compile them) and the ids other
        workers hold leases on (wait, then ask again); ids that landed in a tier are neither. ``force`` (why
        this worker does not wait: it waited too long, or no waiter's slot is free) takes every id, those whose
        leases others hold too, as if there were no fleet (logged)."""
        mine, others = [], []
        for cache_id in cache_ids:
            if has_chunk(cache_id):
                continue
            if self._try(lambda c=cache_id: self._acquire(c)):
                mine.append(cache_id)
            else:
                others.append(cache_id)
        if force and others:
            log.warning("pic: %s; compiling %d leased chunk(s) anyway", force, len(others))
            mine, others = mine + others, []
        return mine, others

    def _acquire(self, cache_id: str) -> bool:
        """Take ``cache_id``'s lease unless a live worker holds it: one that is free, or an illegitimate one (no
        expiry, a longer one than a lease's life, not a string: planted, or left by a broken writer), which is
        replaced, logged."""
        key = self._lease(cache_id)
        took, ttl, kind = self._client.eval(_ACQUIRE, 1, key, self.token, self.lease_ms, self.lease_ms)
        if took and ttl != -2:
            kind = kind.decode(errors="replace") if isinstance(kind, bytes) else str(kind)
            why = "no expiry" if ttl == -1 else f"{ttl} ms to live (a lease lives {self.lease_ms})"
            log.warning("pic: replaced the lease on %s, which no live worker holds (a %s, %s)", cache_id[:32], kind,
                        why)  # fmt: skip
        return bool(took)

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
