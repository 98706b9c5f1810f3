"""Throughput of two checkouts of pic side by side: ``throughput.py`` at ``max_num_seqs`` 16, run in turn under
each checkout (A B A B ..., one torch thread), so both see the same machine; reports each run's tokens/s over
the facade (one request at a time, in the same process) and the medians.

    python benchmarks/throughput_ab.py --before /tmp/pic_before --pairs 3 --out benchmarks/results/throughput_ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(checkout: Path, out: Path) -> dict:
    """One run of ``checkout``'s own ``throughput.py --max-num-seqs 16 --repeats 1``, importing its ``pic``."""
    env = dict(os.environ, PYTHONPATH=str(checkout), OMP_NUM_THREADS="1")
    script = checkout / "benchmarks" / "throughput.py"
    cmd = [sys.executable, str(script), "--max-num-seqs", "16", "--repeats", "1", "--out", str(out)]
    subprocess.run(cmd, env=env, check=True, capture_output=True, cwd=checkout)
    medians = json.loads((out / "throughput.json").read_text())["medians"]
    return {name: {k: m[k] for k in ("tokens_per_s", "tokens_per_s_over_facade")} for name, m in medians.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="a checkout of the code to compare with (its root)")
    parser.add_argument("--after", default=str(HERE.parent), help="the other checkout (default: this one)")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--out", default=str(HERE / "results" / "throughput_ab.json"))
    args = parser.parse_args()
    sides = {"before": Path(args.before), "after": Path(args.after)}
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):
            for name, checkout in sides.items():
                runs[name].append(run(checkout, Path(tmp) / f"{name}{i}"))
                print(name, i, runs[name][-1]["engine 16"], flush=True)
    ratio = {
        name: statistics.median(r["engine 16"]["tokens_per_s_over_facade"] for r in rs) for name, rs in runs.items()
    }
    tps = {name: statistics.median(r["engine 16"]["tokens_per_s"] for r in rs) for name, rs in runs.items()}
    report = {
        "what": "throughput.py --max-num-seqs 16 --repeats 1, alternating checkouts, one torch thread",
        "median_over_facade": ratio,
        "median_engine16_tokens_per_s": tps,
        "after_over_before_tokens_per_s": tps["after"] / tps["before"],
        "runs": runs,
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("median_over_facade", "after_over_before_tokens_per_s")}))


if __name__ == "__main__":
    main()
