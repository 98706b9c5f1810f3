"""A seeded fuzzer of one engine (issue 49): threads mix every way a client uses the engine over a small pool,
and the invariants that hold after any such run are checked. Shared by the in-process test and the one over
``pic serve`` (tests/test_engine_fuzz.py).

``plan(seed, ...)`` draws each thread's operations (the seed fixes them; the threads' interleaving is theirs);
``Fuzz.run`` runs them against one engine; ``Fuzz.check`` then asserts, on the idle engine:

- no request failed but for its own bad input, or a pool that cannot hold it: alone, or beside the links other
  threads held meanwhile (a link is parked from its ``link`` call until the engine takes its ``generate`` in, and
  the engine never takes a parked link's blocks back: ``Linked`` holds its KV until generated from or released;
  such a request may also end early with ``FinishReason.KV_POOL``, with the first tokens of its alone output);
- every greedy output equals the same request run alone (afterwards, on the same engine);
- the pool is back at rest: no block in use, its bookkeeping consistent (the owners' charges too);
- the engine still serves a new request.

With ``namespaces`` each thread is a tenant of its own (thread ``i`` the ``i``-th namespace, in turn), linking the
base documents compiled in its namespace; its bad requests also link another tenant's chunk, which must be unknown
to it.
"""

from __future__ import annotations

import contextlib
import enum
import gc
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pic
from pic.errors import InvalidInputError, KVPoolExhaustedError, UnknownCacheIdError
from pic.ids import chunk_id
from tests.kv_invariants import check_engine_pool

BASE_DOCS = (
    "Tom had a big red ball. He liked to kick it in the park.",
    "Lily loved to sing. Every morning she sang a happy song for her mom and dad.",
    "The cat sat on the mat.",
)
WORDS = "the a dog cat sun tree ran big little happy sad ball girl boy park sing day one went saw".split()
POLICIES = (None, "naive", "mepic", "legolink:16", "full", "prophetkv", "cacheblend:0.15")
# (every chunk block private: kept to short requests; the default, auto, runs Full Recompute on these short prompts)
SLOW = {None, "full", "cacheblend:0.15"}
RUN_S = 60.0  # a run's threads end well within this (a few seconds here): past it, something is stuck


class Kind(enum.Enum):
    """What one operation does, as a client would."""

    GENERATE = "generate"  # link, generate at once (greedy)
    SAMPLE = "sample"  # link, generate with temperature and a seed
    PARK = "park"  # link, hold it a moment, then generate (the resumed-link path)
    TOGETHER = "together"  # link two or three, then generate_together
    STREAM = "stream"  # link, stream to the end
    ABORT = "abort"  # link, stream a few pieces, close the stream
    RELEASE = "release"  # link, release without generating
    COMPILE = "compile"  # compile a new document, link it with a cached one, generate
    MANY = "many"  # generate_many of two or three requests
    BAD = "bad"  # an unknown cache id (the engine refuses it) or an empty query (refused before it)


WEIGHTS = {
    Kind.GENERATE: 3, Kind.SAMPLE: 1, Kind.PARK: 4, Kind.TOGETHER: 2, Kind.STREAM: 2, Kind.ABORT: 2,
    Kind.RELEASE: 1, Kind.COMPILE: 1, Kind.MANY: 1, Kind.BAD: 1,
}  # fmt: skip


@dataclass(frozen=True)
class Ask:
    """One request: the base chunks it links (indices), its query, policy and length."""

    chunks: tuple[int, ...]
    query: str
    policy: str | None
    max_new_tokens: int


@dataclass(frozen=True)
class Op:
    kind: Kind
    asks: tuple[Ask, ...]
    arg: int  # ABORT: pieces read; PARK: milliseconds parked; SAMPLE: seed; COMPILE: the new document's seed


def _ask(rng: random.Random, *, max_tokens: int) -> Ask:
    policy = rng.choice(POLICIES)
    chunks = tuple(rng.sample(range(len(BASE_DOCS)), rng.randint(1, len(BASE_DOCS))))
    query = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))
    most = max_tokens // 3 if policy in SLOW else max_tokens
    return Ask(chunks, query, policy, rng.randint(1, most))


