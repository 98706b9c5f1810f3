"""``pic.serve.metrics`` on ``prometheus_client``: names, labels and values of the exposition, read back
with the client's own parser, and per-instance registries that do not share counts."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from pic import FinishReason, Generation, GenerationStats
from pic.kv import KVStats
from pic.serve.metrics import BUCKETS, CONTENT_TYPE, EngineFigures, Metrics, RequestCounter
from pic.store.tier import TierStats

KV = KVStats(
    num_blocks=64, num_empty_blocks=38, num_evictable_blocks=2, num_held_chunk_blocks=8, num_private_blocks=16,
    num_shared_block_refs=7, num_resident_chunks=3, num_evicted_chunks=1, peak_used_blocks=30,
)  # fmt: skip
TIERS = (
    TierStats("device", num_entries=3, num_bytes=4096, hits=5, misses=2),
    TierStats("cpu", num_entries=1, num_bytes=1024, hits=1, misses=4),
)


def _figures() -> EngineFigures:
    return EngineFigures(tiers=TIERS, kv=KV, num_steps=12, num_batched_seqs=30)


def _generation(ttft_s: float, link_s: float) -> Generation:
    stats = GenerationStats(
        num_prompt_tokens=20, num_recomputed_tokens=6, num_reused_tokens=14, num_generated_tokens=4,
        link_s=link_s, ttft_s=ttft_s, decode_s=0.1, finish_reason=FinishReason.LENGTH,
    )  # fmt: skip
    return Generation(text="abcd", token_ids=[1, 2, 3, 4], ttft_s=ttft_s, stats=stats)


def _samples(metrics: Metrics) -> tuple[dict[str, str], dict[tuple, float]]:
    """Family name -> type, and (sample name, sorted labels) -> value."""
    families = list(text_string_to_metric_families(metrics.render().decode()))
    types = {family.name: family.type for family in families}
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value for family in families for s in family.samples}
    return types, values


def test_exposition_names_labels_and_values() -> None:
    metrics = Metrics(_figures)
    metrics.request("/v1/completions", 200)
    metrics.request("/v1/completions", 200)
    metrics.request("unmatched", 404)
    metrics.generation(_generation(ttft_s=0.02, link_s=0.004))
    metrics.generation(_generation(ttft_s=3.0, link_s=0.5))
    types, values = _samples(metrics)

    assert types["pic_http_requests"] == types["pic_tokens"] == "counter"
    assert values[("pic_http_requests_total", (("route", "/v1/completions"), ("status", "200")))] == 2
    assert values[("pic_http_requests_total", (("route", "unmatched"), ("status", "404")))] == 1
    for kind, per_generation in (("prompt", 20), ("reused", 14), ("recomputed", 6), ("generated", 4)):
        assert values[("pic_tokens_total", (("kind", kind),))] == 2 * per_generation

    assert types["pic_ttft_seconds"] == types["pic_link_seconds"] == "histogram"
    assert values[("pic_ttft_seconds_count", ())] == 2 and values[("pic_ttft_seconds_sum", ())] == 3.02
    assert values[("pic_ttft_seconds_bucket", (("le", "0.025"),))] == 1
    assert values[("pic_ttft_seconds_bucket", (("le", "2.5"),))] == 1
    assert values[("pic_ttft_seconds_bucket", (("le", "5.0"),))] == 2
    assert values[("pic_link_seconds_bucket", (("le", "0.005"),))] == 1
    assert values[("pic_link_seconds_bucket", (("le", "+Inf"),))] == 2
    assert {le for (name, labels) in values if name == "pic_ttft_seconds_bucket" for _, le in labels} == {
        *(str(float(b)) for b in BUCKETS),
        "+Inf",
    }

    for metric, attr, kind in (
        ("pic_store_hits", "hits", "counter"),
        ("pic_store_misses", "misses", "counter"),
        ("pic_store_entries", "num_entries", "gauge"),
        ("pic_store_bytes", "num_bytes", "gauge"),
    ):
        assert types[metric] == kind
        sample = f"{metric}_total" if kind == "counter" else metric
        for tier in TIERS:
            assert values[(sample, (("tier", tier.name),))] == getattr(tier, attr)

    assert types["pic_kv_blocks"] == "gauge"
    blocks = {dict(labels)["state"]: v for (name, labels), v in values.items() if name == "pic_kv_blocks"}
    assert blocks == {"empty": 38, "evictable": 2, "held_chunk": 8, "private": 16}
    assert sum(blocks.values()) == values[("pic_kv_pool_blocks", ())] == 64  # the states partition the pool
    assert values[("pic_kv_shared_block_refs", ())] == 7 and values[("pic_kv_resident_chunks", ())] == 3
    assert values[("pic_engine_steps_total", ())] == 12 and values[("pic_engine_batched_seqs_total", ())] == 30
    assert CONTENT_TYPE.startswith("text/plain")


def test_tokens_present_before_any_generation_and_figures_read_per_scrape() -> None:
    calls = []

    def figures() -> EngineFigures:
        calls.append(1)
        return EngineFigures(tiers=(), kv=KV, num_steps=len(calls), num_batched_seqs=0)

    metrics = Metrics(figures)
    assert not calls  # registering does not ask the engine
    _, values = _samples(metrics)
    assert all(
        values[("pic_tokens_total", (("kind", k),))] == 0 for k in ("prompt", "reused", "recomputed", "generated")
    )
    assert values[("pic_engine_steps_total", ())] == 1
    assert _samples(metrics)[1][("pic_engine_steps_total", ())] == 2


def test_instances_do_not_share_counts() -> None:
    first, second = Metrics(_figures), Metrics(_figures)
    first.request("/health", 200)
    first.generation(_generation(ttft_s=0.1, link_s=0.01))
    _, values = _samples(second)
    assert ("pic_http_requests_total", (("route", "/health"), ("status", "200"))) not in values
    assert values[("pic_ttft_seconds_count", ())] == 0 and values[("pic_tokens_total", (("kind", "prompt"),))] == 0
    assert _samples(first)[1][("pic_ttft_seconds_count", ())] == 1


def test_request_counter_middleware_counts_route_template_and_status() -> None:
    metrics = Metrics(_figures)

    class Route:
        path = "/v1/chunks/{cache_id}"

    async def app(scope, receive, send) -> None:
        scope["route"] = Route()
        await send({"type": "http.response.start", "status": 404})

    async def failing(scope, receive, send) -> None:
        raise RuntimeError

    async def send(message) -> None:
        pass

    async def run() -> None:
        await RequestCounter(app, metrics=metrics)({"type": "http"}, None, send)
        try:
            await RequestCounter(failing, metrics=metrics)({"type": "http"}, None, send)
        except RuntimeError:
            pass

    asyncio.run(run())
    _, values = _samples(metrics)
    assert values[("pic_http_requests_total", (("route", "/v1/chunks/{cache_id}"), ("status", "404")))] == 1
    assert values[("pic_http_requests_total", (("route", "unmatched"), ("status", "500")))] == 1
