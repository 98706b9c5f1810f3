"""The caller's side of the engine's commands (``Engine`` runs these in its callers' threads): queue requests,
wait for what ends each, and free what an interrupted caller leaves behind."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from pic.config import CompileOptions
from pic.engine.caller.linked import Linked
from pic.engine.caller.prepare import Documents, Preparer
from pic.engine.caller.streams import RequestStream
from pic.engine.commands import Abort, Channel, Compile, Submit
from pic.engine.generation import Generation
from pic.engine.request import CompileJob, CompileReport, LinkOutput, NewRequest, Request, RequestOutput, Stored
from pic.errors import InvalidInputError
from pic.link.policies import Policy
from pic.progress import tqdm
from pic.store.lease import FleetLeases
from pic.text import refuse_text_for_list

# Running at least this many requests, or compiling this many documents, shows a progress bar (unless
# ``progress`` says otherwise).
_PROGRESS_MIN = 8


def check_requests(requests: object) -> None:
    """Raises: InvalidInputError: ``requests`` is not a sequence of ``pic.Request`` (naming the first that is not)."""
    refuse_text_for_list(requests, "requests", "pic.Request objects")
    if not isinstance(requests, Sequence):
        raise InvalidInputError(f"requests is {requests!r:.80}; expected a list of pic.Request")
    bad = next((i for i, r in enumerate(requests) if not isinstance(r, Request)), None)
    if bad is not None:
        raise InvalidInputError(f"requests[{bad}] is {requests[bad]!r:.80}; expected a pic.Request")


def submit(channel: Channel, prepare: Preparer, requests: Sequence[Request], *, link_only: bool) -> list[NewRequest]:
    """Validate, tokenize and queue ``requests`` together (they can share their first forward); each one's
    last output (or, ``link_only``, its ``LinkOutput``) goes to its own ``RequestStream`` (``new.sink``).

    Raises:
        InvalidInputError: a bad request (none is queued then).
    """
    check_requests(requests)
    news = []
    for r in requests:
        stream = RequestStream(channel.alive, last_only=True)
        news.append(prepare.new_request(r, sink=stream, sampling=None if link_only else r.sampling))
    channel.send(Submit(tuple(news)))
    return news


def wait_links(channel: Channel, news: Sequence[NewRequest]) -> list[LinkOutput | RequestOutput]:
    """Each request's ``LinkOutput`` (or its failure); an interrupted wait aborts them all."""
    try:
        return [new.sink.get() for new in news]
    except BaseException:  # interrupted: nobody will hold these requests, so free them
        for new in news:
            channel.send(Abort(new.request_id))
        raise


def wait_lasts(channel: Channel, news: Sequence[NewRequest], *, progress: bool) -> list[RequestOutput]:
    """Each request's last output, in order; an interrupted wait aborts the ones still running."""
    lasts: list[RequestOutput] = []
    try:
        with tqdm(total=len(news), desc="pic generate", unit="request", disable=not progress) as bar:
            for new in news:
                while not (out := new.sink.get()).finished:
                    pass
                lasts.append(out)
                bar.update(1)
    finally:
        for new in news[len(lasts) :]:  # interrupted: stop the rest
            channel.send(Abort(new.request_id))
    return lasts


def link_requests(
    channel: Channel,
    prepare: Preparer,
    requests: Sequence[Request],
    *,
    make: Callable[[LinkOutput, Policy, float], Linked],
) -> list[Linked]:
    """``Engine.link_many``: queue the requests parked after their passes, wait, ``make`` a ``Linked`` of each
    (its output, policy and the call's wall time); if one failed, release the others and raise its error."""
    start = time.perf_counter()
    news = submit(channel, prepare, requests, link_only=True)
    firsts = wait_links(channel, news)
    link_s = time.perf_counter() - start
    linked = [make(first, first.policy, link_s) for first in firsts if isinstance(first, LinkOutput)]
    failed = next((first.error for first in firsts if isinstance(first, RequestOutput)), None)
    if failed is not None:
        for item in linked:
            item.release()
        raise failed
    return linked


def generate_requests(
    channel: Channel, prepare: Preparer, requests: Sequence[Request], *, progress: bool | None
) -> list[Generation]:
    """``Engine.generate_many``: queue the requests, wait for every one to end, raise the first failure
    (``progress``: a bar; ``None``: for ``_PROGRESS_MIN`` requests or more)."""
    news = submit(channel, prepare, requests, link_only=False)
    lasts = wait_lasts(channel, news, progress=len(news) >= _PROGRESS_MIN if progress is None else progress)
    failed = next((out.error for out in lasts if out.error is not None), None)
    if failed is not None:
        raise failed
    return [out.generation for out in lasts]


def compile_documents(
    channel: Channel,
    found: Documents,
    options: CompileOptions,
    *,
    fleet: FleetLeases | None,
    has_chunk: Callable[[str], bool],
    progress: bool | None,
    lower_tiers: bool = True,
    interactive: bool = False,
) -> CompileReport:
    """Compile the documents no tier holds (between the workers sharing ``fleet``, once each); returns when
    every one is stored, saying where (``progress``: a bar; ``None``: for ``_PROGRESS_MIN`` documents or more).
    ``lower_tiers=False``: into the KV pool only, without a fleet (``CompileJob.lower_tiers``); ``interactive``: a
    request waits for them (``CompileJob.interactive``).

    Raises:
        as ``Engine.compile``.
    """
    show = len(found.tokens) >= _PROGRESS_MIN if progress is None else progress
    num_compiled = 0
    with tqdm(total=len(found.tokens), desc="pic compile", unit="chunk", disable=not show) as bar:

        def compile_ids(todo: Sequence[str]) -> Stored:
            nonlocal num_compiled
            job = CompileJob(
                tokens=found.tokens, options=options, todo=tuple(todo), on_chunk=lambda: bar.update(1),
                lower_tiers=lower_tiers, interactive=interactive,
            )  # fmt: skip
            stored = channel.call(lambda reply: Compile(job, reply))
            num_compiled += len(stored.compiled)
            return stored

        if fleet is not None and lower_tiers:  # workers sharing the Redis tier compile each chunk once between them
            fleet.compile_once(found.ids, has_chunk=has_chunk, compile=lambda todo: compile_ids(todo).compiled)
        stored = compile_ids(found.ids)  # the rest; resident chunks are written back where a lower tier lost them
        bar.update(bar.total - bar.n)  # (the chunks a tier held already)
    return CompileReport(ids=found.ids, tiers=[stored.tiers[cid] for cid in found.ids], num_compiled=num_compiled)
