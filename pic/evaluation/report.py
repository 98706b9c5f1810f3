"""The fidelity report: one score per policy, as JSON and as a Markdown table."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pic.errors import PolicyError

if TYPE_CHECKING:
    from pic.engine import PIC


@dataclass(frozen=True)
class PolicyScore:
    """How one policy compares with Full Recompute, averaged over the workload's cases.

    Attributes:
        policy: the policy's spec string.
        mean_kl: mean KL(FR || policy) in nats of the next-token distributions at the query positions.
        top1_agreement: fraction of query positions whose most likely next token equals FR's.
        continuation_nll: mean negative log-likelihood (nats/token) of the query's own tokens.
        mean_recomputed: tokens recomputed through the last layer (prefix and query included).
        mean_recomputed_first_layer: tokens recomputed in the first layer (differs for CacheBlend and A³),
            a probe's aside.
        mean_probe_tokens: tokens a query-aware policy's probe ran through every layer before its pass.
        recompute_fraction: recomputed token-layers over all prompt token-layers (the compute cost
            of the recompute pass relative to Full Recompute, ignoring attention length).
        recompute_fraction_last_layer: tokens recomputed in the last layer over prompt tokens.
        median_link_s: median seconds per ``link`` call.
        median_speedup_vs_full: median over cases of FR's link time over this policy's, measured
            side by side.
    """

    policy: str
    mean_kl: float
    top1_agreement: float
    continuation_nll: float
    mean_recomputed: float
    mean_recomputed_first_layer: float
    recompute_fraction: float
    recompute_fraction_last_layer: float
    median_link_s: float
    median_speedup_vs_full: float
    mean_probe_tokens: float = 0.0


class ReportMethods:
    """What every evaluation report (a frozen dataclass with a ``scores`` list of per-policy scores) offers:
    a score by policy, plain JSON-able data, and a JSON file."""

    def score(self, policy: str):
        """The score of a policy by spec string (``"legolink:16"``)."""
        for s in self.scores:
            if s.policy == policy:
                return s
        raise PolicyError(f"no score for policy {policy!r}; the report has {[s.policy for s in self.scores]}")

    def to_dict(self) -> dict[str, object]:
        """Plain JSON-able data; a measurement that does not exist (NaN) becomes ``None``."""
        return json_number(dataclasses.asdict(self))

    def save_json(self, path: str | os.PathLike) -> None:
        with open(path, "w", encoding="utf-8") as file:
            json.dump(self.to_dict(), file, indent=2, allow_nan=False)
            file.write("\n")


@dataclass(frozen=True)
class FidelityReport(ReportMethods):
    """The result of ``evaluate_fidelity``; the first score is Full Recompute itself.

    ``num_cases_evaluated`` is the number of the workload's cases the scores cover: all of them in a
    finished report, fewer in the partial reports ``evaluate_fidelity(on_case=...)`` hands out.
    """

    model: str
    model_name: str
    device: str
    dtype: str
    workload: dict[str, object]
    num_cases_evaluated: int
    scores: list[PolicyScore]

    def table(self) -> str:
        """A Markdown table, one row per policy."""
        rows = [
            "| policy | mean KL to FR (nats) | KL / naive | top-1 agree | continuation NLL | recomputed tokens "
            "| recomputed token-layers | link speedup vs FR |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        naive = next((s.mean_kl for s in self.scores if s.policy == "naive"), math.nan)
        for s in self.scores:
            recomputed = f"{s.mean_recomputed:.1f}"
            if s.mean_recomputed_first_layer != s.mean_recomputed:
                recomputed = f"{s.mean_recomputed_first_layer:.1f} then {recomputed}"
            if s.mean_probe_tokens:
                recomputed += f" (+{s.mean_probe_tokens:.1f} in the probe)"
            ratio = s.mean_kl / naive if naive > 0 else math.nan
            rows.append(
                f"| {s.policy} | {s.mean_kl:.2e} | {ratio:.2f} | {s.top1_agreement:.1%} | {s.continuation_nll:.3f} "
                f"| {recomputed} | {s.recompute_fraction:.1%} | {s.median_speedup_vs_full:.2f}x |"
            )
        return "\n".join(rows)


def model_fields(engine: PIC) -> dict[str, str]:
    """What a report says of the model it evaluated: ``model`` (architecture), ``model_name``, ``device``, ``dtype``."""
    spec = engine.spec
    return {
        "model": spec.architecture,
        "model_name": engine.model_name,
        "device": str(spec.device),
        "dtype": str(spec.dtype).removeprefix("torch."),
    }


def json_number(value: object) -> object:
    """``value`` with every non-finite float in it (in lists and dicts too) replaced by ``None``."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_number(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_number(v) for v in value]
    return value
