"""Answers against link speed: each selection of the tokens to recompute, at budgets of 5 to 30%, per model and cell.

    python benchmarks/frontier.py run --models smollm2 --cells qa:before profiles:after niah-single:after:2500
    python benchmarks/frontier.py run --models qwen0.5b --cells profiles:after --wheels WHEELS
    python benchmarks/frontier.py table                           # -> frontier.json and one PNG per model

A cell is ``WORKLOAD:LAYOUT[:HAYSTACK]`` (``niah-single:after:5000``: RULER's single needle asked after the
documents, a haystack of 5,000 tokens of 4 characters), one resumable ``pic eval accuracy`` run (``_cells.py``)
whose rows are every selection of ``SELECTIONS`` at every budget of ``BUDGETS``, all over chunks compiled in the
chat's context and linked in relevance order (the default's order: the selection is what varies), beside Full
Recompute of the caller's prompt. Cases are the exploration's (``--seed 1``), not the grid's.

The selections: ``default``, ``auto`` at that budget (what pic links with); ``suffix``, the last chunks whole, at
least the budget (``suffix:B,whole=true``: the vLLM connector's rule); ``prophetkv`` (arXiv 2602.02579; pic's
reading of it), ``infoflow`` (InfoFlow KV, arXiv 2603.05353: the attention norm of an upper-middle band of layers)
and ``fusionrag`` (FusionRAG, arXiv 2601.12904: the last layer's attention), each a probe and then its top share of
the chunk tokens. A budget is each selection's own argument (a share of the chunk tokens); what a row recomputed
and how much sooner it linked are measured, per case, beside Full Recompute (``prompt_token_layers``: recomputed
token-layers over the prompt's, the probe included; ``speedup``: the median of Full Recompute's link time over the
row's).

``table`` writes ``frontier.json`` (every cell's rows: accuracy, the paired difference from Full Recompute in the
caller's order with its 95% interval, recomputed shares, speedup) and ``frontier_<model>.png`` (per cell: the
difference against the speedup, a line per selection, the interval as bars), and prints the markdown table
docs/policies.md renders from the JSON (``benchmarks/figures.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cells import LAYOUTS, MODELS, WORKLOADS, model_arg, run_cell, score_fields  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "frontier"
BUDGETS = (0.05, 0.1, 0.15, 0.2, 0.3)
SELECTIONS = {
    "default": "auto:{b}",
    "suffix": "suffix:{b},whole=true",
    "prophetkv": "prophetkv:{b}",
    "infoflow": "infoflow:{b}",
    "fusionrag": "fusionrag:{b}",
}
ROW = "{spec}@context/relevance"
SEED = 1  # the exploration's cases (the grid's are seed 2)


def rows(selections: list[str], budgets: list[float]) -> str:
    return " ".join(ROW.format(spec=SELECTIONS[s].format(b=b)) for s in selections for b in budgets)


def parse_cell(text: str) -> tuple[str, str, int | None]:
    workload, layout, *rest = text.split(":")
    if workload not in WORKLOADS or layout not in LAYOUTS or len(rest) > 1:
        raise argparse.ArgumentTypeError(f"{text!r}: WORKLOAD:LAYOUT[:HAYSTACK] ({', '.join(WORKLOADS)}; before|after)")
    haystack = int(rest[0]) if rest else (2700 if workload.startswith("niah") else None)
    return workload, layout, haystack


def cell_name(model: str, workload: str, layout: str, haystack: int | None, selections: list[str]) -> str:
    """``<model>_<workload>_<layout>[_<haystack>].<selection>+<selection>...``: selections may run in separate files
    (one ``run`` each); ``table`` gathers every file's rows."""
    return f"{model}_{workload}_{layout}" + (f"_{haystack}" if haystack else "") + "." + "+".join(selections)


def run(args: argparse.Namespace) -> None:
    for model in args.models:
        path = model_arg(model, args.wheels)
        for workload, layout, haystack in args.cells:
            run_cell(
                path=path, workload=workload, layout=layout, haystack=haystack,
                rows=rows(args.selections, args.budgets), cases=args.cases, seed=args.seed, out=Path(args.out),
                name=cell_name(model, workload, layout, haystack, args.selections), threads=args.threads,
            )  # fmt: skip


def selection_of(label: str) -> tuple[str, float] | None:
    """``(selection, budget)`` of a row's label, ``None`` for a row no selection makes."""
    from pic.policies import resolve  # noqa: PLC0415  (a row's label spells its policy as pic does)

    for name, spec in SELECTIONS.items():
        for budget in BUDGETS:
            if label == ROW.format(spec=resolve(spec.format(b=budget)).spec):
                return name, budget
    return None


def cells(folder: Path) -> list[dict]:
    found = []
    for path in sorted(folder.glob("*_*.*.json")):
        report = json.loads(path.read_text())
        model, workload, layout, *rest = path.stem.rpartition(".")[0].split("_")
        full = report["scores"][0]
        for score in report["scores"][1:]:
            chosen = selection_of(score["policy"])
            if model not in MODELS or chosen is None:
                continue
            found.append({
                "model": model, "workload": workload, "layout": layout, "haystack": int(rest[0]) if rest else None,
                "selection": chosen[0], "budget": chosen[1], "num_cases": report["num_cases_evaluated"],
                "full": full["accuracy"], **score_fields(score),
            })  # fmt: skip
    return found


