"""``GET /metrics``: Prometheus text exposition (format 0.0.4), without a client library.

Counters and histograms are updated on the event loop's thread only (handlers and the engine task), so
they need no lock; store and KV-pool figures are read when scraped.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

from pic.kv import KVStats
from pic.link.generate import Generation
from pic.store.tier import TierStats

# Seconds: TTFT and link times from a millisecond to a minute.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class Histogram:
    """Cumulative-bucket histogram (``le`` buckets, ``+Inf`` implied)."""

    counts: list[int] = field(default_factory=lambda: [0] * len(BUCKETS))
    total: float = 0.0
    num: int = 0

    def observe(self, value: float) -> None:
        index = bisect.bisect_left(BUCKETS, value)
        if index < len(BUCKETS):
            self.counts[index] += 1
        self.total += value
        self.num += 1

    def lines(self, name: str) -> list[str]:
        out, running = [f"# TYPE {name} histogram"], 0
        for bound, count in zip(BUCKETS, self.counts, strict=True):
            running += count
            out.append(f'{name}_bucket{{le="{bound}"}} {running}')
        out += [f'{name}_bucket{{le="+Inf"}} {self.num}', f"{name}_sum {self.total}", f"{name}_count {self.num}"]
        return out


@dataclass
class Metrics:
    """What the server counts: HTTP requests by route and status, per-generation timings and tokens."""

    requests: Counter = field(default_factory=Counter)  # (route, status) -> count
    ttft: Histogram = field(default_factory=Histogram)
    link: Histogram = field(default_factory=Histogram)
    tokens: Counter = field(default_factory=Counter)  # "reused" / "recomputed" / "generated" / "prompt"

    def request(self, route: str, status: int) -> None:
        self.requests[(route, status)] += 1

    def generation(self, generation: Generation) -> None:
        stats = generation.stats
        self.ttft.observe(stats.ttft_s)
        self.link.observe(stats.link_s)
        self.tokens.update(
            reused=stats.num_reused_tokens,
            recomputed=stats.num_recomputed_tokens,
            generated=stats.num_generated_tokens,
            prompt=stats.num_prompt_tokens,
        )

    def render(self, *, tiers: list[TierStats], kv: KVStats, num_steps: int, num_batched_seqs: int) -> str:
        """The exposition text; ``num_steps`` / ``num_batched_seqs``: the engine's forwards and the
        sequences they carried (their ratio is the mean batch)."""
        lines = ["# TYPE pic_http_requests_total counter"]
        lines += [
            f'pic_http_requests_total{{route="{r}",status="{s}"}} {n}' for (r, s), n in sorted(self.requests.items())
        ]
        lines += self.ttft.lines("pic_ttft_seconds") + self.link.lines("pic_link_seconds")
        lines.append("# TYPE pic_tokens_total counter")
        lines += [
            f'pic_tokens_total{{kind="{k}"}} {self.tokens[k]}' for k in ("prompt", "reused", "recomputed", "generated")
        ]
        for metric, attr, kind in (
            ("pic_store_hits_total", "hits", "counter"),
            ("pic_store_misses_total", "misses", "counter"),
            ("pic_store_entries", "num_entries", "gauge"),
            ("pic_store_bytes", "num_bytes", "gauge"),
        ):
            lines.append(f"# TYPE {metric} {kind}")
            lines += [f'{metric}{{tier="{t.name}"}} {getattr(t, attr)}' for t in tiers]
        lines.append("# TYPE pic_kv_blocks gauge")
        for state, value in (
            ("total", kv.num_blocks), ("used", kv.num_used_blocks), ("free", kv.num_free_blocks),
            ("chunk", kv.num_chunk_blocks), ("private", kv.num_private_blocks),
            ("shared_refs", kv.num_shared_block_refs),
        ):  # fmt: skip
            lines.append(f'pic_kv_blocks{{state="{state}"}} {value}')
        lines += ["# TYPE pic_engine_steps_total counter", f"pic_engine_steps_total {num_steps}"]
        lines += ["# TYPE pic_engine_batched_seqs_total counter", f"pic_engine_batched_seqs_total {num_batched_seqs}"]
        return "\n".join(lines) + "\n"


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
            route = scope.get("route")
            self.metrics.request(getattr(route, "path", "unmatched"), status)
