"""``python -m pic eval fidelity``: evaluate policies, write JSON and PNG, print the table."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from pic.api import PIC
from pic.evaluation.fidelity import evaluate_fidelity
from pic.evaluation.plot import plot_fidelity
from pic.evaluation.report import FidelityReport
from pic.evaluation.workload import load_workload, sample_workload
from pic.model.loading import EMBEDDED_MODEL


def run_fidelity(
    *,
    model: str | os.PathLike = EMBEDDED_MODEL,
    device: str | None = None,
    dtype: str | None = None,
    workload: str | os.PathLike | None = None,
    num_cases: int = 30,
    seed: int = 0,
    policies: Sequence[str],
    out_dir: str | os.PathLike = "benchmarks/results",
    name: str = "fidelity",
) -> FidelityReport:
    """Evaluate ``policies`` on ``workload`` (a JSONL file; default: sampled from the model) and write
    ``<out_dir>/<name>.json`` and ``<out_dir>/<name>.png``; prints the Markdown table and the paths."""
    engine = PIC.from_pretrained(model, device=device, dtype=dtype)
    cases = load_workload(workload) if workload else sample_workload(engine, num_cases=num_cases, seed=seed)
    report = evaluate_fidelity(engine, workload=cases, policies=policies, progress=True)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report.save_json(out / f"{name}.json")
    plot_fidelity(report, out / f"{name}.png")
    print(report.table())
    print(f"\nwrote {out / f'{name}.json'} and {out / f'{name}.png'}")
    return report