def table(found: list[dict]) -> str:
    """One line per model, cell and selection: at each budget, the paired difference from Full Recompute in the
    caller's order (points) and the link's speedup (median)."""
    lines = [
        "| model | cell | cases | Full Recompute | selection | " + " | ".join(f"{b:.0%}" for b in BUDGETS) + " |",
        "|---|---|---:|---:|---|" + "---:|" * len(BUDGETS),
    ]
    rank = {name: i for i, name in enumerate(SELECTIONS)}
    keys = sorted({(c["model"], c["workload"], c["layout"], c["haystack"] or 0) for c in found},
                  key=lambda k: (list(MODELS).index(k[0]), k[1:]))  # fmt: skip
    for model, workload, layout, haystack in keys:
        mine = [c for c in found if (c["model"], c["workload"], c["layout"], c["haystack"] or 0) ==
                (model, workload, layout, haystack)]  # fmt: skip
        cell = f"{workload}, question {layout}" + (f", {haystack} tok" if haystack else "")
        for name in sorted({c["selection"] for c in mine}, key=rank.get):
            at = {c["budget"]: c for c in mine if c["selection"] == name}
            cells = [
                f"{100 * at[b]['diff']:+.1f} · {at[b]['speedup']:.1f}x".replace("-", "\u2212") if b in at else ""
                for b in BUDGETS
            ]
            first = next(iter(at.values()))
            lines.append(
                f"| {MODELS[model]} | {cell} | {first['num_cases']} | {first['full']:.1%} | {name} | "
                + " | ".join(cells) + " |"
            )
    return "\n".join(lines)


def plot(found: list[dict], model: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = [c for c in found if c["model"] == model]
    keys = sorted({(c["workload"], c["layout"], c["haystack"] or 0) for c in mine})
    from matplotlib.ticker import FuncFormatter

    columns = min(3, len(keys))
    rows = -(-len(keys) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.6 * columns, 3.4 * rows), squeeze=False, sharey=True)
    for ax in axes.flat[len(keys):]:
        ax.set_visible(False)
    for ax, (workload, layout, haystack) in zip(axes.flat, keys):
        for i, name in enumerate(SELECTIONS):
            line = sorted(
                (c for c in mine if (c["workload"], c["layout"], c["haystack"] or 0, c["selection"]) ==
                 (workload, layout, haystack, name)), key=lambda c: c["budget"],
            )  # fmt: skip
            if not line:
                continue
            x = [c["speedup"] for c in line]
            y = [100 * c["diff"] for c in line]
            err = [[100 * (c["diff"] - c["diff_low"]) for c in line], [100 * (c["diff_high"] - c["diff"]) for c in line]]
            ax.errorbar(x, y, yerr=err, marker="o", ms=3, capsize=2, lw=1, color=f"C{i}", label=name, alpha=0.85)
        ax.axhline(0, color="grey", lw=0.8)
        ax.axhline(-3, color="grey", lw=0.8, ls=":")
        n = next(c["num_cases"] for c in mine if (c["workload"], c["layout"], c["haystack"] or 0) == (workload,
                 layout, haystack))  # fmt: skip
        ax.set_title(f"{workload}, question {layout}" + (f", {haystack} tok" if haystack else "") + f" (n={n})",
                     fontsize=9)  # fmt: skip
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
        ax.set_xlabel("link speedup over Full Recompute (median)", fontsize=8)
    for row in axes:
        row[0].set_ylabel("answers vs Full Recompute, points", fontsize=8)
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"{MODELS[model]}: selections at budgets {', '.join(f'{b:g}' for b in BUDGETS)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    go = commands.add_parser("run")
    go.add_argument("--models", nargs="+", choices=list(MODELS), default=["smollm2"])
    go.add_argument("--cells", nargs="+", type=parse_cell, required=True, help="WORKLOAD:LAYOUT[:HAYSTACK]")
    go.add_argument("--selections", nargs="+", choices=list(SELECTIONS), default=list(SELECTIONS))
    go.add_argument("--budgets", nargs="+", type=float, choices=BUDGETS, default=list(BUDGETS))
    go.add_argument("--cases", type=int, default=30)
    go.add_argument("--seed", type=int, default=SEED)
    go.add_argument("--threads", type=int, default=1, help="torch threads per evaluation (OMP_NUM_THREADS)")
    go.add_argument("--wheels", default=None, help="the folder of the Qwen GGUF wheels (benchmarks/qwen_models.py)")
    go.add_argument("--out", default=str(RESULTS))
    shown = commands.add_parser("table")
    shown.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    if args.command == "run":
        run(args)
        return
    found = cells(Path(args.out))
    (Path(args.out) / "frontier.json").write_text(json.dumps({"budgets": BUDGETS, "rows": found}, indent=1) + "\n")
    for model in sorted({c["model"] for c in found}):
        plot(found, model, Path(args.out) / f"frontier_{model}.png")
    print(table(found))
    print(f"{len(found)} rows -> {args.out}/frontier.json")


if __name__ == "__main__":
    main()
