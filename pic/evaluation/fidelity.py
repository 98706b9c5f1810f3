"""``evaluate_fidelity``: how far each policy's next-token distributions are from Full Recompute.

Every case is linked under Full Recompute and under each policy, side by side; per policy the report
gives the mean KL(FR || policy) of the next-token distributions at the query positions, top-1
agreement with FR, the NLL of the query's own continuation, the tokens recomputed, and link time.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pic.engine import PIC, Linked
from pic.errors import PicError, PolicyError
from pic.evaluation.report import FidelityReport, PolicyScore, model_fields
from pic.evaluation.workload import Case, Workload, sample_workload
from pic.link.policies import FullRecompute, Policy, resolve
from pic.progress import tqdm

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
    "prophetkv:0.2",
    "a3:0.15",
    "regions",
)


@dataclass(frozen=True)
class LinkMeasurement:
    """One policy's link of one case, against Full Recompute's: KL(FR || policy) and top-1 agreement of the
    next-token distributions (mean over the query positions, and at the last one: the first generated
    token's), the NLL of the query's own continuation, tokens recomputed (last layer, first layer), the
    share of FR's token-layers recomputed (all layers, last layer), the share of the chunks' token-layers
    recomputed (``chunk_fraction``: every token-layer beyond one pass over the prefix and the query, over the
    chunks' token-layers; a probe's second run of the query counts), and the link's seconds."""

    kl: float
    top1: float
    kl_last: float
    top1_last: float
    nll: float | None  # None for a one-token query
    recomputed: int
    recomputed_first: int
    fraction: float
    fraction_last: float
    link_s: float
    chunk_fraction: float = float("nan")
    probe_tokens: int = 0


def evaluate_fidelity(
    engine: PIC | None = None,
    *,
    workload: Workload | None = None,
    policies: Sequence[str | Policy] = DEFAULT_POLICIES,
    seed: int = 0,
    progress: bool = False,
    on_case: Callable[[FidelityReport], None] | None = None,
) -> FidelityReport:
    """Compare policies with Full Recompute on a workload.

    Args:
        engine: the model to evaluate (default: the embedded stories260K, float32).
        workload: the cases (default: ``sample_workload(engine, seed=seed)``).
        policies: policy objects or spec strings, checked before any work. Full Recompute is always
            the reference row (listing it adds nothing); a policy listed twice is scored once.
        progress: show progress bars (sampling the workload, then the cases).
        on_case: called after every case with the report of the cases done so far (to save partial
            results: a long evaluation that fails or is interrupted keeps what it measured).

    Raises:
        PolicyError: an unknown policy spec, or one that cannot run on this model (before any work).
        PicError: a case the engine rejects (too long, empty query, ...); the message names the case.
    """
    engine = engine or PIC.from_pretrained(dtype="float32")
    resolved = fidelity_policies(engine, policies)
    workload = workload or sample_workload(engine, seed=seed, progress=progress)
    full = FullRecompute()
    tallies: dict[str, list[LinkMeasurement]] = {p.spec: [] for p in [full, *resolved]}
    cases = tqdm(workload.cases, desc="pic eval fidelity", unit="case", disable=not progress)
    for number, case in enumerate(cases):
        try:
            measured = _measure_case(engine, case, full, resolved)
        except PicError as exc:
            raise type(exc)(f"workload case {number}: {exc}") from exc
        for spec, measurement in measured.items():  # a case counts for every policy or for none
            tallies[spec].append(measurement)
        if on_case is not None:
            on_case(_report(engine, workload, tallies, num_cases=number + 1))
    return _report(engine, workload, tallies, num_cases=len(workload.cases))


def checked_policies(engine: PIC, policies: Sequence[str | Policy]) -> list[Policy]:
    """``policies`` resolved, each checked against ``engine``'s model, Full Recompute and repeats dropped.

    Raises:
        PolicyError: an unknown spec, a bad argument, or a policy that cannot run on this model.
    """
    if isinstance(policies, (str, Policy)):
        policies = [policies]
    unique: dict[str, Policy] = {}
    for policy in map(resolve, policies):
        policy.check_model(num_layers=engine.spec.num_layers)
        engine.compile_options(policy)  # e.g. LegoLink-0 needs a BOS token
        if policy.spec != FullRecompute().spec:
            unique.setdefault(policy.spec, policy)
    return list(unique.values())


def fidelity_policies(engine: PIC, policies: Sequence[str | Policy]) -> list[Policy]:
    """``checked_policies``, refusing those that link only chunks compiled in context (the fidelity cases are
    compiled alone: such a policy belongs in ``pic eval accuracy``).

    Raises:
        PolicyError: as ``checked_policies``, or a policy that needs chunks compiled in context.
    """
    checked = checked_policies(engine, policies)
    for policy in checked:
        if policy.needs_context:
            raise PolicyError(
                f"policy {policy.spec!r} links only chunks compiled in context, which the fidelity evaluation does "
                f"not compile; evaluate it with `pic eval accuracy` (chunks compiled in the chat's context)"
            )
    return checked


def _report(
    engine: PIC, workload: Workload, tallies: dict[str, list[LinkMeasurement]], *, num_cases: int
) -> FidelityReport:
    full = tallies[FullRecompute().spec]
    return FidelityReport(
        **model_fields(engine),
        workload=workload.description,
        num_cases_evaluated=num_cases,
        scores=[_summarize(policy, tally, full) for policy, tally in tallies.items()],
    )


def _link(engine: PIC, case: Case, policy: Policy) -> Linked:
    ids = engine.compile(list(case.chunks), policy=policy)  # cached after the first policy needing them
    return engine.link(ids, case.query, policy=policy)


def _measure_case(engine: PIC, case: Case, full: Policy, policies: list[Policy]) -> dict[str, LinkMeasurement]:
    """One case under Full Recompute (the reference) and under every policy."""
    _link(engine, case, full).release()  # warm-up: the first link of a case pays one-off costs
    with _link(engine, case, full) as reference:
        ref_logp = reference.logits.log_softmax(-1)  # [Q, vocab]
        query = reference.input_ids[reference.layout.query.tokens]
        measured = {full.spec: measure_link(reference, ref_logp, query)}
        for policy in policies:
            with _link(engine, case, policy) as linked:
                measured[policy.spec] = measure_link(linked, ref_logp, query)
    return measured


def measure_link(linked: Linked, ref_logp: torch.Tensor, query: torch.Tensor) -> LinkMeasurement:
    logp = linked.logits.log_softmax(-1)  # [Q, vocab]
    nll = None
    if query.shape[0] > 1:  # row i predicts query token i + 1
        targets = query[1:].to(logp.device)
        nll = float(-logp[:-1].gather(1, targets[:, None]).mean())
    by_layer = linked.recomputed_by_layer
    num_prompt = linked.input_ids.shape[0]
    num_probe = int(linked.probe.recomputed.sum()) if linked.probe is not None else 0  # every layer, first
    num_chunk = int(linked.layout.cached.sum())
    beyond = sum(by_layer) - len(by_layer) * (num_prompt - num_chunk)  # token-layers past one prefix+query pass
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)  # [Q]
    top1 = (ref_logp.argmax(-1) == logp.argmax(-1)).float()  # [Q]
    return LinkMeasurement(
        kl=float(kl.mean()),
        top1=float(top1.mean()),
        kl_last=float(kl[-1]),
        top1_last=float(top1[-1]),
        nll=nll,
        recomputed=linked.num_recomputed,
        recomputed_first=by_layer[0] - num_probe,
        fraction=sum(by_layer) / (len(by_layer) * num_prompt),
        fraction_last=by_layer[-1] / num_prompt,
        link_s=linked.link_s,
        chunk_fraction=beyond / (len(by_layer) * num_chunk) if num_chunk else float("nan"),
        probe_tokens=num_probe,
    )


def _summarize(spec: str, measured: list[LinkMeasurement], full: list[LinkMeasurement]) -> PolicyScore:
    def mean(field: str) -> float:
        return statistics.fmean(getattr(m, field) for m in measured)

    nll = [m.nll for m in measured if m.nll is not None]
    return PolicyScore(
        policy=spec,
        mean_kl=mean("kl"),
        top1_agreement=mean("top1"),
        continuation_nll=statistics.fmean(nll) if nll else float("nan"),
        mean_recomputed=mean("recomputed"),
        mean_recomputed_first_layer=mean("recomputed_first"),
        mean_probe_tokens=mean("probe_tokens"),
        recompute_fraction=mean("fraction"),
        recompute_fraction_last_layer=mean("fraction_last"),
        median_link_s=statistics.median(m.link_s for m in measured),
        median_speedup_vs_full=statistics.median(f.link_s / m.link_s for f, m in zip(full, measured, strict=True)),
    )