def plan(seed: int, *, num_threads: int, num_ops: int, max_tokens: int) -> list[list[Op]]:
    """Each thread's operations, drawn from ``seed``."""
    rng = random.Random(seed)
    kinds, weights = list(WEIGHTS), list(WEIGHTS.values())
    threads = []
    for _ in range(num_threads):
        ops = []
        for kind in rng.choices(kinds, weights, k=num_ops):
            num = rng.randint(2, 3) if kind in (Kind.TOGETHER, Kind.MANY) else 1
            asks = tuple(_ask(rng, max_tokens=max_tokens) for _ in range(num))
            if kind is Kind.TOGETHER:  # one call: one length for all
                asks = tuple(Ask(a.chunks, a.query, a.policy, asks[0].max_new_tokens) for a in asks)
            ops.append(Op(kind, asks, rng.randint(0, 30)))
        threads.append(ops)
    return threads


@dataclass(frozen=True)
class Outcome:
    """A greedy request's result (``text`` when compared as text: a server's reply), and the thread and times of
    the operation it came from."""

    ids: tuple[str, ...]
    ask: Ask
    tokens: tuple[int, ...] | None
    text: str
    finish: str
    start: float
    end: float
    thread: int = field(default_factory=threading.get_ident)
    namespace: pic.Namespace | None = None


@dataclass(frozen=True)
class Failure:
    op: Op
    error: Exception
    start: float
    end: float
    thread: int = field(default_factory=threading.get_ident)
    namespace: pic.Namespace | None = None


