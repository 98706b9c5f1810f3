"""``python -m pic eval fidelity``: evaluate policies, write JSON and PNG, print the table.

The JSON is rewritten after every case, so an evaluation that fails or is interrupted keeps what it
measured (``num_cases_evaluated`` says how much); the PNG and the table come at the end.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from pic.api import PIC
from pic.errors import PicError
from pic.evaluation.fidelity import checked_policies, evaluate_fidelity
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
    out_dir: str | os.PathLike = "pic-eval",
    name: str = "fidelity",
) -> FidelityReport:
    """Evaluate ``policies`` on ``workload`` (a JSONL file; default: sampled from the model) and write
    ``<out_dir>/<name>.json`` and ``<out_dir>/<name>.png``; prints the Markdown table and the paths.
    Progress goes to stderr."""
    out = Path(out_dir)
    json_path, png_path = out / f"{name}.json", out / f"{name}.png"
    _say(f"loading {model}")
    engine = PIC.from_pretrained(model, device=device, dtype=dtype)
    checked = checked_policies(engine, policies)  # a bad spec fails now, not after the workload
    if workload:
        cases = load_workload(workload)
    else:
        _say(f"sampling {num_cases} cases from the model (seed {seed})")
        cases = sample_workload(engine, num_cases=num_cases, seed=seed, progress=True)
    out.mkdir(parents=True, exist_ok=True)
    _say(f"evaluating {len(checked)} policies against Full Recompute on {len(cases.cases)} cases -> {json_path}")
    latest: list[FidelityReport] = []

    def save(report: FidelityReport) -> None:
        _write_json(report, json_path)
        latest[:] = [report]

    try:
        report = evaluate_fidelity(engine, workload=cases, policies=checked, progress=True, on_case=save)
    except (PicError, KeyboardInterrupt):
        if latest:
            done = latest[0].num_cases_evaluated
            _say(f"stopped after {done} of {len(cases.cases)} cases; their results are in {json_path}")
        raise
    print(report.table())  # the JSON is the finished report: on_case wrote it after the last case
    print(f"\nwrote {json_path}")
    plot_fidelity(report, png_path)  # needs matplotlib (the eval extra); the table and JSON come first
    print(f"wrote {png_path}")
    return report


def _write_json(report: FidelityReport, path: Path) -> None:
    """Replace ``path`` atomically, so an interruption never leaves a half-written file."""
    partial = path.with_name(path.name + ".partial")
    report.save_json(partial)
    os.replace(partial, path)


def _say(message: str) -> None:
    print(f"pic eval fidelity: {message}", file=sys.stderr, flush=True)
