"""``WriteBacklog``: chunks a lower tier failed to take, to write to it once it works again.

Under ``on_redis_error`` / ``on_disk_error="miss"`` a failing tier is skipped, not fatal: a compile answers with
its chunks in the tiers that took them (``CompileReport.tiers``). Without a backlog those chunks would never
reach the failed tier, even after it came back (a disk that was full, a Redis that restarted), and a restart
would lose every one of them. The backlog remembers, per chunk, the tiers that failed to take it; the engine
retries them from the pool's copy (``Loader.retry_writes``), a few chunks at a time and no more often than
the tiers' breakers would let a call through, and forgets a chunk once every tier took it, or once the pool
evicted it (then only compiling it again stores it there: the log says so).

No I/O here: ``TieredStore.write_lower`` reports each write's outcome (any thread), the engine thread asks what
is due. A lock guards the state.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection

log = logging.getLogger("pic.store")

# Chunks retried at once: each is a copy out of the pool (tens of MB for a long chunk of a small model), so a
# long outage's backlog drains a few at a time rather than copying every chunk at once.
_BATCH = 4


class WriteBacklog:
    """The chunks whose writes a lower tier failed, and when to try them again (thread-safe).

    Args:
        retry_s: after a retry fails, the next waits this long (``StoreConfig.tier_retry_s``).
        clock: seconds, monotonic.
    """

    def __init__(self, retry_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.retry_s, self._clock = retry_s, clock
        self._lock = threading.Lock()
        self._failed: OrderedDict[str, set[str]] = OrderedDict()  # cache id -> tiers that failed to take it
        self._in_flight: set[str] = set()
        self._next_at = 0.0

    def __len__(self) -> int:
        with self._lock:
            return len(self._failed)

    def record(self, cache_id: str, *, took: Collection[str], failed: Collection[str]) -> None:
        """A write of ``cache_id`` ended: ``took`` holds it now, ``failed`` failed to take it (any thread)."""
        with self._lock:
            was_retry = cache_id in self._in_flight
            self._in_flight.discard(cache_id)
            tiers = (self._failed.pop(cache_id, set()) - set(took)) | set(failed)
            if tiers:
                self._failed[cache_id] = tiers
            if failed:
                self._next_at = self._clock() + self.retry_s
            elif was_retry:
                self._next_at = 0.0  # a retry worked: the next ones may go at once

    def errored(self, cache_id: str) -> None:
        """A write of ``cache_id`` raised instead of ending (a tier under ``"raise"``, say): it stays due, after
        ``retry_s``."""
        with self._lock:
            self._in_flight.discard(cache_id)
            if cache_id in self._failed:
                self._next_at = self._clock() + self.retry_s

    def due(self) -> list[str]:
        """The chunks to retry now (engine thread), at most ``_BATCH``, none while earlier retries are under way
        or within ``retry_s`` of a failure; they count as under way until ``record``ed."""
        with self._lock:
            if self._in_flight or not self._failed or self._clock() < self._next_at:
                return []
            ids = list(self._failed)[:_BATCH]
            self._in_flight.update(ids)
            return ids

    def next_due_s(self) -> float | None:
        """Seconds until ``due`` may return something (``None``: nothing to retry, or a retry is under way)."""
        with self._lock:
            if self._in_flight or not self._failed:
                return None
            return max(0.0, self._next_at - self._clock())

    def forget(self, cache_id: str, *, evicted: bool = False) -> None:
        """Stop retrying ``cache_id`` (expired; ``evicted``: the pool no longer has a copy to write, logged)."""
        with self._lock:
            tiers = self._failed.pop(cache_id, None)
            self._in_flight.discard(cache_id)
        if evicted and tiers:
            log.warning(
                "pic: chunk %s left the KV pool before the %s tier(s) could take it; compile its document again to "
                "store it there", cache_id, ", ".join(sorted(tiers)),
            )  # fmt: skip
