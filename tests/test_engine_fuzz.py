"""A seeded fuzzer of one engine, in process and through ``pic serve`` (issue 49; the machinery and the invariants:
tests/engine_fuzz.py).

Four threads mix links held parked, generations, ``generate_together``, streams, aborts, releases, new compiles
and bad requests over pools from tight (every step preempts) to roomy. On the engine before issue 49 (e3cc254 and
ed939b2) both tests failed at their first run (seed 1, a 256-token pool): a parked link whose generation had started
was preempted while its status said it was waiting, the assertion escaped the scheduler, and every open request
failed with it ("4 requests failed: together: AssertionError: Sequence(13, finished, 7 tokens); ...").
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable

import httpx
import pytest

import pic
from pic.errors import KVPoolExhaustedError
from pic.serve.app import build_app
from tests.conftest import make_engine
from tests.engine_fuzz import BASE_DOCS, Ask, Fuzz, Kind, Op, Outcome, now, plan, run_op, unknown_id
from tests.serving import serving

# (pool tokens, seed) of each run: tight pools preempt at every step, the last one never does.
RUNS = ((256, 1), (384, 2), (640, 3), (1024, 4), (4096, 5))
NUM_THREADS, NUM_OPS, MAX_TOKENS = 4, 7, 80


def fuzz_engine(pool: int) -> pic.PIC:
    """stories260K with a ``pool``-token KV pool; no EOS, so every generation runs its length."""
    return make_engine("stories260K", kv_pool_tokens=pool, block_size=16, eos_token_ids=())


def test_a_seeded_fuzz_of_one_engine_keeps_every_invariant():
    for pool, seed in RUNS:
        engine = fuzz_engine(pool)
        fuzz = Fuzz(engine, engine.compile(list(BASE_DOCS)), seed=seed)
        fuzz.run(plan(seed, num_threads=NUM_THREADS, num_ops=NUM_OPS, max_tokens=MAX_TOKENS))
        fuzz.check()
        engine.close()


def test_the_fuzz_with_tenants_keeps_every_invariant_and_their_chunks_apart():
    """The same load with each thread a tenant of its own over pools that preempt: two with shares of the pool and
    one a cap on its running requests, one without a quota. The owners' charges come back to rest with the blocks,
    every output equals its request alone (its tenant's), and a link of another tenant's chunk is unknown to it."""
    tenants = tuple(pic.Namespace(name, salt=name.encode() * 8) for name in ("t0", "t1", "t2"))
    quotas = {"t0": pic.Quota(kv_share=0.3), "t1": pic.Quota(kv_share=0.2, max_num_seqs=2)}
    for pool, seed in ((256, 11), (640, 12)):
        engine = make_engine("stories260K", kv_pool_tokens=pool, block_size=16, eos_token_ids=(), quotas=quotas)
        fuzz = Fuzz(engine, engine.compile(list(BASE_DOCS)), seed=seed, namespaces=tenants)
        fuzz.run(plan(seed, num_threads=NUM_THREADS, num_ops=NUM_OPS, max_tokens=MAX_TOKENS))
        fuzz.check()
        assert {o.namespace.name for o in fuzz.outcomes} == {"t0", "t1", "t2"}  # every tenant was served
        with fuzz.as_tenant(tenants[0]):
            foreign = fuzz.foreign_id()
        with pytest.raises(pic.UnknownCacheIdError):  # another tenant's base chunk, resident: unknown to t0
            engine.link([foreign], "The end", namespace=tenants[0])
        engine.close()


# -- the same load over HTTP -------------------------------------------------------------------------------------

HTTP_KINDS = {Kind.GENERATE, Kind.STREAM, Kind.ABORT, Kind.COMPILE, Kind.BAD}  # the others run in process


def _body(ask: Ask, ids: list[str], *, stream: bool = False, max_tokens: int | None = None) -> dict:
    return {
        "model": "stories260K", "prompt": ask.query, "max_tokens": max_tokens or ask.max_new_tokens,
        "temperature": 0, "stream": stream, "stream_options": {"include_usage": True} if stream else None,
        "pic": {"cache_ids": ids, "policy": ask.policy},
    }  # fmt: skip


def _checked(response: httpx.Response, read: Callable[[], bytes] | None = None) -> httpx.Response:
    """``response``, if it succeeded; a pool that could not hold the request (503) is the engine's
    ``KVPoolExhaustedError`` (judged as in process), anything else a failure."""
    if response.status_code != 200:
        body = (read or response.read)().decode()
        if response.status_code == 503 and "KV pool exhausted" in body:
            raise KVPoolExhaustedError(body)
        raise AssertionError(f"{response.status_code}: {body}")
    return response


def _no_error(event: dict) -> None:
    """Raises: a stream's error event, as ``_checked`` raises an error reply."""
    if "error" in event:
        message = event["error"].get("message", "")
        raise KVPoolExhaustedError(message) if "KV pool exhausted" in message else AssertionError(message)


def _complete(fuzz: Fuzz, http: httpx.Client, ask: Ask, ids: list[str], start: float) -> None:
    """A completion (streamed, for a query of odd length), recorded by its text; one that ended with fewer tokens
    than it asked for ended with the pool ("length" over HTTP, ``FinishReason.KV_POOL`` in process)."""
    if len(ask.query) % 2:
        text, usage = [], None
        with http.stream("POST", "/v1/completions", json=_body(ask, ids, stream=True)) as response:
            _checked(response, response.read)
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line.removeprefix("data: "))
                    _no_error(event)
                    text += [c["text"] for c in event["choices"]]
                    usage = event.get("usage") or usage
        text = "".join(text)
    else:
        response = _checked(http.post("/v1/completions", json=_body(ask, ids)))
        text, usage = response.json()["choices"][0]["text"], response.json()["usage"]
    finish = "kv_pool" if usage["completion_tokens"] < ask.max_new_tokens else "length"
    fuzz.outcomes.append(Outcome(tuple(ids), ask, None, text, finish, start, now()))