@dataclass
class Fuzz:
    """One engine under ``plan``'s operations; what happened, for ``check``.

    Attributes:
        ids: the base documents' cache ids (in the default namespace).
        outcomes, failures: greedy results and the operations that raised.
        parked: ``(thread, start, end)`` of every operation that held links (``held``).
        namespaces: the tenants the threads are, in turn (none: every thread in the default namespace).
    """

    engine: pic.PIC
    ids: list[str]
    outcomes: list[Outcome] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    parked: list[tuple[int, float, float]] = field(default_factory=list)
    seed: int = 0
    namespaces: tuple[pic.Namespace, ...] = ()
    _ids_of: dict[str, list[str]] = field(default_factory=dict)
    _local: threading.local = field(default_factory=threading.local)

    def __post_init__(self) -> None:
        for namespace in self.namespaces:  # the base documents, in each tenant's namespace
            self._ids_of[namespace.name] = self.engine.compile(list(BASE_DOCS), namespace=namespace)

    @property
    def namespace(self) -> pic.Namespace | None:
        """The tenant of the calling thread (``None``: the default namespace)."""
        return getattr(self._local, "namespace", None)

    @contextlib.contextmanager
    def as_tenant(self, namespace: pic.Namespace | None) -> Iterator[None]:
        before, self._local.namespace = self.namespace, namespace
        try:
            yield
        finally:
            self._local.namespace = before

    def run(self, threads: list[list[Op]], *, op: Callable[[Fuzz, Op], None] | None = None) -> None:
        """Run each thread's operations in a thread of its own (``op``: how one runs, default ``run_op``), each as
        its tenant when there are ``namespaces``."""
        op = op or run_op
        tenant = lambda i: self.namespaces[i % len(self.namespaces)] if self.namespaces else None  # noqa: E731
        workers = [
            threading.Thread(target=self._thread, args=(ops, op, tenant(i)), daemon=True)
            for i, ops in enumerate(threads)
        ]
        for worker in workers:
            worker.start()
        deadline = time.monotonic() + RUN_S
        for worker in workers:
            worker.join(timeout=max(0.0, deadline - time.monotonic()))
        assert not any(w.is_alive() for w in workers), f"seed {self.seed}: a thread still runs after {RUN_S} s"

    def _thread(self, ops: list[Op], op: Callable[[Fuzz, Op], None], namespace: pic.Namespace | None) -> None:
        self._local.namespace = namespace
        for one in ops:
            start = time.monotonic()
            try:
                op(self, one)
            except Exception as exc:
                self.failures.append(Failure(one, exc, start, time.monotonic(), namespace=namespace))

    def base_ids(self) -> list[str]:
        """The base documents' ids in the calling thread's namespace."""
        namespace = self.namespace
        return self.ids if namespace is None else self._ids_of[namespace.name]

    def cache_ids(self, ask: Ask) -> list[str]:
        base = self.base_ids()
        return [base[i] for i in ask.chunks]

    def foreign_id(self) -> str | None:
        """A base chunk of another tenant's (``None`` without tenants): an id the calling thread may not link."""
        others = [ids for name, ids in self._ids_of.items() if self.namespace is None or name != self.namespace.name]
        return others[0][0] if self.namespaces and others else None

    def record(self, ids: list[str], ask: Ask, out: pic.Generation, start: float) -> None:
        finish = out.stats.finish_reason.value
        self.outcomes.append(
            Outcome(tuple(ids), ask, tuple(out.token_ids), out.text, finish, start, now(), namespace=self.namespace)
        )

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Around an operation's links, from its ``link`` call to the end of its generation (``parked``)."""
        start = now()
        try:
            yield
        finally:
            self.parked.append((threading.get_ident(), start, now()))

    def link(self, ask: Ask, ids: list[str] | None = None) -> pic.Linked:
        return self.engine.link(ids or self.cache_ids(ask), ask.query, policy=ask.policy, namespace=self.namespace)

    def new_document(self, seed: int) -> str:
        rng = random.Random(seed * 7919 + self.seed)
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40))) + "."

    # -- the invariants ---------------------------------------------------------------------------------------

    def check(self) -> None:
        """Assert every invariant of the module's docstring (on the idle engine)."""
        wrong = [f for f in self.failures if not self._allowed(f)]
        assert not wrong, f"seed {self.seed}: {len(wrong)} requests failed: " + "; ".join(
            f"{f.op.kind.value}: {type(f.error).__name__}: {str(f.error)[:200]}" for f in wrong[:6]
        )
        alone: dict[tuple, pic.Generation | None] = {}
        num_compared = 0
        for out in self.outcomes:
            key = (out.ids, out.ask.query, out.ask.policy, out.ask.max_new_tokens)
            if key not in alone:
                alone[key] = self._alone(out)
            if alone[key] is not None:
                self._same(out, alone[key])
                num_compared += 1
        # (a reference the quota refuses is not compared; most must be, or the check proves little)
        assert num_compared >= 0.8 * len(self.outcomes), f"seed {self.seed}: {num_compared} of {len(self.outcomes)}"
        self.check_rest()
        assert self.engine.link(self.ids, "The end").generate(4).stats.num_generated_tokens >= 1

    def _alone(self, out: Outcome) -> pic.Generation | None:
        """``out``'s request alone on the idle engine, as its tenant; ``None`` where the pool refuses it for the other
        tenants' resident chunks within their kv_share (the quota at work now, not then: what ``_allowed`` allows)."""
        try:
            linked = self.engine.link(list(out.ids), out.ask.query, policy=out.ask.policy, namespace=out.namespace)
        except KVPoolExhaustedError as error:
            if "kept for them" in str(error):
                return None
            raise
        return linked.generate(out.ask.max_new_tokens)

    def _same(self, out: Outcome, want: pic.Generation) -> None:
        got, expected = (out.tokens, tuple(want.token_ids)) if out.tokens is not None else (out.text, want.text)
        if out.finish == "kv_pool" and self._beside_parked(out.thread, out.start, out.end):
            assert expected[: len(got)] == got, f"seed {self.seed}: {out.ask}: {got!r} is not a start of {expected!r}"
            return
        assert got == expected, f"seed {self.seed}: {out.ask} ({out.finish}): {got!r} != alone {expected!r}"

    def _allowed(self, failure: Failure) -> bool:
        """Whether a failure is the request's own: a pool that cannot hold it (bad input: ``_bad`` checks it)."""
        if not isinstance(failure.error, KVPoolExhaustedError):
            return False
        if self._beside_parked(failure.thread, failure.start, failure.end):
            return True
        if "kept for them" in str(failure.error):
            # refused because other tenants' resident chunks were within their kv_share at that moment: the pool's
            # quota at work, which depends on what they had resident then, so a rerun alone later cannot repeat it
            return True
        try:  # the same operation alone, in process, as the same tenant
            with self.as_tenant(failure.namespace):
                run_op(self, failure.op)
        except KVPoolExhaustedError:
            return True
        return False

    def _beside_parked(self, thread: int, start: float, end: float) -> bool:
        """Whether another thread held links between ``start`` and ``end``."""
        return any(t != thread and s < end and start < e for t, s, e in self.parked)

    def check_rest(self, *, timeout_s: float = 30.0) -> None:
        """The pool at rest (aborts from closed connections may still be on their way: waited for)."""
        gc.collect()  # (a Linked dropped unreleased: its finalizer releases it)
        deadline = time.monotonic() + timeout_s
        while (stats := self.engine.kv_stats()).num_used_blocks:
            assert time.monotonic() < deadline, f"seed {self.seed}: {stats.num_used_blocks} blocks still in use"
            time.sleep(0.02)
        check_engine_pool(self.engine, {})


def now() -> float:
    return time.monotonic()


# -- the operations, in process -----------------------------------------------------------------------------------


def run_op(fuzz: Fuzz, op: Op) -> None:
    """One operation on ``fuzz.engine`` from this thread."""
    _OPS[op.kind](fuzz, op)


