"""``Queues``: the scheduler's sequences by status, and ``move``, the one function that applies a transition of
the state machine (``pic.engine.core.status.TRANSITIONS``). A move is checked against the table before anything
changes (one not allowed raises ``SequenceStateError`` for that request alone), then the sequence leaves its queue,
takes its new status and joins the queue of that status, so a sequence is in the queue of its status, and only there:

- ``waiting``: WAITING and RESUMING, in arrival order (a preempted one at the front);
- ``prefilling``: PREFILLING, in admission order;
- ``running``: RUNNING, in admission order (the most recent is preempted first);
- PARKED and FINISHED ones are in no queue (``requests`` holds every sequence that is not FINISHED).
"""

from __future__ import annotations

from collections import deque

from pic.engine.core.sequence import Sequence
from pic.engine.core.status import Status, Transition, after


class Queues:
    """The scheduler's sequences by status (the module's docstring).

    Attributes:
        requests: request id -> its sequence, for every one not finished (parked ones included).
        waiting, prefilling, running: the queues.
    """

    def __init__(self) -> None:
        self.requests: dict[int, Sequence] = {}
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        """A new sequence (WAITING) joins the end of the queue."""
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)

    def move(self, seq: Sequence, transition: Transition) -> None:
        """Apply ``transition``: checked first; then out of its queue, its new status, into that status's queue
        (a preempted sequence at the front of ``waiting``), and the time it first reached that status.

        Raises:
            SequenceStateError: the transition may not start from its status (nothing changes).
        """
        target = after(seq.request_id, seq.status, transition)
        for queue in (self.running, self.prefilling, self.waiting):  # (where it is, even where it should not be)
            if seq in queue:
                queue.remove(seq)
        seq.enter(target, transition)
        if transition is Transition.PREEMPT:
            self.waiting.appendleft(seq)
        elif target in (Status.WAITING, Status.RESUMING):
            self.waiting.append(seq)
        elif target is Status.PREFILLING:
            self.prefilling.append(seq)
        elif target is Status.RUNNING:
            self.running.append(seq)
        elif target is Status.FINISHED:
            self.requests.pop(seq.request_id, None)

    def of(self, status: Status) -> list[Sequence]:
        """The waiting queue's sequences of ``status`` (WAITING or RESUMING), in its order."""
        return [s for s in self.waiting if s.status is status]

    @property
    def num_active(self) -> int:
        """Sequences running or prefilling (what ``max_num_seqs`` caps)."""
        return len(self.running) + len(self.prefilling)
