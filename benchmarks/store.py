"""Store throughput: the Redis tier against raw redis-py SET/GET of the same bytes, side by side.

python benchmarks/store.py                       # starts a local redis-server; writes benchmarks/results/store.json
python benchmarks/store.py --redis-url redis://host:6379/0 --tokens 256 2048
python benchmarks/store.py --cluster              # a local 3-master cluster against a single local node;
                                                 # writes benchmarks/results/store_cluster.json

Chunks are shaped like a Llama-3-8B chunk (32 layers, 8 KV heads, head_dim 128, bfloat16: 128 KiB of
K and V per token). Each repetition times, in one round, raw ``SET``/``GET`` of the chunk's payload
as one value and the Redis tier's ``put``/``get`` (parts, checksum, metadata, validation, decode),
then the CPU tier, and where a GPU is present the copy of a chunk from the CPU tier to the GPU.
Ratios are raw time / tier time (>= 1 means the tier is as fast), medians over repetitions.

``--cluster`` answers issue 13's layout question with three measurements, interleaved the same way:
the Redis tier on one node against a 3-master cluster on loopback; raw pipelined SETs and GETs of a
chunk's parts with spread keys (no hash tag, the tier's layout) against keys sharing one ``{tag}``
(one slot, one node); and how many GETs each master serves when one hot chunk is read many times.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import redis
import torch
from redis.cluster import RedisCluster

from pic.config import CompileOptions, StoreConfig
from pic.ids import chunk_id
from pic.kv import ChunkKV
from pic.store import LruTier, RedisTier, serde
from pic.store.serde import Expected

# The local redis-server launcher is the tests' (tests/local_redis.py, not installed with pic): run from
# anywhere, the repository root must be importable for it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.local_redis import LocalRedis, LocalRedisCluster  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, DTYPE = 32, 8, 128, torch.bfloat16
FINGERPRINT = "benchmark-llama3-8b-shape"


def make_chunk(num_tokens: int, seed: int) -> ChunkKV:
    tokens = torch.randint(3, 32000, (num_tokens,), generator=torch.Generator().manual_seed(seed))
    options = CompileOptions(add_bos=False)
    shape = (LAYERS, num_tokens, KV_HEADS, HEAD_DIM)
    k, v = (torch.randn(shape, dtype=torch.float32).to(DTYPE) for _ in range(2))
    return ChunkKV(chunk_id(FINGERPRINT, tokens.tolist(), options), tokens, k, v, options)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def one_round(tier: RedisTier, client: redis.Redis, chunk: ChunkKV, payload: bytes) -> dict[str, float]:
    """Seconds of each operation, raw and through the tiers, run back to back."""
    tier.delete(chunk.cache_id)
    client.delete("raw")
    times = {"raw_set": timed(lambda: client.set("raw", payload)), "tier_put": timed(lambda: tier.put(chunk))}
    times["raw_get"] = timed(lambda: client.get("raw"))
    got: list[ChunkKV] = []
    times["tier_get"] = timed(lambda: got.append(tier.get(chunk.cache_id)))
    assert torch.equal(got[0].k, chunk.k) and torch.equal(got[0].v, chunk.v), "the Redis tier changed the chunk"
    cpu = LruTier(pin=torch.cuda.is_available())
    times["cpu_put"] = timed(lambda: cpu.put(got[0]))
    times["cpu_get"] = timed(lambda: cpu.get(chunk.cache_id))
    if torch.cuda.is_available():
        pinned = cpu.get(chunk.cache_id)
        times["h2d_pinned"] = timed(lambda: (pinned.to("cuda", non_blocking=True), torch.cuda.synchronize()))
        times["h2d_pageable"] = timed(lambda: (chunk.to("cuda"), torch.cuda.synchronize()))
    return times


def bench_size(tier: RedisTier, client: redis.Redis, num_tokens: int, reps: int) -> dict:
    chunk = make_chunk(num_tokens, seed=num_tokens)
    payload = torch.cat([chunk.k.flatten(), chunk.v.flatten()]).view(torch.uint8).numpy().tobytes()
    rounds = [one_round(tier, client, chunk, payload) for _ in range(reps)]
    times = {name: [r[name] for r in rounds] for name in rounds[0]}
    median = {name: statistics.median(values) for name, values in times.items()}
    result = {
        "num_tokens": num_tokens,
        "num_bytes": chunk.num_bytes,
        "num_parts": -(-chunk.num_bytes // 2 // tier.part_bytes) * 2,
        "reps": reps,
        "median_s": median,
        "put_ratio_raw_over_tier": median["raw_set"] / median["tier_put"],
        "get_ratio_raw_over_tier": median["raw_get"] / median["tier_get"],
    }
    if torch.cuda.is_available():
        result["h2d_pinned_speedup"] = median["h2d_pageable"] / median["h2d_pinned"]
    return result


def _alternating(reps: int, first: Callable[[], dict], second: Callable[[], dict]) -> dict[str, float]:
    """Median seconds of each key over ``reps`` rounds of both, the order swapped each round (neither
    always runs on a warmer or colder server)."""
    rounds: list[dict[str, float]] = []
    for rep in range(reps):
        a, b = (first, second) if rep % 2 == 0 else (second, first)
        rounds.append(a() | b())
    return {name: statistics.median(r[name] for r in rounds) for name in rounds[0]}


def tier_round(tier: RedisTier, chunk: ChunkKV, label: str) -> dict[str, float]:
    """The Redis tier's put then get of ``chunk``, checked, as ``{label}_put`` and ``{label}_get``."""
    tier.delete(chunk.cache_id)
    times = {f"{label}_put": timed(lambda: tier.put(chunk))}
    got: list[ChunkKV | None] = []
    times[f"{label}_get"] = timed(lambda: got.append(tier.get(chunk.cache_id)))
    assert got[0] is not None and torch.equal(got[0].k, chunk.k), f"the {label} tier changed the chunk"
    return times


