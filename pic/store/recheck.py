"""When a link of a resident chunk should check that the shared tier (Redis) still holds it.

Redis can lose chunks a worker still has resident: a restart without persistence, or chunks compiled
while it was down under ``on_redis_error="miss"``. The worker links them from its pool and never
notices, while the fleet's other workers miss them. Checking at every link would put a Redis round trip
on the engine thread for each chunk of each request; checking at most once per period per chunk bounds
that to one ``EXISTS`` per chunk per period. After a failed check every check pauses for a period, so an
unreachable Redis (a timeout each) costs the engine one timeout per period, not one per link.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable


class SharedRechecks:
    """The schedule of those checks (no I/O: ``TieredStore`` runs them).

    Args:
        period_s: seconds between two checks of one chunk; ``0``: every link; ``None``: never.
    """

    def __init__(self, period_s: float | None) -> None:
        self.period_s = period_s
        self._checked_at: dict[str, float] = {}  # cache id -> when the shared tier last had it, or was asked
        self._paused_until = -math.inf
        self._prune_at = 64  # forget() prunes once the map is this large

    def is_due(self, cache_id: str) -> bool:
        """Whether to check ``cache_id`` now; if so, its clock restarts now."""
        now = time.monotonic()
        if self.period_s is None or now < self._paused_until:
            return False
        if now - self._checked_at.get(cache_id, -math.inf) < self.period_s:
            return False
        self._checked_at[cache_id] = now
        return True

    def written(self, cache_id: str) -> None:
        """``cache_id`` was just written to the shared tier: it counts as checked."""
        if self.period_s is not None:
            self._checked_at[cache_id] = time.monotonic()

    def failed(self) -> None:
        """A check failed: pause every check for a period."""
        self._paused_until = time.monotonic() + (self.period_s or 0.0)

    def forget(self, is_resident: Callable[[str], bool]) -> None:
        """Drop the clocks of chunks no longer resident once the map has doubled since the last time
        (amortized O(1) per call; the map holds at most about twice the chunks resident at the last prune)."""
        if len(self._checked_at) >= self._prune_at:
            self._checked_at = {cid: t for cid, t in self._checked_at.items() if is_resident(cid)}
            self._prune_at = max(64, 2 * len(self._checked_at))
