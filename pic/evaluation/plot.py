"""The fidelity plot: KL to Full Recompute against recomputed fraction, one point per policy."""

from __future__ import annotations

import os
from collections import defaultdict

from pic.errors import MissingDependencyError
from pic.evaluation.report import FidelityReport, PolicyScore

# (x label, x value in %) of the two panels
_PANELS = (
    ("recomputed token-layers (% of Full Recompute)", lambda s: 100 * s.recompute_fraction),
    ("tokens recomputed in the last layer (% of prompt)", lambda s: 100 * s.recompute_fraction_last_layer),
)


def plot_fidelity(report: FidelityReport, path: str | os.PathLike) -> None:
    """Write a PNG in the spirit of EPIC's Figure 6: mean KL(FR || policy) (log scale) against the
    recomputed fraction, one point per policy, points of one family joined. The left panel counts
    token-layers (the recompute pass's cost), the right one the tokens recomputed in the last layer;
    they differ only for dynamic policies (CacheBlend). Full Recompute (KL 0) has no point on a log scale.

    Raises:
        MissingDependencyError: matplotlib is not installed (``pip install 'pic[eval]'``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt
    except ImportError:
        raise MissingDependencyError("the fidelity plot needs matplotlib: pip install 'pic[eval]'") from None
    families: dict[str, list[PolicyScore]] = defaultdict(list)
    for s in report.scores:
        if s.mean_kl > 0:
            families[s.policy.partition(":")[0]].append(s)
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
