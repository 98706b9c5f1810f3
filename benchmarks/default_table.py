"""The default policy against Full Recompute in every cell: model x workload x layout, from the accuracy runs.

python benchmarks/default_table.py        # reads benchmarks/results/<model>_default_<workload>_<layout>.json
                                          # -> default_policy.json, default_policy.png, a markdown table

Each cell is one ``pic eval accuracy`` run of the default (``auto@context``, chunks compiled in the chat's
context as ``link_chat(..., documents=...)`` compiles them) beside Full Recompute, e.g.

    python -m pic eval accuracy --model smollm2 --workload niah --niah-kind multikey --question-after-only \\
        --cases 60 --sink-cases 0 --policies auto@context --out benchmarks/results \\
        --name smollm2_default_niah-multikey_after

The table gives, per cell, the paired difference in points with its 95% interval, both accuracies, the cases,
the chunk token-layers recomputed (the probe included) and the link speedup over Full Recompute (medians on
this 2-core CPU, read beside the other cells of the same run only).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
CELL = re.compile(r"(?P<model>[a-z0-9.]+)_default_(?P<workload>[a-z-]+)_(?P<layout>before|after)\.json")
MODELS = {"smollm2": "SmolLM2-135M", "qwen0.5b": "Qwen2.5-Coder-0.5B", "qwen1.5b": "Qwen2.5-Coder-1.5B"}
WORKLOADS = ("qa", "profiles", "niah-single", "niah-multikey")


def cells(folder: Path) -> list[dict]:
    found = []
    for path in sorted(folder.glob("*_default_*.json")):
        match = CELL.fullmatch(path.name)
        if match is None or match["model"] not in MODELS:
            continue
        report = json.loads(path.read_text())
        rows = {score["policy"]: score for score in report["scores"]}
        default = next(score for spec, score in rows.items() if spec.startswith("auto"))
        found.append(
            {
                **match.groupdict(),
                "file": path.name,
                "num_cases": report["num_cases_evaluated"],
                "policy": default["policy"],
                "full": rows["full"]["accuracy"],
                "default": default["accuracy"],
                "diff": default["diff_vs_full"],
                "diff_low": default["diff_low"],
                "diff_high": default["diff_high"],
                "chunk_token_layers": default["chunk_recompute_fraction"],
                "speedup": default["median_speedup_vs_full"],
            }
        )
    order = {name: i for i, name in enumerate(MODELS)} | {name: i for i, name in enumerate(WORKLOADS)}
    return sorted(found, key=lambda c: (order[c["model"]], order.get(c["workload"], 9), c["layout"] == "after"))


def table(found: list[dict]) -> str:
    lines = [
        "| model | workload | question | cases | Full Recompute | default | paired diff (95% CI) | "
        "chunk token-layers | link speedup |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in found:
        diff = f"{100 * c['diff']:+.1f} ({100 * c['diff_low']:+.1f} to {100 * c['diff_high']:+.1f})"
        lines.append(
            f"| {MODELS[c['model']]} | {c['workload']} | {c['layout']} | {c['num_cases']} | {c['full']:.1%} | "
            f"{c['default']:.1%} | {diff} | {c['chunk_token_layers']:.1%} | {c['speedup']:.2f}x |"
        )
    return "\n".join(lines)


def plot(found: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.35 * len(found) + 1.2))
    for y, c in enumerate(reversed(found)):
        color = f"C{list(MODELS).index(c['model'])}"
        ax.errorbar(
            100 * c["diff"], y, xerr=[[100 * (c["diff"] - c["diff_low"])], [100 * (c["diff_high"] - c["diff"])]],
            fmt="o", color=color, capsize=3,
        )  # fmt: skip
    labels = [f"{MODELS[c['model']]} {c['workload']} {c['layout']} (n={c['num_cases']})" for c in reversed(found)]
    ax.set_yticks(range(len(found)), labels, fontsize=8)
    for x in (-3, 0, 3):
        ax.axvline(x, color="grey", lw=0.8, ls="-" if x == 0 else ":")
    ax.set_xlabel("default (auto) - Full Recompute, points (paired, 95% CI)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    found = cells(RESULTS)
    (RESULTS / "default_policy.json").write_text(json.dumps({"cells": found}, indent=2) + "\n")
    plot(found, RESULTS / "default_policy.png")
    print(table(found))


if __name__ == "__main__":
    main()
