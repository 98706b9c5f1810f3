"""The fidelity plot: KL to Full Recompute against recomputed fraction, one point per policy."""

from __future__ import annotations

import os
from collections import defaultdict

from pic.errors import MissingDependencyError
from pic.evaluation.accuracy_report import AccuracyReport
from pic.evaluation.report import FidelityReport

# (x label, x value in %) of the two panels
_PANELS = (
    ("recomputed token-layers (% of Full Recompute)", lambda s: 100 * s.recompute_fraction),
    ("tokens recomputed in the last layer (% of prompt)", lambda s: 100 * s.recompute_fraction_last_layer),
)


def _pyplot():
    """matplotlib's pyplot on the Agg backend.

    Raises:
        MissingDependencyError: matplotlib is not installed (``pip install 'pic-kv[eval]'``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt
    except ImportError:
        raise MissingDependencyError("the evaluation plots need matplotlib: pip install 'pic-kv[eval]'") from None
    return plt


def _families(scores: list, keep) -> dict[str, list]:
    """Scores grouped by policy family (``legolink:16`` -> ``legolink``), those ``keep`` accepts."""
    families = defaultdict(list)
    for s in scores:
        if keep(s):
            families[s.policy.partition(":")[0]].append(s)
    return families


def plot_fidelity(report: FidelityReport, path: str | os.PathLike) -> None:
    """Write a PNG in the spirit of EPIC's Figure 6: mean KL(FR || policy) (log scale) against the
    recomputed fraction, one point per policy, points of one family joined. The left panel counts
    token-layers (the recompute pass's cost), the right one the tokens recomputed in the last layer;
    they differ only for dynamic policies (CacheBlend). Full Recompute (KL 0) has no point on a log scale.

    Raises:
        MissingDependencyError: matplotlib is not installed (``pip install 'pic-kv[eval]'``).
    """
    plt = _pyplot()
    families = _families(report.scores, lambda s: s.mean_kl > 0)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), dpi=110, sharey=True)
    for ax, (xlabel, x_of) in zip(axes, _PANELS, strict=True):
        for family, scores in sorted(families.items()):
            scores = sorted(scores, key=x_of)
            ax.plot([x_of(s) for s in scores], [s.mean_kl for s in scores], marker="o", label=family)
            for s in scores:
                label = s.policy.partition(":")[2] if len(scores) > 1 else s.policy
                offset = (4, 4) if len(scores) > 1 else (4, -11)
                ax.annotate(label, (x_of(s), s.mean_kl), textcoords="offset points", xytext=offset, fontsize=7)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("mean KL(Full Recompute || policy), nats")
    axes[0].legend(fontsize=8)
    cases = report.num_cases_evaluated
    fig.suptitle(f"{report.model_name}: fidelity vs recompute, {cases} cases ({report.device}, {report.dtype})")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# Sink profiles drawn when present (all of them otherwise): one per family, the default policy among them.
_SINK_POLICIES = ("full", "naive", "legolink0:3", "mepic", "legolink:16", "cacheblend:0.15")


def plot_accuracy(report: AccuracyReport, path: str | os.PathLike) -> None:
    """Write a PNG of three panels: accuracy (95% Wilson interval) against recomputed token-layers, with Full
    Recompute's accuracy as a band; the answer token's KL to Full Recompute against the same; and the
    attention the query pays to the later chunks' first tokens, per layer, for a few policies.

    Raises:
        MissingDependencyError: matplotlib is not installed (``pip install 'pic-kv[eval]'``).
    """
    plt = _pyplot()
    fig, (acc, kl, sink) = plt.subplots(1, 3, figsize=(16, 4.8), dpi=110)
    full = report.scores[0]
    acc.axhspan(100 * full.accuracy_low, 100 * full.accuracy_high, color="grey", alpha=0.2)
    acc.axhline(100 * full.accuracy, color="grey", label=f"full ({100 * full.accuracy:.0f}%)")
    for family, scores in sorted(_families(report.scores[1:], lambda s: True).items()):
        scores = sorted(scores, key=lambda s: s.recompute_fraction)
        x = [100 * s.recompute_fraction for s in scores]
        y = [100 * s.accuracy for s in scores]
        err = [
            [100 * (s.accuracy - s.accuracy_low) for s in scores],
            [100 * (s.accuracy_high - s.accuracy) for s in scores],
        ]
        acc.errorbar(x, y, yerr=err, marker="o", capsize=3, label=family)
        kl.plot(x, [s.answer_kl for s in scores], marker="o", label=family)
        for s, xi, yi in zip(scores, x, y, strict=True):
            acc.annotate(s.policy.partition(":")[2], (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7)
    acc.set(xlabel="recomputed token-layers (% of Full Recompute)", ylabel="accuracy (%), 95% interval", ylim=(0, 100))
    kl.set(xlabel="recomputed token-layers (% of Full Recompute)", ylabel="KL(FR || policy) at the answer token, nats")
    kl.set_yscale("log")
    shown = [p for p in report.sinks if p.policy in _SINK_POLICIES] or report.sinks
    for profile in shown:
        sink.plot(profile.chunk_firsts, label=profile.policy)
    if shown:
        sink.axhline(shown[0].uniform_chunk_firsts, color="black", linestyle=":", label="uniform attention")
        cases = shown[0].num_cases
        sink.set(title=f"attention on later chunks' first tokens ({cases} cases)", xlabel="layer")
        sink.set_ylabel("share of the query's attention")
    for ax in (acc, kl, sink):
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # an empty panel (--sink-cases 0) has none: no legend, no warning
            ax.legend(fontsize=7)
    bos = "with" if report.add_bos else "without"
    fig.suptitle(
        f"{report.model_name}: QA accuracy and fidelity per policy, {report.num_cases_evaluated} cases "
        f"({report.device}, {report.dtype}, chunks {bos} BOS)"
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
