"""``Queues``: the scheduler's sequences by status, and the one caller of their transitions.

Each transition here is the sequence's (checked by its state machine, ``pic.engine.core.status``) and the move
between queues it implies, in that order: a transition that is not allowed raises before any queue changes. So
a sequence is in the queue of its status, and only there:

- ``waiting``: WAITING and RESUMING, in arrival order (a preempted one at the front);
- ``prefilling``: PREFILLING, in admission order;
- ``running``: RUNNING, in admission order (the most recent is preempted first);
- PARKED ones are in no queue (``requests`` holds every sequence that is not FINISHED).

``guard`` is how the scheduler works on one sequence: whatever it raises fails that sequence alone (logged), never
the step and the other requests.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Iterator

import torch

from pic.engine.core.sequence import Decoding, Sequence
from pic.engine.generation import FinishReason
from pic.engine.request import OutputSink
from pic.engine.sampling import SamplingParams
from pic.errors import PicError

log = logging.getLogger("pic")


class Queues:
    """Attributes:
    requests: request id -> its sequence, for every one not finished (parked ones included).
    waiting, prefilling, running: the queues (see the module's docstring).
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

    def admit(self, seq: Sequence) -> None:
        """WAITING -> PREFILLING: its blocks were taken."""
        seq.admit()
        self.waiting.remove(seq)
        self.prefilling.append(seq)

    def run(self, seq: Sequence) -> None:
        """PREFILLING -> RUNNING: its pass ended; it generates."""
        seq.run()
        self.prefilling.remove(seq)
        self.running.append(seq)

    def park(self, seq: Sequence, query_hidden: torch.Tensor) -> None:
        """PREFILLING -> PARKED: its pass ended; it was only linked."""
        seq.park(query_hidden)
        self.prefilling.remove(seq)

    def resume(
        self, seq: Sequence, params: SamplingParams, decoding: Decoding, *, sink: OutputSink, link_s: float
    ) -> None:
        """PARKED -> RESUMING: ``Linked.generate``; it waits for a place among the running."""
        seq.resume(params, decoding, sink=sink, link_s=link_s)
        self.waiting.append(seq)

    def start(self, seq: Sequence) -> None:
        """RESUMING -> RUNNING: it got its place (its first token is sampled in this step)."""
        seq.start()
        self.waiting.remove(seq)
        self.running.append(seq)

    def preempt(self, seq: Sequence) -> None:
        """RUNNING or RESUMING -> WAITING, at the front: its blocks are freed for others."""
        seq.preempt()
        self.drop(seq)
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, why: FinishReason | Exception) -> None:
        """Any status -> FINISHED: out of every queue, and forgotten."""
        seq.finish(why)
        self.drop(seq)
        self.requests.pop(seq.request_id, None)

    def drop(self, seq: Sequence) -> None:
        """Take ``seq`` out of whichever queue holds it (it fails: ``finish`` follows)."""
        for queue in (self.running, self.prefilling, self.waiting):
            if seq in queue:
                queue.remove(seq)

    @contextlib.contextmanager
    def guard(self, seq: Sequence, failed: list[tuple[Sequence, Exception]]) -> Iterator[None]:
        """Work on one sequence: an exception fails it alone (out of its queue, into ``failed``), not the step."""
        try:
            yield
        except Exception as exc:
            if isinstance(exc, PicError):
                log.error("pic: request %d failed: %s", seq.request_id, exc)
            else:  # a bug, or a policy's own: logged with its traceback
                log.exception("pic: request %d failed", seq.request_id)
            self.drop(seq)
            failed.append((seq, exc))
