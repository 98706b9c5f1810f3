"""``python -m pic eval fidelity`` and ``eval accuracy``: evaluate policies, write JSON and PNG, print the table.

The JSON is rewritten after every case, so an evaluation that fails or is interrupted keeps what it
measured (``num_cases_evaluated`` says how much); the PNG and the table come at the end.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from pic.engine import PIC
from pic.errors import InvalidInputError, MissingDependencyError, PicError
from pic.evaluation.accuracy import accuracy_rows, evaluate_accuracy
from pic.evaluation.accuracy_report import AccuracyReport
from pic.evaluation.case_log import CaseLog
from pic.evaluation.fidelity import evaluate_fidelity, fidelity_policies
from pic.evaluation.plot import plot_accuracy, plot_fidelity
from pic.evaluation.qa import QAWorkload
from pic.evaluation.report import FidelityReport
from pic.evaluation.workload import load_workload, sample_workload
from pic.link.policies import FullRecompute

Report = TypeVar("Report", FidelityReport, AccuracyReport)


def run_fidelity(
    engine: PIC,
    *,
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
    say = _sayer("fidelity")
    _check_out(out_dir, name)  # an unwritable folder fails now, not after the sampling
    checked = fidelity_policies(engine, policies)  # a bad spec fails now, not after the workload
    if workload:
        cases = load_workload(workload)
    else:
        say(f"sampling {num_cases} cases from the model (seed {seed})")
        cases = sample_workload(engine, num_cases=num_cases, seed=seed, progress=True)

    def evaluate(on_case: Callable[[FidelityReport], None]) -> FidelityReport:
        return evaluate_fidelity(engine, workload=cases, policies=checked, progress=True, on_case=on_case)

    say(f"evaluating {len(checked)} policies against Full Recompute on {len(cases.cases)} cases")
    return _run(evaluate, say, len(cases.cases), plot_fidelity, out_dir=out_dir, name=name)


def run_accuracy(
    engine: PIC,
    *,
    workload: QAWorkload,
    policies: Sequence[str],
    orders: Sequence[str] = ("policy",),
    max_new_tokens: int = 24,
    num_sink_cases: int = 20,
    out_dir: str | os.PathLike = "pic-eval",
    name: str = "accuracy",
    resume: bool = False,
) -> AccuracyReport:
    """``evaluate_accuracy`` on ``workload``, written as ``run_fidelity`` writes (JSON after every case,
    the table, the PNG), each case's outcomes logged to ``<name>.cases.jsonl`` as it finishes; ``resume`` runs
    only the cases that log lacks (``pic.evaluation.case_log``)."""
    say = _sayer("accuracy")
    _check_out(out_dir, name)
    checked = accuracy_rows(engine, policies, orders)
    header = {
        "model": engine.model_name, "fingerprint": engine.fingerprint, "workload": workload.description,
        "labels": [FullRecompute().spec, *(row.label for row in checked)], "max_new_tokens": max_new_tokens,
    }  # fmt: skip
    log = CaseLog(Path(out_dir) / f"{name}.cases.jsonl", header)
    done = log.read() if resume else {}
    if not resume:
        log.start()
    elif done:
        say(f"resuming: {len(done)} of {len(workload.cases)} cases done in {log.path}")

    def evaluate(on_case: Callable[[AccuracyReport], None]) -> AccuracyReport:
        return evaluate_accuracy(
            engine, workload=workload, policies=policies, orders=orders, max_new_tokens=max_new_tokens,
            num_sink_cases=num_sink_cases, progress=True, on_case=on_case, done=done, on_outcomes=log.append,
        )  # fmt: skip

    say(f"{engine.model_name}, add_bos={engine.config.add_bos}: {len(checked)} policies against Full Recompute")
    return _run(evaluate, say, len(workload.cases), plot_accuracy, out_dir=out_dir, name=name)


def _run(
    evaluate: Callable[[Callable[[Report], None]], Report],
    say: Callable[[str], None],
    num_cases: int,
    plot: Callable[[Report, Path], None],
    *,
    out_dir: str | os.PathLike,
    name: str,
) -> Report:
    """Run ``evaluate(on_case)``, rewriting the JSON after every case; then print the table and plot."""
    out = Path(out_dir)
    json_path, png_path = out / f"{name}.json", out / f"{name}.png"
    out.mkdir(parents=True, exist_ok=True)
    say(f"{num_cases} cases -> {json_path}")
    latest: list[Report] = []

    def save(report: Report) -> None:
        _write_json(report, json_path)
        latest[:] = [report]

    try:
        report = evaluate(save)
    except (PicError, KeyboardInterrupt):
        if latest:
            say(f"stopped after {latest[0].num_cases_evaluated} of {num_cases} cases; their results are in {json_path}")
        raise
    print(report.table())  # the JSON is the finished report: on_case wrote it after the last case
    print(f"\nwrote {json_path}")
    try:
        plot(report, png_path)  # needs matplotlib (the eval extra); the table and JSON come first
    except MissingDependencyError as exc:  # the evaluation succeeded: its results are written
        say(f"no plot: {exc}")
        return report
    print(f"wrote {png_path}")
    return report


def _check_out(out_dir: str | os.PathLike, name: str) -> None:
    """Make ``out_dir`` and check that ``<name>.json`` can be written there, before any work.

    Raises:
        InvalidInputError: naming the folder and why (it cannot be made, or written).
    """
    probe = Path(out_dir) / f".{name}.probe"
    try:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise InvalidInputError(f"cannot write the results to {str(out_dir)!r}: {exc.strerror or exc}") from None


def _write_json(report: Report, path: Path) -> None:
    """Replace ``path`` atomically, so an interruption never leaves a half-written file."""
    partial = path.with_name(path.name + ".partial")
    report.save_json(partial)
    os.replace(partial, path)


def _sayer(kind: str) -> Callable[[str], None]:
    def say(message: str) -> None:
        print(f"pic eval {kind}: {message}", file=sys.stderr, flush=True)

    return say
