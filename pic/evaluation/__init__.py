"""Evaluating recompute policies against Full Recompute: fidelity (``python -m pic eval fidelity``) and task
accuracy on multi-document QA with the attention-sink profile (``python -m pic eval accuracy``)."""

from pic.evaluation.accuracy import ACCURACY_POLICIES, evaluate_accuracy
from pic.evaluation.accuracy_report import AccuracyReport, AccuracyScore
from pic.evaluation.answers import AnswerScore, score_answer
from pic.evaluation.fidelity import DEFAULT_POLICIES, evaluate_fidelity
from pic.evaluation.musique import musique_workload
from pic.evaluation.niah import niah_workload
from pic.evaluation.plot import plot_accuracy, plot_fidelity
from pic.evaluation.profiles import profile_workload
from pic.evaluation.qa import QACase, QAKind, QAWorkload, qa_workload
from pic.evaluation.report import FidelityReport, PolicyScore
from pic.evaluation.sinks import SinkProfile
from pic.evaluation.workload import Case, Workload, load_workload, sample_workload

__all__ = [
    "ACCURACY_POLICIES",
    "DEFAULT_POLICIES",
    "AccuracyReport",
    "AccuracyScore",
    "AnswerScore",
    "Case",
    "FidelityReport",
    "PolicyScore",
    "QACase",
    "QAKind",
    "QAWorkload",
    "SinkProfile",
    "Workload",
    "evaluate_accuracy",
    "evaluate_fidelity",
    "load_workload",
    "musique_workload",
    "plot_accuracy",
    "plot_fidelity",
    "niah_workload",
    "profile_workload",
    "qa_workload",
    "sample_workload",
    "score_answer",
]
