"""The engine's ways to run requests other than ``link``: ``generate_many`` (a batch to its end), ``submit`` (outputs
to a sink: the server), ``stepper`` (``Stepper``, the iterative interface for one driving thread), and ``abort``;
``PIC`` inherits them (``RunMethods``)."""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Callable, Sequence

from pic.engine.caller.compiling import PROGRESS_MIN
from pic.engine.commands import Abort, Channel, ReadSteps, Step, Submit
from pic.engine.generation import Generation
from pic.engine.request import NewRequest, OutputSink, Preparer, Request, RequestOutput
from pic.errors import InvalidInputError
from pic.progress import tqdm


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
            InvalidInputError: not a ``pic.Request`` (a text, say), an empty query, a bad token id.
        """
        new = self._prepare.new_request(request, sink=self._outputs, paced=True)
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
        return self._channel.call(ReadSteps).num_steps

    @property
    def num_batched_seqs(self) -> int:
        """Sequences those forwards carried (``num_batched_seqs / num_steps``: the mean batch)."""
        return self._channel.call(ReadSteps).num_batched_seqs


class RunMethods:
    """The run methods of ``PIC``, over its channel, preparer, stepper and ``_submit``."""

    _channel: Channel
    _prepare: Preparer
    _stepper: Stepper

    _submit: Callable[..., list[NewRequest]]  # (``PIC._submit``: validate, tokenize and queue requests)

    def generate_many(self, requests: Sequence[Request], *, progress: bool | None = None) -> list[Generation]:
        """Run many requests together (continuous batching) and return their generations, in order.

        Args:
            requests: ``pic.Request`` objects (chunks, query, policy and sampling options each).
            progress: show a progress bar (``None``, the default: for 8 or more requests).

        A request's generation is what it gets alone, whatever it is batched with. Every request is
        validated before any runs (a bad one raises ``InvalidInputError`` and none runs); every request
        runs to its end; then the first failure, if any, is raised (see ``link`` for the errors).
        """
        news = self._submit(requests, link_only=False)
        show = len(news) >= PROGRESS_MIN if progress is None else progress
        lasts: list[RequestOutput] = []
        try:
            with tqdm(total=len(news), desc="pic generate", unit="request", disable=not show) as bar:
                for new in news:
                    lasts.append(new.sink.get())  # (a ``last_only`` stream: the finished output)
                    bar.update(1)
        finally:
            for new in news[len(lasts) :]:  # interrupted: stop the rest
                self._channel.send(Abort(new.request_id))
        failed = next((out.error for out in lasts if out.error is not None), None)
        if failed is not None:
            raise failed
        return [out.generation for out in lasts]

    def submit(self, request: Request, *, sink: OutputSink) -> int:
        """Queue a request whose outputs go to ``sink`` (``put`` is called from the engine's thread and must
        not block: a queue; ``pic.engine.commands.RequestStream`` for a thread, ``pic.serve.loop.AsyncRequestStream``
        for an event loop); returns its id.

        Raises:
            InvalidInputError: not a ``pic.Request`` (a text, say), an empty query, a bad token id.
        """
        new = self._prepare.new_request(request, sink=sink)
        self._channel.send(Submit((new,)))
        return new.request_id

    def abort(self, request_id: int) -> None:
        """Stop a request of ``submit`` and free its blocks (a final output with ``FinishReason.ABORT``);
        an id that already finished is ignored.

        Raises:
            InvalidInputError: ``request_id`` is not a request id (an int).
        """
        self._channel.send(Abort(check_request_id(request_id)))

    def stepper(self) -> Stepper:
        """The iterative interface (vLLM's ``LLMEngine`` loop): ``add_request``, ``step``, ``abort``,
        ``has_unfinished``, and the engine's step counters (one object per engine)."""
        return self._stepper


def check_request_id(request_id: object) -> int:
    """Raises: InvalidInputError: ``request_id`` is not an int (an id ``submit`` / ``add_request`` returned)."""
    if not isinstance(request_id, int) or isinstance(request_id, bool):
        raise InvalidInputError(f"request id {request_id!r:.80} is not an int (an id that submit/add_request returned)")
    return request_id
