"""``Stepper``: the engine's iterative interface (``add_request``, ``step``, ``abort``), for one driving thread."""

from __future__ import annotations

import contextlib
import queue

from pic.engine.caller.prepare import Preparer
from pic.engine.commands import Abort, Channel, Step, Submit
from pic.engine.request import Request, RequestOutput, check_request_id


class Stepper:
    """Requests whose outputs come from ``step`` (``PIC.stepper()``; vLLM's ``LLMEngine`` loop).

    Its requests advance in the steps ``step`` asks for, one per call when nothing else runs (so a
    ``while has_unfinished(): step()`` loop steps exactly as a single-threaded engine would), and in the
    steps that other callers' requests run meanwhile.

    Args:
        channel: the way into the engine's core thread.
        prepare: validates and tokenizes a request here, in the caller's thread (``Engine``'s).
    """

    def __init__(self, channel: Channel, prepare: Preparer) -> None:
        self._channel, self._prepare = channel, prepare
        self._outputs: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        self._open: set[int] = set()  # ids whose last output ``step`` has not returned yet

    def add_request(self, request: Request) -> int:
        """Queue a request; returns its id. Its outputs come from ``step``.

        Raises:
            InvalidInputError: an empty query, a bad token id.
        """
        new = self._prepare.new_request(request, sink=self._outputs, sampling=request.sampling, paced=True)
        self._open.add(new.request_id)
        self._channel.send(Submit((new,)))
        return new.request_id

    def step(self) -> list[RequestOutput]:
        """The outputs of this interface's requests since the last call, running one step first when
        there are none yet and one of them is unfinished."""
        if self._outputs.empty() and self._open:
            self._channel.call(Step)
        outputs = []
        with contextlib.suppress(queue.Empty):
            while True:
                outputs.append(self._outputs.get_nowait())
        self._open.difference_update(out.request_id for out in outputs if out.finished)
        return outputs

    def has_unfinished(self) -> bool:
        """Whether a request of ``add_request`` has not yet returned its last output from ``step``."""
        return bool(self._open)

    def abort(self, request_id: int) -> None:
        """Stop a request at the next step (a final ``RequestOutput`` with ``FinishReason.ABORT``).

        Raises:
            InvalidInputError: ``request_id`` is not an int.
        """
        self._channel.send(Abort(check_request_id(request_id)))

    @property
    def num_steps(self) -> int:
        """Steps the engine ran a forward in (for every caller's requests, these and others)."""
        return self._channel.ask(lambda core: core.num_steps)

    @property
    def num_batched_seqs(self) -> int:
        """Sequences those forwards carried (``num_batched_seqs / num_steps``: the mean batch)."""
        return self._channel.ask(lambda core: core.num_batched_seqs)
