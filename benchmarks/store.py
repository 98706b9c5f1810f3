"""Store throughput: the Redis tier against raw redis-py SET/GET of the same bytes, side by side.

python benchmarks/store.py                       # starts a local redis-server; writes benchmarks/results/store.json
python benchmarks/store.py --redis-url redis://host:6379/0 --tokens 256 2048

Chunks are shaped like a Llama-3-8B chunk (32 layers, 8 KV heads, head_dim 128, bfloat16: 128 KiB of
K and V per token). Each repetition times, in one round, raw ``SET``/``GET`` of the chunk's payload
as one value and the Redis tier's ``put``/``get`` (parts, checksum, metadata, validation, decode),
then the CPU tier, and where a GPU is present the copy of a chunk from the CPU tier to the GPU.
Ratios are raw time / tier time (>= 1 means the tier is as fast), medians over repetitions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import redis
import torch

from pic.compile.ids import chunk_id
from pic.config import CompileOptions, StoreConfig
from pic.kv import ChunkKV
from pic.store import LruTier, RedisTier
from pic.store.local_redis import LocalRedis
from pic.store.serde import Expected

LAYERS, KV_HEADS, HEAD_DIM, DTYPE = 32, 8, 128, torch.bfloat16
FINGERPRINT = "benchmark-llama3-8b-shape"


def make_chunk(num_tokens: int, seed: int) -> ChunkKV:
    tokens = torch.randint(3, 32000, (num_tokens,), generator=torch.Generator().manual_seed(seed))
    options = CompileOptions(add_bos=False)
    shape = (LAYERS, num_tokens, KV_HEADS, HEAD_DIM)
    k, v = (torch.randn(shape, dtype=torch.float32).to(DTYPE) for _ in range(2))
    return ChunkKV(chunk_id(FINGERPRINT, tokens.tolist(), options), tokens, k, v, options)


def timed(fn) -> float:
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
    cpu = LruTier("cpu", device=torch.device("cpu"), pin=torch.cuda.is_available())
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default=None, help="default: start a local redis-server")
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/store.json")
    args = parser.parse_args()
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
