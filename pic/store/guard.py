"""``FailureGuard``: what a lower tier does when its backend (Redis, a disk) fails mid-call.

Both remote and local tiers answer a failure the same way, chosen by the user (``on_redis_error``,
``on_disk_error``): raise ``StoreUnavailableError`` naming the backend, or log it, count it and carry on
as a miss, so the other tiers keep serving.
"""

from __future__ import annotations

import logging
from typing import Literal, Protocol

from pic.errors import StoreUnavailableError

log = logging.getLogger("pic.store")


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

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is None or not isinstance(exc, self._errors):
            return False
        message = self._tier._last_error = self._tier._failed(exc)
        if self._raise:
            raise StoreUnavailableError(message) from exc
        log.warning("pic: %s; serving from the other tiers", message)
        return True
