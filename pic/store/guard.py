"""``FailureGuard``: what a lower tier does when its backend (Redis, a disk) fails mid-call.

Both remote and local tiers answer a failure the same way, chosen by the user (``on_redis_error``,
``on_disk_error``): raise ``StoreUnavailableError`` naming the backend, or log it, count it and carry on
as a miss, so the other tiers keep serving.
"""

from __future__ import annotations

import logging
import threading
from typing import Literal, Protocol

from pic.errors import StoreUnavailableError

log = logging.getLogger("pic.store")
_here = threading.local()  # .failed: the tier whose latest guarded call on this thread failed (or None)


def failed_here(tier: object) -> bool:
    """Whether ``tier``'s latest guarded call on this thread failed (and, under ``"miss"``, returned a miss):
    how a caller tells a write that failed from one that found no room. Per thread, unlike ``last_error``,
    which another thread's call may reset meanwhile."""
    return getattr(_here, "failed", None) is tier


class Guarded(Protocol):
    """A tier a ``FailureGuard`` reports to."""

    _last_error: str | None

    def _failed(self, exc: BaseException) -> str:
        """Count the failure and say what failed (credentials masked)."""


class FailureGuard:
    """Turns ``errors`` raised inside ``with`` into ``StoreUnavailableError`` (``on_error="raise"`` or
    ``always_raise``) or a logged, swallowed miss (the ``with`` body's later statements are skipped, so
    the caller returns its miss value after the block)."""

    def __init__(
        self,
        tier: Guarded,
        errors: type[BaseException] | tuple[type[BaseException], ...],
        *,
        on_error: Literal["raise", "miss"],
        always_raise: bool = False,
    ) -> None:
        self._tier, self._errors, self._raise = tier, errors, on_error == "raise" or always_raise

    def __enter__(self) -> None:
        self._tier._last_error = None
        if failed_here(self._tier):
            _here.failed = None

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is None or not isinstance(exc, self._errors):
            return False
        message = self._tier._last_error = self._tier._failed(exc)
        _here.failed = self._tier
        if self._raise:
            raise StoreUnavailableError(message) from exc
        # A refusal of an open breaker repeats the failure that opened it, which was logged: once is enough.
        log.log(logging.DEBUG if getattr(exc, "not_tried", False) else logging.WARNING,
                "pic: %s; serving from the other tiers", message)  # fmt: skip
        return True
