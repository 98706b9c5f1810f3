"""Leader/follower stepping: whichever waiting thread finds no one stepping steps for everyone."""

from __future__ import annotations

import threading
from collections.abc import Callable


class Driver:
    """Lets several threads wait on one engine without running it concurrently.

    A thread that needs a result (``run_until``) steps the engine itself when no other thread is
    stepping, and otherwise sleeps until the stepping thread reports a step done. The stepping thread
    stops once its own result is ready; a sleeping thread then takes over. So exactly one thread at
    a time owns the engine's state, no thread sits idle in the background, and requests handed in by
    any thread are batched into the owner's next step.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._driving = False

    def run_until(self, done: Callable[[], bool], *, step: Callable[[], object], has_work: Callable[[], bool]) -> None:
        """Return once ``done()``; step (``step()``) while this thread owns the engine.

        Raises:
            RuntimeError: ``done()`` can no longer become true (nothing is left to run): a bug.
        """
        with self._cond:
            while not done():
                if not self._driving:
                    self._driving = True
                    break
                self._cond.wait()
            else:
                return
        try:
            while not done():
                if not has_work():
                    raise RuntimeError("pic: waiting on a request the engine has no work for (please report this bug)")
                step()
        finally:
            with self._cond:
                self._driving = False
                self._cond.notify_all()

    def try_run(self, fn: Callable[[], object]) -> bool:
        """Run ``fn`` now as the owner if no thread owns the engine; whether it ran."""
        with self._cond:
            if self._driving:
                return False
            self._driving = True
        try:
            fn()
        finally:
            with self._cond:
                self._driving = False
                self._cond.notify_all()
        return True

    def step_done(self) -> None:
        """Wake the waiting threads to look at the outputs of the step that just ended."""
        with self._cond:
            self._cond.notify_all()