def part_keys(cache_id: str, num_parts: int, *, tagged: bool) -> list[str]:
    """The tier's part keys (``tagged``: with ``{cache_id}`` as a hash tag, so they share one slot)."""
    name = f"{{{cache_id}}}" if tagged else cache_id
    return [f"pic-bench-raw:{name}:part:{i}" for i in range(num_parts)]


def raw_round(client: RedisCluster, keys: list[str], parts: list[memoryview], label: str) -> dict[str, float]:
    """Pipelined SETs of the parts, then one GET each (as the tier reads), checked."""
    for key in keys:  # one DEL each: a multi-key DEL of spread keys is CROSSSLOT
        client.delete(key)
    pipe = client.pipeline(transaction=False)
    for key, part in zip(keys, parts, strict=True):
        pipe.set(key, part)
    times = {f"{label}_set": timed(pipe.execute)}
    got: list[bytes] = []
    times[f"{label}_get"] = timed(lambda: got.extend(client.get(k) for k in keys))
    assert all(g == bytes(p) for g, p in zip(got, parts, strict=True)), f"{label} parts changed"
    return times


def gets_per_node(cluster: LocalRedisCluster, read: Callable[[], object], reads: int) -> dict[str, int]:
    """GET commands each master served (INFO commandstats, reset first) while ``read`` ran ``reads`` times."""
    for port in cluster.ports:
        cluster.client(port).config_resetstat()
    for _ in range(reads):
        read()
    stats = {port: cluster.client(port).info("commandstats").get("cmdstat_get", {}) for port in cluster.ports}
    return {str(port): int(s.get("calls", 0)) for port, s in stats.items()}


def load_spread(cluster: LocalRedisCluster, tier: RedisTier, client: RedisCluster, chunk: ChunkKV, reads: int) -> dict:
    """Per-master GETs and bytes while one hot chunk is read ``reads`` times: tier, raw spread, raw tagged."""
    parts = serde.encode(chunk, fingerprint=FINGERPRINT, part_bytes=tier.part_bytes).parts
    tier.put(chunk)
    result: dict = {"num_tokens": chunk.num_tokens, "num_parts": len(parts), "reads": reads, "gets_per_node": {}}
    result["gets_per_node"]["tier"] = gets_per_node(cluster, lambda: tier.get(chunk.cache_id), reads)
    result["bytes_per_node"] = {}
    for label in ("spread", "tagged"):
        keys = part_keys(chunk.cache_id, len(parts), tagged=label == "tagged")
        raw_round(client, keys, parts, label)
        result["gets_per_node"][label] = gets_per_node(cluster, lambda k=keys: [client.get(x) for x in k], reads)
        served = dict.fromkeys(map(str, cluster.ports), 0)
        for key, part in zip(keys, parts, strict=True):
            served[str(client.get_node_from_key(key).port)] += len(part) * reads
        result["bytes_per_node"][label] = served
    result["busiest_node_share"] = {
        label: max(counts.values()) / sum(counts.values()) for label, counts in result["gets_per_node"].items()
    }
    return result


