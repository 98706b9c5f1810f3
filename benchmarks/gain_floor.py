"""``auto``'s floor on the gain (``min_gain``), replayed from the grid's case logs at other values.

    python benchmarks/gain_floor.py benchmarks/results/order_grid_65 --gains 2.5 3 3.5   # -> gain_floor.json

Under ``auto`` a case runs Full Recompute in the caller's order when its link would recompute more than ``1 /
min_gain`` of the prompt (``pic.link.policies.builtin.auto_plan``), and then its outcome is Full Recompute's own: the
same prompt, the same reply. So the default at another floor needs no new run: each case of a cell's log
(``<cell>.cases.jsonl``, ``pic eval accuracy --resume``'s) is Full Recompute's outcome where its unfloored link
(the row ``auto:0.05,min_gain=1.0@context``, or the default's where that row is absent and the case linked) recomputed
more than that share, else the link's. A cell whose log lacks the unfloored row replays floors at or above the one
it ran with only (cases that ran Full Recompute there did not record their link). Per cell and floor: the accuracy's
paired difference from Full Recompute in the caller's order (95% interval), the share of cases linked, and the median
of the per-case speedups (Full Recompute's link time over the default's, 1 where it ran Full Recompute).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pic.evaluation.accuracy_report import paired_difference  # noqa: E402

UNFLOORED = "auto:0.05,min_gain=1.0@context"
DEFAULT = "auto:0.05@context"
RAN_WITH = 2.5  # the floor the default's row ran with (pic.link.policies.builtin.MIN_GAIN when the grid ran)


def replay(log: Path, gains: list[float]) -> dict:
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    cases = [line["outcomes"] for line in lines[1:]]
    source = UNFLOORED if UNFLOORED in lines[0]["header"]["labels"] else DEFAULT
    out = {"cell": log.name.removesuffix(".cases.jsonl"), "num_cases": len(cases), "source": source, "floors": {}}
    for gain in gains:
        if source == DEFAULT and gain < RAN_WITH:
            continue
        diffs, speedups, linked = [], [], 0
        for outcomes in cases:
            full, link = outcomes["full"], outcomes[source]
            runs_full = link["link"]["fraction"] > 1 / gain
            chosen = full if runs_full else link
            linked += not runs_full
            diffs.append(int(chosen["score"]["correct"]) - int(full["score"]["correct"]))
            speedups.append(1.0 if runs_full else full["link"]["link_s"] / link["link"]["link_s"])
        diff, low, high = paired_difference(diffs)
        out["floors"][f"{gain:g}"] = {
            "diff": diff, "diff_low": low, "diff_high": high, "linked": linked / len(cases),
            "median_speedup": statistics.median(speedups),
        }  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--gains", type=float, nargs="+", default=[1.0, 2.0, 2.5, 3.0, 3.5])
    parser.add_argument("--out", type=Path, default=None, help="default: <folder>/gain_floor.json")
    args = parser.parse_args()
    cells = [replay(log, args.gains) for log in sorted(args.folder.glob("*.cases.jsonl"))]
    cells = [c for c in cells if c["num_cases"]]
    (args.out or args.folder / "gain_floor.json").write_text(json.dumps({"cells": cells}, indent=2) + "\n")
    for cell in cells:
        for gain, f in cell["floors"].items():
            diff = f"{100 * f['diff']:+5.1f} ({100 * f['diff_low']:+5.1f} to {100 * f['diff_high']:+5.1f})"
            print(f"{cell['cell']:32} min_gain {gain:>4}: {diff} linked {f['linked']:4.0%} {f['median_speedup']:.2f}x")


if __name__ == "__main__":
    main()
