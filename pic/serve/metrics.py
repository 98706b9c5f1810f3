"""``GET /metrics``: Prometheus exposition through ``prometheus_client``.

Each ``Metrics`` has its own ``CollectorRegistry``, never the process-wide default one, so that many apps
in one process (tests build many) neither collide on names nor share counts. Request, timing and token
metrics are updated as events happen; store, KV-pool and engine figures are the engine's, read once per
scrape from a snapshot callable, because only the engine's owner thread may look at its state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.routing import BaseRoute, Match

from pic.kv import KVStats
from pic.store.tier import TierStats

if TYPE_CHECKING:
    from pic import Generation

# Seconds: TTFT and link times from a millisecond to a minute.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_KINDS = ("prompt", "reused", "recomputed", "generated")
CONTENT_TYPE = CONTENT_TYPE_LATEST
_WRITABLE = "1 when the tier's writes work, 0 while they fail: a full or read-only disk, an unreachable Redis."


@dataclass(frozen=True)
class Unfinished:
    """A streamed generation its client left before the end: the tokens generated up to then (the engine's
    last output, with the prompt's token counts and the timings, goes unread once the stream is closed).

    Attributes:
        num_generated_tokens: the tokens the stream's outputs carried before the client left.
    """

    num_generated_tokens: int


@dataclass(frozen=True)
class EngineFigures:
    """What a scrape reads from the engine, taken at once so the figures agree with each other.

    Attributes:
        tiers: the store's tiers (``TieredStore.stats()``).
        kv: the KV block pool.
        num_steps / num_batched_seqs: the engine's forwards and the sequences they carried (their ratio is
            the mean batch).
    """

    tiers: tuple[TierStats, ...]
    kv: KVStats
    num_steps: int
    num_batched_seqs: int


class EngineCollector(Collector):
    """Scrape-time store, KV-pool and engine figures; ``figures`` is called once per ``collect()``."""

    def __init__(self, figures: Callable[[], EngineFigures]) -> None:
        self.figures = figures

    def describe(self) -> Iterator[Metric]:
        """The names alone, so registering checks them without asking the engine."""
        return self._families(None)

    def collect(self) -> Iterator[Metric]:
        return self._families(self.figures())

    @staticmethod
    def _families(figures: EngineFigures | None) -> Iterator[Metric]:
        for name, attr, family, doc in (
            ("pic_store_hits", "hits", CounterMetricFamily, "Store gets that found the chunk."),
            ("pic_store_misses", "misses", CounterMetricFamily, "Store gets that did not find the chunk."),
            ("pic_store_entries", "num_entries", GaugeMetricFamily, "Chunks the tier holds."),
            ("pic_store_bytes", "num_bytes", GaugeMetricFamily, "Bytes of K and V the tier holds."),
            ("pic_store_up", "up", GaugeMetricFamily, "1 when the tier answered this scrape, 0 when it is down."),
            ("pic_store_writable", "writable", GaugeMetricFamily, _WRITABLE),
            ("pic_store_errors", "errors", CounterMetricFamily, "Tier operations that failed."),
        ):
            metric = family(name, doc, labels=["tier"])
            for tier in figures.tiers if figures else ():
                metric.add_metric([tier.name], float(getattr(tier, attr)))
            yield metric
        kv = figures.kv if figures else None
        blocks = GaugeMetricFamily(
            "pic_kv_blocks", "KV pool blocks by state; the states partition the pool (they sum to pic_kv_pool_blocks): "
            "empty, evictable (a resident chunk nobody holds; reused once no block is empty), held_chunk (a resident "
            "chunk a request references or that is pinned), private (a request's own).", labels=["state"],
        )  # fmt: skip
        if kv:
            for state, value in (
                ("empty", kv.num_empty_blocks), ("evictable", kv.num_evictable_blocks),
                ("held_chunk", kv.num_held_chunk_blocks), ("private", kv.num_private_blocks),
            ):  # fmt: skip
                blocks.add_metric([state], value)
        yield blocks
        for name, attr, doc in (
            ("pic_kv_pool_blocks", "num_blocks", "Blocks in the KV pool."),
            ("pic_kv_shared_block_refs", "num_shared_block_refs", "Request block table references to chunk blocks."),
            ("pic_kv_resident_chunks", "num_resident_chunks", "Chunks whose blocks are in the KV pool."),
        ):
            yield GaugeMetricFamily(name, doc, value=getattr(kv, attr) if kv else None)
        steps, seqs = (figures.num_steps, figures.num_batched_seqs) if figures else (None, None)
        yield CounterMetricFamily("pic_engine_steps", "Engine forward steps.", value=steps)
        yield CounterMetricFamily("pic_engine_batched_seqs", "Sequences carried by engine steps.", value=seqs)


class Metrics:
    """What the server counts: HTTP requests by route and status, per-generation timings and tokens, and
    the engine's figures at scrape time. Thread-safe (``prometheus_client`` locks its values), so
    ``render`` may run in a worker thread while the event loop keeps counting."""

    def __init__(self, figures: Callable[[], EngineFigures]) -> None:
        self.registry = CollectorRegistry()
        # prometheus_client appends ``_total`` to counter names: these expose pic_http_requests_total etc.
        self.requests = Counter(
            "pic_http_requests", "HTTP responses by route template and status.", ["route", "status"],
            registry=self.registry,
        )  # fmt: skip
        self.ttft = Histogram("pic_ttft_seconds", "Time to first token.", buckets=BUCKETS, registry=self.registry)
        self.link = Histogram("pic_link_seconds", "Link time.", buckets=BUCKETS, registry=self.registry)
        self.tokens = Counter("pic_tokens", "Tokens by kind.", ["kind"], registry=self.registry)
        for kind in TOKEN_KINDS:
            self.tokens.labels(kind)  # present at 0 before the first generation
        self.registry.register(EngineCollector(figures))

    def request(self, route: str, status: int) -> None:
        self.requests.labels(route, str(status)).inc()

    def generation(self, generation: Generation | Unfinished) -> None:
        """Count a generation's timings and tokens; of an ``Unfinished`` one (a stream whose client left), the
        tokens it generated, which only it knows."""
        if isinstance(generation, Unfinished):
            self.tokens.labels("generated").inc(generation.num_generated_tokens)
            return
        stats = generation.stats
        self.ttft.observe(stats.ttft_s)
        self.link.observe(stats.link_s)
        for kind, num in zip(
            TOKEN_KINDS,
            (stats.num_prompt_tokens, stats.num_reused_tokens, stats.num_recomputed_tokens, stats.num_generated_tokens),
            strict=True,
        ):
            self.tokens.labels(kind).inc(num)

    def render(self) -> bytes:
        """The exposition (``CONTENT_TYPE``). Blocks while the engine answers its snapshot: call it from a
        worker thread, not the event loop."""
        return generate_latest(self.registry)


class RequestCounter:
    """ASGI middleware: counts every HTTP response by route template (bounded label values) and status."""

    def __init__(self, app, *, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def watch(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            self.metrics.request(route_label(scope), status)


def route_label(scope: dict) -> str:
    """The route template a request was answered by (``/v1/chunks/{cache_id}``), ``"unmatched"`` when none: the
    route routing recorded, else the app's route that matches the request (FastAPI records only its API routes,
    not the plain routes of ``/openapi.json``, ``/docs`` and ``/redoc``, which then counted as unmatched)."""
    route = scope.get("route")
    if route is None and "app" in scope:
        routes = getattr(getattr(scope["app"], "router", None), "routes", ())
        matches = [(r.matches(scope)[0], r) for r in routes if isinstance(r, BaseRoute)]
        route = next((r for match in (Match.FULL, Match.PARTIAL) for m, r in matches if m is match), None)
    return getattr(route, "path", "unmatched")