def _generate(fuzz: Fuzz, op: Op) -> None:
    ask, start = op.asks[0], now()
    with fuzz.held():
        out = fuzz.link(ask).generate(ask.max_new_tokens)
    fuzz.record(fuzz.cache_ids(ask), ask, out, start)


def _sample(fuzz: Fuzz, op: Op) -> None:
    ask = op.asks[0]
    with fuzz.held():
        out = fuzz.link(ask).generate(ask.max_new_tokens, temperature=0.8, seed=op.arg)
    assert 1 <= len(out.token_ids) <= ask.max_new_tokens


def _park(fuzz: Fuzz, op: Op) -> None:
    ask, start = op.asks[0], now()
    with fuzz.held():
        linked = fuzz.link(ask)
        time.sleep(op.arg / 1000)
        out = linked.generate(ask.max_new_tokens)
    fuzz.record(fuzz.cache_ids(ask), ask, out, start)


def _together(fuzz: Fuzz, op: Op) -> None:
    start, linked = now(), []
    with fuzz.held():
        try:
            for ask in op.asks:
                linked.append(fuzz.link(ask))
            outs = pic.generate_together(linked, op.asks[0].max_new_tokens)
        finally:
            for item in linked:
                item.release()  # (one that failed to link leaves the others parked)
    for ask, out in zip(op.asks, outs, strict=True):
        fuzz.record(fuzz.cache_ids(ask), ask, out, start)


def _stream(fuzz: Fuzz, op: Op) -> None:
    ask, start = op.asks[0], now()
    with fuzz.held():
        pieces, text = fuzz.link(ask).stream(ask.max_new_tokens), []
        while True:
            try:
                text.append(next(pieces))
            except StopIteration as stop:  # (the stream's return value: the generation)
                out = stop.value
                break
    assert "".join(text) == out.text
    fuzz.record(fuzz.cache_ids(ask), ask, out, start)


def _abort(fuzz: Fuzz, op: Op) -> None:
    with fuzz.held():
        pieces = fuzz.link(op.asks[0]).stream(400)
        for i, _ in enumerate(pieces):
            if i >= op.arg:
                break
        pieces.close()


def _release(fuzz: Fuzz, op: Op) -> None:
    with fuzz.held():
        fuzz.link(op.asks[0]).release()


def _compile(fuzz: Fuzz, op: Op) -> None:
    ask, start = op.asks[0], now()
    (new,) = fuzz.engine.compile([fuzz.new_document(op.arg)], policy=ask.policy, namespace=fuzz.namespace)
    ids = [*fuzz.cache_ids(ask)[:1], new]
    with fuzz.held():
        out = fuzz.link(ask, ids).generate(ask.max_new_tokens)
    fuzz.record(ids, ask, out, start)


def _many(fuzz: Fuzz, op: Op) -> None:
    start = now()
    options = {"namespace": fuzz.namespace}
    requests = [
        pic.Request(fuzz.cache_ids(a), a.query, policy=a.policy, max_new_tokens=a.max_new_tokens, **options)
        for a in op.asks
    ]
    for ask, out in zip(op.asks, fuzz.engine.generate_many(requests, progress=False), strict=True):
        fuzz.record(fuzz.cache_ids(ask), ask, out, start)


def unknown_id(engine: pic.PIC, seed: int) -> str:
    """The cache id of a chunk nobody compiled."""
    return chunk_id(engine.fingerprint, [5 + seed, 6, 7], engine.compile_options())


def _bad(fuzz: Fuzz, op: Op) -> None:
    """A request that must fail with its own error (and disturb nobody): an id nobody compiled, or (with tenants,
    every other time) another tenant's chunk, or an empty query."""
    ask, namespace = op.asks[0], fuzz.namespace
    foreign = fuzz.foreign_id() if op.arg % 4 == 1 else None
    try:
        if op.arg % 2:
            bad = foreign or unknown_id(fuzz.engine, op.arg)
            fuzz.engine.link([*fuzz.cache_ids(ask), bad], ask.query, namespace=namespace).generate(4)
        else:
            fuzz.engine.link(fuzz.cache_ids(ask), "", namespace=namespace).generate(4)
    except (InvalidInputError, UnknownCacheIdError):
        return
    raise AssertionError("a bad request was served")


_OPS: dict[Kind, Callable[[Fuzz, Op], None]] = {
    Kind.GENERATE: _generate, Kind.SAMPLE: _sample, Kind.PARK: _park, Kind.TOGETHER: _together,
    Kind.STREAM: _stream, Kind.ABORT: _abort, Kind.RELEASE: _release, Kind.COMPILE: _compile, Kind.MANY: _many,
    Kind.BAD: _bad,
}  # fmt: skip
