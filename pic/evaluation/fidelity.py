"""``evaluate_fidelity``: how far each policy's next-token distributions are from Full Recompute.

Every case is linked under Full Recompute and under each policy, side by side; per policy the report
gives the mean KL(FR || policy) of the next-token distributions at the query positions, top-1
agreement with FR, the NLL of the query's own continuation, the tokens recomputed, and link time.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from pic.api import PIC
from pic.evaluation.report import FidelityReport, PolicyScore
from pic.evaluation.workload import Case, Workload, sample_workload
from pic.link import Linked
from pic.link.policies import FullRecompute, Policy, resolve

# Parameters of each policy family, from light to heavy: the points of the KL-vs-recompute plot.
DEFAULT_POLICIES = (
    "naive",
    "legolink0",
    "mepic",
    "legolink:4",
    "legolink:8",
    "legolink:16",
    "legolink:32",
    "cacheblend:0.05",
    "cacheblend:0.15",
    "cacheblend:0.3",
)


@dataclass
class _Tally:
    """Per-case measurements of one policy."""

    kl: list[float] = field(default_factory=list)
    top1: list[float] = field(default_factory=list)
    nll: list[float] = field(default_factory=list)
    recomputed: list[int] = field(default_factory=list)
    recomputed_first: list[int] = field(default_factory=list)
    fraction: list[float] = field(default_factory=list)
    fraction_last: list[float] = field(default_factory=list)
    link_s: list[float] = field(default_factory=list)


def evaluate_fidelity(
    engine: PIC | None = None,
    *,
    workload: Workload | None = None,
    policies: Sequence[str | Policy] = DEFAULT_POLICIES,
    seed: int = 0,
    progress: bool = False,
) -> FidelityReport:
    """Compare policies with Full Recompute on a workload.

    Args:
        engine: the model to evaluate (default: the embedded stories260K, float32).
        workload: the cases (default: ``sample_workload(engine, seed=seed)``).
        policies: policy objects or spec strings; Full Recompute is always the reference row.

    Raises:
        PolicyError: an unknown policy spec.
        PicError: a case the engine rejects (too long, empty query, ...).
    """
    engine = engine or PIC.from_pretrained(dtype="float32")
    workload = workload or sample_workload(engine, seed=seed)
    resolved = [resolve(p) for p in policies]
    full = FullRecompute()
    tallies = {p.spec: _Tally() for p in [full, *resolved]}
    for case in tqdm(workload.cases, desc="pic eval fidelity", unit="case", disable=not progress):
        _link(engine, case, full).release()  # warm-up: the first link of a case pays one-off costs
        with _link(engine, case, full) as reference:
            ref_logp = reference.logits.log_softmax(-1)  # [Q, vocab]
            query = reference.input_ids[reference.layout.query.tokens]
            _score(tallies[full.spec], reference, ref_logp, query)
            for policy in resolved:
                with _link(engine, case, policy) as linked:
                    _score(tallies[policy.spec], linked, ref_logp, query)
    scores = [_summarize(spec, tally, tallies[full.spec]) for spec, tally in tallies.items()]
    spec = engine.spec
    return FidelityReport(
        model=spec.architecture,
        model_name=_model_name(engine),
        device=str(spec.device),
        dtype=str(spec.dtype).removeprefix("torch."),
        workload=workload.description,
        scores=scores,
    )


def _link(engine: PIC, case: Case, policy: Policy) -> Linked:
    ids = engine.compile(list(case.chunks), policy=policy)  # cached after the first policy needing them
    return engine.link(ids, case.query, policy=policy)


def _score(tally: _Tally, linked: Linked, ref_logp: torch.Tensor, query: torch.Tensor) -> None:
    logp = linked.logits.log_softmax(-1)  # [Q, vocab]
    tally.kl.append(float((ref_logp.exp() * (ref_logp - logp)).sum(-1).mean()))
    tally.top1.append(float((ref_logp.argmax(-1) == logp.argmax(-1)).float().mean()))
    if query.shape[0] > 1:  # row i predicts query token i + 1
        targets = query[1:].to(logp.device)
        tally.nll.append(float(-logp[:-1].gather(1, targets[:, None]).mean()))
    by_layer = linked.recomputed_by_layer
    tally.recomputed.append(linked.num_recomputed)
    tally.recomputed_first.append(by_layer[0])
    num_prompt = linked.input_ids.shape[0]
    tally.fraction.append(sum(by_layer) / (len(by_layer) * num_prompt))
    tally.fraction_last.append(by_layer[-1] / num_prompt)
    tally.link_s.append(linked.link_s)


def _summarize(spec: str, tally: _Tally, full: _Tally) -> PolicyScore:
    speedups = [f / p for f, p in zip(full.link_s, tally.link_s, strict=True)]
    return PolicyScore(
        policy=spec,
        mean_kl=statistics.fmean(tally.kl),
        top1_agreement=statistics.fmean(tally.top1),
        continuation_nll=statistics.fmean(tally.nll) if tally.nll else float("nan"),
        mean_recomputed=statistics.fmean(tally.recomputed),
        mean_recomputed_first_layer=statistics.fmean(tally.recomputed_first),
        recompute_fraction=statistics.fmean(tally.fraction),
        recompute_fraction_last_layer=statistics.fmean(tally.fraction_last),
        median_link_s=statistics.median(tally.link_s),
        median_speedup_vs_full=statistics.median(speedups),
    )


def _model_name(engine: PIC) -> str:
    """The Hub name, or the folder name of a local model (``stories260K`` for the embedded one)."""
    name = str(getattr(engine.runner.model, "name_or_path", "") or engine.spec.architecture)
    return os.path.basename(name.rstrip("/")) if os.path.isdir(name) else name
