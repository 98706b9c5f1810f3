"""What one ``bash .ci/run`` measured: the suite's and the vLLM tests' counts and seconds, read off its log.

    bash .ci/run > /tmp/ci.log 2>&1; python benchmarks/suite_run.py /tmp/ci.log --load "nothing else running"

pytest closes each of the two runs with a line such as ``1445 passed, 11 skipped in 800.77s (0:13:20)``: the first
is the README's test command, the second ``tests_vllm``. Writes ``benchmarks/results/suite_run.json``, which
README's test section renders (``benchmarks/figures.py``: ``suite_run``), so its counts are never typed by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
SUMMARY = re.compile(r"^=*\s*(?P<counts>(?:\d+ \w+(?:, )?)+) in (?P<seconds>[\d.]+)s", re.M)


def summaries(log: str) -> list[dict]:
    """Every pytest summary line of ``log``: ``{"passed": 1445, "skipped": 11, "seconds": 800.77}``, in order."""
    out = []
    for match in SUMMARY.finditer(log):
        counts = {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", match["counts"])}
        out.append(counts | {"seconds": float(match["seconds"])})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("log", type=Path, help="the output of `bash .ci/run`")
    parser.add_argument("--load", required=True, help="what else ran on the machine meanwhile, in words")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "suite_run.json")
    args = parser.parse_args()
    found = summaries(args.log.read_text())
    if len(found) != 2:
        raise SystemExit(f"{args.log}: {len(found)} pytest summary lines; expected 2 (the suite, then tests_vllm)")
    commit = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], capture_output=True, text=True, cwd=HERE)
    report = {
        "suite": found[0], "vllm": found[1], "load": args.load, "commit": commit.stdout.strip() or None,
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores",
    }  # fmt: skip
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
