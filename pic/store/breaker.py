"""``Breaker``: stop calling a backend that just failed, and try it again a little later.

A paused Redis answers nothing: every command waits out its socket timeout (10 s by default). Without a
breaker each call pays that again, so a compile of 8 documents during a stall takes minutes, a scrape of
``/metrics`` takes the timeout every time, and the threads that run store calls fill up with calls that will
all fail. A breaker *opens* at the first failure of the kind that says the backend is unreachable (a timeout,
a refused connection, a full disk for writes): for ``retry_s`` seconds every call fails at once, without
touching the backend. Then one call, the *probe*, is let through (the others still fail at once while it
runs); if it succeeds the breaker closes, if it fails it stays open for another ``retry_s``. A failure is
never hidden: the calls that fail at once raise ``BreakerOpenError``, which names the failure that opened it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

_T = TypeVar("_T")


class BreakerOpenError(OSError):
    """A call refused without being tried: the backend failed recently (the message says how and when).

    An ``OSError`` (a disk tier's callers catch those) that the Redis client proxy re-raises as a
    ``redis.ConnectionError`` (``pic.store.redis_client.NotTried``). Both say ``not_tried``, so a ``FailureGuard``
    logs the failure that opened the breaker once, not every refusal after it."""

    not_tried = True


class Breaker:
    """Whether a backend may be called now (thread-safe).

    Args:
        name: what the backend is, for messages (``"Redis at redis://host:6379/0"``).
        retry_s: how long it stays open after a failure before a probe is let through.
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, name: str, *, retry_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.name, self.retry_s, self._clock = name, retry_s, clock
        self._lock = threading.Lock()
        self._opened_at: float | None = None  # None: closed
        self._retry_at = 0.0
        self._probing = False
        self._why = ""
        self.num_opened = 0  # times it opened (closed -> open)
        self.num_allowed = self.num_refused = 0  # calls let through / refused without being tried

    @property
    def is_open(self) -> bool:
        """Whether calls are being refused (a probe in flight counts as open)."""
        with self._lock:
            return self._opened_at is not None

    def allow(self) -> None:
        """Let a call through, or refuse it.

        Raises:
            BreakerOpenError: the breaker is open and this call is not the probe.
        """
        with self._lock:
            now = self._clock()
            if self._opened_at is None or (now >= self._retry_at and not self._probing):
                self._probing = self._opened_at is not None  # (open: this call is the probe)
                self.num_allowed += 1
                return
            self.num_refused += 1
            wait = max(0.0, self._retry_at - now)
            next_try = "a probe is under way" if self._probing else f"next try in {wait:.1f} s"
            raise BreakerOpenError(
                f"not tried: {self.name} failed {now - self._opened_at:.1f} s ago ({self._why}); {next_try}"
            )

    def succeeded(self) -> None:
        """A call that ``allow`` let through worked: close."""
        with self._lock:
            self._opened_at, self._probing = None, False

    def failed(self, exc: BaseException) -> None:
        """A call that ``allow`` let through failed in a way that says the backend is unreachable: (re)open."""
        with self._lock:
            now = self._clock()
            if self._opened_at is None:
                self._opened_at = now
                self.num_opened += 1
            self._retry_at, self._probing = now + self.retry_s, False
            self._why = f"{type(exc).__name__}: {exc}"[:200]

    def released(self) -> None:
        """A call that ``allow`` let through ended without saying whether the backend works (an error of the
        caller's own): if it was the probe, the next call probes instead."""
        with self._lock:
            self._probing = False

    def call(self, fn: Callable[[], _T], *, unreachable: Callable[[BaseException], bool]) -> _T:
        """``fn()`` if the breaker lets it through, reporting how it went: an exception for which ``unreachable``
        is true opens the breaker; any other exception leaves it as it was (``released``).

        Raises:
            BreakerOpenError: refused without calling ``fn``.
        """
        self.allow()
        try:
            result = fn()
        except BaseException as exc:
            self.failed(exc) if unreachable(exc) else self.released()
            raise
        self.succeeded()
        return result
