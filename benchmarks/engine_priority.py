"""Time to first token of requests that arrive during a bulk compile, first come first served against requests
first (``PICConfig.prefill_order``), in one run.

python benchmarks/engine_priority.py --out benchmarks/results/engine_priority.json
python benchmarks/engine_priority.py --docs 60 --requests 4 --out ...   # tests/test_scheduling.py's case

Issue 43: prefill work was served first come first served, so a request that arrived during a compile of many
documents got its first token when the compile was done. On the embedded stories260K (``pic.load``), CPU, torch
on one thread, one engine per order (``"arrival"``: the old scheduling; ``"interactive"``: the default now),
rounds interleaved A B A B:

- *alone*: a default request (the default policy, two small compiled chunks, one new token:
  ``generate_many``; ``--requests N``: N such requests sent together, the time until all have theirs) with nothing
  else running, 5 times per round;
- *during*: while one ``PIC.compile`` of ``--docs`` new documents of about 290 tokens runs (in a thread), the
  same request again and again, each sent 50 ms after the last answered, from the compile's second chunk to its
  end (first come first served, that is one request per round: it waits for the rest of the compile);
- meanwhile one stream (``Linked.stream``) runs through each round: its longest gap inside the compile window.

Reported per order: TTFT p50/p90/max alone and during the compile (ms), p50 during / p50 alone, the compile's
wall time, the stream's longest gap. Only public API.

``--http``: the issue's server case besides, per order: a real ``pic serve --prefill-order ORDER`` process; one
``POST /v1/chunks`` of ``--http-docs`` documents of about 400 tokens, and 1 s after it a streaming completion
without documents: its first token's time against the same completion alone.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import threading
import time
from itertools import pairwise
from pathlib import Path

import httpx
import torch

import pic

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from engine_flood import DOC_BLOCK_TOKENS, STREAM_CHUNKS, machine, make_docs, quantile, write_report  # noqa: E402  (same documents and chunks)

ORDERS = ("arrival", "interactive")


def first_token_s(engine: pic.PIC, ids: list[str], num_requests: int = 1) -> float:
    """Seconds until ``num_requests`` default requests sent together all have their first token (their only one)."""
    start = time.perf_counter()
    queries = ["One day,", "Once upon a time,", "Then", "The next day,"]
    requests = [pic.Request(ids, queries[i % len(queries)], max_new_tokens=1) for i in range(num_requests)]
    engine.generate_many(requests, progress=False)
    return time.perf_counter() - start


def stream_until(engine: pic.PIC, ids: list[str], stop: threading.Event, times: list[float]) -> None:
    """Stream tokens until ``stop``, recording when each piece arrived (linking again when a generation ends)."""
    while not stop.is_set():
        for _ in engine.link(ids, "Once upon a time,", policy="naive").stream(max_new_tokens=400):
            times.append(time.perf_counter())
            if stop.is_set():
                break


def one_round(engine: pic.PIC, ids: list[str], tag: str, num_docs: int, num_requests: int = 1) -> dict:
    """Alone TTFTs, then a compile with requests arriving during it and a stream running through it."""
    alone = [first_token_s(engine, ids, num_requests) for _ in range(5)]
    stop, times = threading.Event(), []
    streamer = threading.Thread(target=stream_until, args=(engine, ids, stop, times))
    streamer.start()
    time.sleep(0.2)
    docs = make_docs(tag, seed=0)[:num_docs]
    window: dict[str, float] = {}

    def compile_docs() -> None:
        window["start"] = time.perf_counter()
        engine.compile(docs, progress=False)
        window["end"] = time.perf_counter()

    compiling = threading.Thread(target=compile_docs)
    num_before = engine.kv_stats().num_resident_chunks
    compiling.start()
    during = []
    while engine.kv_stats().num_resident_chunks < num_before + 2 and compiling.is_alive():
        time.sleep(0.005)  # the compile's prefills are under way
    while compiling.is_alive():  # (each request is sent while the compile runs)
        during.append(first_token_s(engine, ids, num_requests))
        time.sleep(0.05)
    compiling.join()
    stop.set()
    streamer.join(60)
    inside = [t for t in times if window["start"] <= t <= window["end"]]
    gaps = [b - a for a, b in pairwise([window["start"], *inside, window["end"]])]
    return {"alone": alone, "during": during, "compile_s": window["end"] - window["start"], "stream_gap": max(gaps)}


def stream_first_token_s(http: httpx.Client) -> float:
    """Seconds until a streaming completion without documents sends its first token."""
    body = {"model": "stories260K", "prompt": "Once upon a time,", "max_tokens": 8, "stream": True}
    start = time.perf_counter()
    with http.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - start
    raise RuntimeError("the completion sent no token")


def http_case(order: str, num_docs: int) -> dict:
    """``pic serve --prefill-order order``: a completion sent 1 s into a ``POST /v1/chunks`` of ``num_docs``."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    pool = str(num_docs * 480 + 16384)  # every chunk resident (no lower tier to take them): ~29 blocks of 16 each
    cmd = [sys.executable, "-m", "pic", "serve", "--port", str(port), "--prefill-order", order, "--skip-check"]
    cmd += ["--kv-pool-tokens", pool]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as http:
            while True:
                try:
                    if http.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.2)
            alone = sorted(stream_first_token_s(http) for _ in range(5))[2]
            words = make_docs(order, seed=1) * (num_docs // 200 + 1)
            docs = [f"{i}: {w} {w[-200:]}" for i, w in enumerate(words[:num_docs])]  # ~400 tokens each, all new
            done: dict[str, float] = {}

            def post() -> None:
                start = time.perf_counter()
                with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as bulk:
                    response = bulk.post("/v1/chunks", json={"documents": docs})
                    assert response.status_code == 200, response.text[:300]
                done["compile_s"] = time.perf_counter() - start

            poster = threading.Thread(target=post)
            poster.start()
            time.sleep(1.0)
            during = stream_first_token_s(http)
            poster.join()
    finally:
        server.terminate()
        server.wait(30)
    return {"alone_s": alone, "during_s": during, "compile_s": done["compile_s"], "num_docs": num_docs}


def summary(values: list[float]) -> dict:
    ms = [1000 * v for v in values]
    return {"p50": statistics.median(ms), "p90": quantile(ms, 0.9), "max": max(ms), "n": len(ms)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(HERE / "results" / "engine_priority.json"))
    parser.add_argument("--rounds", type=int, default=3, help="rounds per order, interleaved")
    parser.add_argument("--docs", type=int, default=200, help="documents per compile (at most 200)")
    parser.add_argument("--http", action="store_true", help="also the server case (a pic serve process per order)")
    parser.add_argument("--http-docs", type=int, default=1024, help="documents of the server's POST /v1/chunks")
    parser.add_argument("--step-tokens", type=int, default=None, help="PICConfig.max_num_batched_tokens (default: the engine's)")
    parser.add_argument("--requests", type=int, default=1, help="requests sent together per first-token time (4: as "
                        "tests/test_scheduling.py sends them)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    began = time.perf_counter()
    pool = (args.rounds + 1) * args.docs * DOC_BLOCK_TOKENS  # every round's chunks stay resident (none evicted)
    config = {"eos_token_ids": (), "kv_pool_tokens": pool, "max_num_batched_tokens": args.step_tokens}
    engines = {o: pic.load(config=pic.PICConfig(prefill_order=o, **config)) for o in ORDERS}
    ids = {o: e.compile(STREAM_CHUNKS[:2], progress=False) for o, e in engines.items()}
    raw: dict[str, list[dict]] = {o: [] for o in ORDERS}
    for r in range(args.rounds):
        for order in ORDERS:
            row = one_round(engines[order], ids[order], f"{order}-{r}", args.docs, args.requests)
            raw[order].append(row)
            print(
                f"round {r} {order}: compile {row['compile_s']:.2f} s; TTFT ms alone "
                f"{1000 * statistics.median(row['alone']):.1f}, during (n={len(row['during'])}) "
                f"{[round(1000 * d) for d in row['during'][:8]]}; stream gap {1000 * row['stream_gap']:.0f} ms",
                flush=True,
            )
    report: dict = {"orders": {}, "num_requests": args.requests}
    for order in ORDERS:
        alone = [v for row in raw[order] for v in row["alone"]]
        during = [v for row in raw[order] for v in row["during"]]
        report["orders"][order] = {
            "ttft_alone_ms": summary(alone),
            "ttft_during_compile_ms": summary(during),
            "p50_during_over_alone": statistics.median(during) / statistics.median(alone),
            "compile_s": statistics.median(row["compile_s"] for row in raw[order]),
            "stream_longest_gap_ms": 1000 * max(row["stream_gap"] for row in raw[order]),
        }
        o = report["orders"][order]
        print(
            f"{order}: TTFT p50 alone {o['ttft_alone_ms']['p50']:.1f} ms, during a compile "
            f"{o['ttft_during_compile_ms']['p50']:.1f} ms (p90 {o['ttft_during_compile_ms']['p90']:.1f}, max "
            f"{o['ttft_during_compile_ms']['max']:.1f}; {o['p50_during_over_alone']:.1f}x alone); compile "
            f"{o['compile_s']:.2f} s; stream's longest gap {o['stream_longest_gap_ms']:.0f} ms"
        )
    for engine in engines.values():
        engine.close()
    if args.http:
        report["http"] = {order: http_case(order, args.http_docs) for order in ORDERS}
        for order, row in report["http"].items():
            print(
                f"http {order}: POST /v1/chunks of {row['num_docs']} documents took {row['compile_s']:.1f} s; a "
                f"completion sent 1 s in: first token at {row['during_s']:.2f} s (alone {row['alone_s']:.3f} s)"
            )
    report |= {
        "model": "stories260K (embedded), float32, CPU",
        "torch_threads": torch.get_num_threads(),
        "docs_per_compile": args.docs,
        "rounds": args.rounds,
        "machine": machine(),
        "command": " ".join(["python", *sys.argv]),
        "raw_s": raw,
        "wall_s": time.perf_counter() - began,
    }
    write_report(report, args.out)


if __name__ == "__main__":
    main()
