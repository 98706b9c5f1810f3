"""A sequence's life as one state machine, written once: its statuses and the transitions between them (the table
``TRANSITIONS``), which ``Queues.move`` (``pic.engine.core.queues``) applies to a sequence's status and queue
together::

    WAITING --ADMIT--> PREFILLING --RUN--> RUNNING --PREEMPT--> WAITING
                           |                  ^
                          PARK              START
                           v                  |
                        PARKED --RESUME--> RESUMING --PREEMPT--> WAITING

    any status but FINISHED --FINISH--> FINISHED

A parked link whose generation starts is RESUMING until the scheduler gives it a place among the running (its
first token comes from the hidden state its pass left: no blocks, no forward); from then on it runs, and is
preempted, as any running sequence. A running sequence that finds no block for its next token may take a resuming
one's blocks too (its generation has started: the engine owns it; it waits for a fresh pass, as any preempted one).
"""

from __future__ import annotations

import enum

from pic.errors import SequenceStateError


class Status(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"  # queued for admission: new, or preempted (its blocks freed; planned again)
    PREFILLING = "prefilling"  # admitted: its recompute pass runs (in pieces; a probe, then its second pass)
    PARKED = "parked"  # linked (``PIC.link``): its pass ran; it holds its KV until ``Linked.generate`` or release
    RESUMING = "resuming"  # parked, its generation started: waits for a place among the running
    RUNNING = "running"  # decoding: one token per step
    FINISHED = "finished"  # done, failed or aborted: its blocks are freed


class Transition(enum.Enum):
    """What happens to a sequence (its name in messages)."""

    ADMIT = "admit"  # its blocks were taken; its pass runs from the next forward
    RUN = "run"  # its pass ended and it generates: it decodes from now on
    PARK = "park"  # its pass ended and it was only linked: it holds its KV
    RESUME = "resume"  # ``Linked.generate``: its generation starts
    START = "start"  # a resuming sequence got its place among the running (its first token is sampled now)
    PREEMPT = "preempt"  # its blocks were freed for others: a fresh pass over its prompt and output later
    FINISH = "finish"  # done, failed or aborted


_LIVE = frozenset(Status) - {Status.FINISHED}

# transition -> (the statuses it may start from, the status it ends in)
TRANSITIONS: dict[Transition, tuple[frozenset[Status], Status]] = {
    Transition.ADMIT: (frozenset({Status.WAITING}), Status.PREFILLING),
    Transition.RUN: (frozenset({Status.PREFILLING}), Status.RUNNING),
    Transition.PARK: (frozenset({Status.PREFILLING}), Status.PARKED),
    Transition.RESUME: (frozenset({Status.PARKED}), Status.RESUMING),
    Transition.START: (frozenset({Status.RESUMING}), Status.RUNNING),
    Transition.PREEMPT: (frozenset({Status.RUNNING, Status.RESUMING}), Status.WAITING),
    Transition.FINISH: (_LIVE, Status.FINISHED),
}


def after(request_id: int, status: Status, transition: Transition) -> Status:
    """The status ``transition`` leads to from ``status``.

    Raises:
        SequenceStateError: ``transition`` may not start from ``status`` (naming the request, both and what it
            may start from).
    """
    sources, target = TRANSITIONS[transition]
    if status not in sources:
        allowed = ", ".join(sorted(s.value for s in sources)) or "nothing"
        raise SequenceStateError(
            f"request {request_id} cannot {transition.value} while {status.value} (only from: {allowed})"
        )
    return target