def bench_cluster_size(tiers: dict[str, RedisTier], client: RedisCluster, num_tokens: int, reps: int) -> dict:
    """One chunk size: the tier on one node and on the cluster; raw spread against tagged parts."""
    chunk = make_chunk(num_tokens, seed=num_tokens)
    parts = serde.encode(chunk, fingerprint=FINGERPRINT, part_bytes=tiers["single"].part_bytes).parts
    tier = _alternating(reps, *(lambda t=t, n=n: tier_round(t, chunk, n) for n, t in tiers.items()))
    spread, tagged = (part_keys(chunk.cache_id, len(parts), tagged=t) for t in (False, True))
    raw = _alternating(
        reps, lambda: raw_round(client, spread, parts, "spread"), lambda: raw_round(client, tagged, parts, "tagged")
    )
    return {
        "num_tokens": num_tokens,
        "num_bytes": chunk.num_bytes,
        "num_parts": len(parts),
        "reps": reps,
        "median_s": tier | raw,
        "tier_put_ratio_single_over_cluster": tier["single_put"] / tier["cluster_put"],
        "tier_get_ratio_single_over_cluster": tier["single_get"] / tier["cluster_get"],
        "raw_set_ratio_tagged_over_spread": raw["tagged_set"] / raw["spread_set"],
        "raw_get_ratio_tagged_over_spread": raw["tagged_get"] / raw["spread_get"],
    }


def cluster_main(args: argparse.Namespace) -> None:
    """``--cluster``: start one node and a 3-master cluster locally, measure, write the JSON."""
    tokens = args.tokens or ([4, 40] if args.quick else [256, 1024])
    reps, reads = (1, 3) if args.quick else (args.reps, args.reads)
    part_bytes = 2**18 if args.quick else StoreConfig().part_bytes  # --quick: 40 tokens still make 20 parts
    out = Path(args.out or "benchmarks/results/store_cluster.json")
    expected = Expected(FINGERPRINT, LAYERS, KV_HEADS, HEAD_DIM, DTYPE, max_tokens=max(tokens), vocab_size=32000)
    with LocalRedis() as single, LocalRedisCluster(masters=3) as cluster:
        tiers = {
            label: RedisTier(url, expected=expected, namespace="pic-bench", part_bytes=part_bytes, timeout_s=120)
            for label, url in (("single", single.url), ("cluster", cluster.url))
        }
        client = RedisCluster(host="127.0.0.1", port=cluster.ports[0], socket_timeout=120)
        results = [bench_cluster_size(tiers, client, n, reps) for n in tokens]
        load = load_spread(cluster, tiers["cluster"], client, make_chunk(max(tokens), seed=max(tokens)), reads)
        version = single.client().info("server").get("redis_version")
    report = {
        "command": " ".join(["python", Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "redis_version": version,
        "cluster": "3 masters, no replicas, loopback, same machine as the client",
        "chunk_shape": {"layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": str(DTYPE)},
        "part_bytes": part_bytes,
        "results": results,
        "load_spread": load,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    for r in results:
        print(
            f"{r['num_tokens']:5d} tokens ({r['num_parts']} parts): tier single/cluster put "
            f"{r['tier_put_ratio_single_over_cluster']:.2f}x get {r['tier_get_ratio_single_over_cluster']:.2f}x; "
            f"raw tagged/spread set {r['raw_set_ratio_tagged_over_spread']:.2f}x "
            f"get {r['raw_get_ratio_tagged_over_spread']:.2f}x"
        )
    print(f"GETs per master, {reads} reads of a hot chunk: {load['gets_per_node']}")
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default=None, help="default: start a local redis-server")
    parser.add_argument("--tokens", type=int, nargs="+", default=None, help="default: 256 2048 (--cluster: 256 1024)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--cluster", action="store_true", help="one local node against a local 3-master cluster")
    parser.add_argument("--reads", type=int, default=20, help="--cluster: reads of the hot chunk")
    parser.add_argument("--quick", action="store_true", help="--cluster: tiny sizes, for the tests")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/store[_cluster].json")
    args = parser.parse_args()
    if args.cluster:
        return cluster_main(args)
    args.tokens, args.out = args.tokens or [256, 2048], args.out or "benchmarks/results/store.json"
    local = None if args.redis_url else LocalRedis().start()
    url = args.redis_url or local.url
    try:
        expected = Expected(
            FINGERPRINT, LAYERS, KV_HEADS, HEAD_DIM, DTYPE, max_tokens=max(args.tokens), vocab_size=32000
        )
        part_bytes = StoreConfig().part_bytes
        tier = RedisTier(url, expected=expected, namespace="pic-bench", part_bytes=part_bytes, timeout_s=120)
        client = redis.Redis.from_url(url, socket_timeout=120)
        results = [bench_size(tier, client, n, args.reps) for n in args.tokens]
        client.delete("raw")
        for n in args.tokens:
            tier.delete(make_chunk(n, seed=n).cache_id)
        server = client.info("server")
    finally:
        if local is not None:
            local.stop()
    report = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        },
        "redis_version": server.get("redis_version"),
        "redis_local": local is not None,
        "chunk_shape": {"layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": str(DTYPE)},
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    for r in results:
        print(
            f"{r['num_tokens']:5d} tokens ({r['num_bytes'] / 2**20:.0f} MiB, {r['num_parts']} parts): Redis tier / "
            f"raw redis-py: put {r['put_ratio_raw_over_tier']:.2f}x, get {r['get_ratio_raw_over_tier']:.2f}x"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
