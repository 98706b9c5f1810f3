"""Evaluating recompute policies against Full Recompute (``python -m pic eval fidelity``)."""

from pic.evaluation.fidelity import DEFAULT_POLICIES, evaluate_fidelity
from pic.evaluation.plot import plot_fidelity
from pic.evaluation.report import FidelityReport, PolicyScore
from pic.evaluation.workload import Case, Workload, load_workload, sample_workload

__all__ = [
    "DEFAULT_POLICIES",
    "Case",
    "FidelityReport",
    "PolicyScore",
    "Workload",
    "evaluate_fidelity",
    "load_workload",
    "plot_fidelity",
    "sample_workload",
]
