"""Answers in bfloat16 against float32, paired case by case: the default's grid cells run in both dtypes.

    python benchmarks/order_grid.py run --models smollm2 --workloads qa niah-single --dtype bfloat16 \\
        --out benchmarks/results/order_grid_bf16                     # the cells in bfloat16 (float32: order_grid/)
    python benchmarks/dtype_answers.py                               # -> results/dtype_answers.json

For every cell of ``--bf16`` that ``--fp32`` holds too (the same seed, so the same cases), per row (Full Recompute and
the default): the accuracy in each dtype and the paired difference, bfloat16 minus float32, with its 95% interval
(``paired_difference``: the mean of per-case -1/0/+1 and the normal approximation), and in each dtype the default's
link speedup over Full Recompute (the median over the cell's cases of the two links' times, measured back to back).
It reads the cells' case logs (``<cell>.cases.jsonl``, not in git) and writes what it found to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from pic.evaluation.accuracy_report import paired_difference

RESULTS = Path(__file__).resolve().parent / "results"


def outcomes(log: Path) -> dict[int, dict]:
    """Case number -> its outcomes (per row label) in a cell's case log."""
    lines = log.read_text().splitlines()[1:]
    return {case["case"]: case["outcomes"] for case in map(json.loads, lines)}


def compare(fp32: Path, bf16: Path) -> dict:
    """One cell: each row's accuracies, paired difference and the default's speedups in both dtypes."""
    wide, narrow = outcomes(fp32), outcomes(bf16)
    cases = sorted(set(wide) & set(narrow))
    rows = {}
    for label in narrow[cases[0]]:
        right = [(int(wide[c][label]["score"]["correct"]), int(narrow[c][label]["score"]["correct"])) for c in cases]
        diff, low, high = paired_difference([b - a for a, b in right])
        rows[label] = {"fp32": sum(a for a, _ in right) / len(cases), "bf16": sum(b for _, b in right) / len(cases),
                       "diff": diff, "diff_low": low, "diff_high": high,
                       "num_changed": sum(a != b for a, b in right)}  # fmt: skip
    for label, row in rows.items():
        if label != "full":
            for name, cell in (("fp32", wide), ("bf16", narrow)):
                ratios = [cell[c]["full"]["link"]["link_s"] / cell[c][label]["link"]["link_s"] for c in cases]
                row[f"speedup_{name}"] = statistics.median(ratios)
    full_s = {name: statistics.median(cell[c]["full"]["link"]["link_s"] for c in cases)
              for name, cell in (("fp32", wide), ("bf16", narrow))}  # fmt: skip
    return {"num_cases": len(cases), "rows": rows, "full_link_gain": full_s["fp32"] / full_s["bf16"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fp32", type=Path, default=RESULTS / "order_grid")
    parser.add_argument("--bf16", type=Path, default=RESULTS / "order_grid_bf16")
    parser.add_argument("--out", type=Path, default=RESULTS / "dtype_answers.json")
    args = parser.parse_args()
    cells = {}
    for log in sorted(args.bf16.glob("*.cases.jsonl")):
        twin = args.fp32 / log.name
        if twin.exists():
            cells[log.name.removesuffix(".cases.jsonl")] = compare(twin, log)
    args.out.write_text(json.dumps({"fp32": str(args.fp32.name), "bf16": str(args.bf16.name), "cells": cells},
                                   indent=1) + "\n")  # fmt: skip
    for name, cell in cells.items():  # (the table: figures.py's dtype_answers_table, in docs/cpu.md)
        for label, row in cell["rows"].items():
            interval = f"{100 * row['diff_low']:+.1f} to {100 * row['diff_high']:+.1f}"
            print(f"{name} {label} ({cell['num_cases']} cases): {row['fp32']:.1%} -> {row['bf16']:.1%}, "
                  f"{100 * row['diff']:+.1f} ({interval}) points")  # fmt: skip


if __name__ == "__main__":
    main()