def http_op(url: str) -> Callable[[Fuzz, Op], None]:
    """``run_op`` with the kinds a server has sent over HTTP to ``url``."""
    local = threading.local()

    def op(fuzz: Fuzz, one: Op) -> None:
        if one.kind not in HTTP_KINDS:
            return run_op(fuzz, one)
        if not hasattr(local, "http"):
            local.http = httpx.Client(base_url=url, timeout=60)
        http, ask, start = local.http, one.asks[0], now()
        if one.kind is Kind.GENERATE or one.kind is Kind.STREAM:
            return _complete(fuzz, http, ask, fuzz.cache_ids(ask), start)
        if one.kind is Kind.COMPILE:
            body = {"documents": [fuzz.new_document(one.arg)], "policy": ask.policy}
            response = _checked(http.post("/v1/chunks", json=body))
            return _complete(fuzz, http, ask, [*fuzz.cache_ids(ask)[:1], *response.json()["cache_ids"]], start)
        if one.kind is Kind.BAD:
            ids = [*fuzz.cache_ids(ask), unknown_id(fuzz.engine, one.arg)]
            response = http.post("/v1/completions", json=_body(ask, ids))
            assert response.status_code == 404, response.text
            return None
        body = _body(ask, fuzz.cache_ids(ask), stream=True, max_tokens=400)  # ABORT: leave after a few
        with http.stream("POST", "/v1/completions", json=body) as response:
            _checked(response, response.read)
            for i, _ in enumerate(response.iter_lines()):
                if i >= one.arg:
                    break
        return None

    return op


def test_the_same_fuzz_through_pic_serve_keeps_every_invariant():
    for pool, seed in RUNS[:3]:
        engine = fuzz_engine(pool)
        fuzz = Fuzz(engine, engine.compile(list(BASE_DOCS)), seed=seed)
        with serving(build_app(engine, model_name="stories260K")) as url:
            fuzz.run(plan(seed, num_threads=NUM_THREADS, num_ops=NUM_OPS, max_tokens=MAX_TOKENS), op=http_op(url))
            fuzz.check()
        engine.close()
