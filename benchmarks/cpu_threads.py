"""How torch's thread count changes CPU link and decode times, on an idle and on a busy machine.

python benchmarks/cpu_threads.py                   # writes benchmarks/results/cpu_threads.json

For each condition (idle; busy: another process spinning on one core) it links the same prompt and
generates from it, alternating 1 and N torch threads (A B A B ...), and reports the medians and the
ratio of N threads over 1. On the embedded stories260K (a 260K-parameter model) a forward is far too
small to split across threads, so more threads only add synchronisation, and when a core is taken by
other work each synchronisation waits for a descheduled thread.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import pic

DOCS = [
    "Tom had a big red ball. He liked to kick it in the park with his dog, Max.",
    "Lily loved to sing. Every morning she sang a happy song for her mom and dad.",
    "A little bird fell from its nest. It was sad because it could not fly yet.",
]
QUERY = "One day, Tom and Lily found the little bird. They"


def one_run(engine: pic.PIC, ids: list[str], num_threads: int, num_tokens: int) -> dict[str, float]:
    """Seconds of one link (legolink:16) and per generated token, with ``num_threads`` torch threads."""
    torch.set_num_threads(num_threads)
    start = time.perf_counter()
    linked = engine.link(ids, QUERY)
    linked_at = time.perf_counter()
    out = linked.generate(max_new_tokens=num_tokens)
    assert len(out.token_ids) == num_tokens, out.stats.finish_reason
    return {"link_s": linked_at - start, "decode_s_per_token": out.stats.decode_s / (num_tokens - 1)}


def measure(engine: pic.PIC, ids: list[str], threads: list[int], reps: int, num_tokens: int) -> dict:
    runs: dict[int, list[dict[str, float]]] = {n: [] for n in threads}
    for _ in range(reps):
        for n in threads:  # interleaved, so drift hits every thread count alike
            runs[n].append(one_run(engine, ids, n, num_tokens))
    medians = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in runs.items()}
    base = medians[threads[0]]
    return {
        "median_s": {str(n): m for n, m in medians.items()},
        "ratio_over_1_thread": {str(n): {k: m[k] / base[k] for k in m} for n, m in medians.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, os.cpu_count() or 2])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per run")
    parser.add_argument("--out", default="benchmarks/results/cpu_threads.json")
    args = parser.parse_args()

    engine = pic.PIC.from_pretrained(device="cpu", config=pic.PICConfig(eos_token_ids=()))
    ids = engine.compile(DOCS)
    one_run(engine, ids, 1, args.tokens)  # warm-up
    conditions = {"idle": measure(engine, ids, args.threads, args.reps, args.tokens)}
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # one core taken by other work
    try:
        time.sleep(0.5)
        conditions["busy"] = measure(engine, ids, args.threads, args.reps, args.tokens)
    finally:
        hog.kill()
    report = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "model": "stories260K (embedded), float32",
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "reps": args.reps,
        "tokens_per_run": args.tokens,
        "conditions": conditions,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    for name, result in conditions.items():
        for n, ratio in result["ratio_over_1_thread"].items():
            link, decode = ratio["link_s"], ratio["decode_s_per_token"]
            print(f"{name}: {n} threads / 1 thread: link {link:.2f}x, decode {decode:.2f}x")


if __name__ == "__main__":
    main()
