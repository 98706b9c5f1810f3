"""The accuracy report: per policy, task accuracy (with its interval) beside fidelity and cost."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from pic.evaluation.report import ReportMethods
from pic.evaluation.sinks import SinkProfile


@dataclass(frozen=True)
class AccuracyScore:
    """One policy over the workload's cases.

    Attributes:
        policy: the policy's spec string.
        accuracy: share of cases whose reply holds every answer (``pic.evaluation.answers.score_answer``).
        accuracy_low, accuracy_high: its 95% Wilson score interval.
        exact_match: share of replies equal to the reference answer (SQuAD normalization).
        f1: mean token F1 of the replies against the reference.
        accuracy_by_kind: accuracy per question kind (``passkey``, ``fact``, ``two-docs``, ``profile``,
            ``niah-single``, ``niah-multikey``, ``niah-multivalue``, ``musique``).
        accuracy_by_gold_position: for one-document questions, accuracy by the index of the document
            holding the answer (0: first linked); empty when no case knows its gold documents (MuSiQue's
            file from CacheBlend).
        num_gained, num_lost: cases this policy answers correctly and Full Recompute does not, and the
            reverse (paired: the same cases).
        diff_vs_full, diff_low, diff_high: the paired difference in accuracy from Full Recompute
            (``(num_gained - num_lost) / cases``) and its 95% interval (normal approximation over the
            per-case differences).
        same_reply_as_full: share of replies identical to Full Recompute's.
        mean_kl, top1_agreement: KL(FR || policy) in nats and top-1 agreement of the next-token
            distributions, mean over the query positions.
        answer_kl, answer_top1: the same at the last prompt position: the answer's first token.
        mean_recomputed: tokens recomputed through the last layer (prefix and query included).
        recompute_fraction: recomputed token-layers over Full Recompute's (the recompute pass's cost).
        chunk_recompute_fraction: token-layers run beyond one pass over the prefix and query, over the chunks'
            token-layers: the share of the chunks recomputed, a probe's second run of the query included.
        median_link_s, median_speedup_vs_full: link time, and FR's link time over it per case (median).
        order: the order the row asked for (``"policy"``: the policy's choice, ``"given"``, ``"relevance"``).
        reordered: share of cases whose chunks ran in another order than the caller's.
        full_link_order_accuracy: Full Recompute's accuracy with the chunks in the order this row's links ran.
        diff_vs_link_order, diff_link_order_low, diff_link_order_high: the paired difference from Full Recompute
            in that order, and its 95% interval: the link's own fidelity, the order's effect left out.
        gold_last: share of the cases that know their gold documents where the link's order put them all last, next
            to the query (where ``auto`` recomputes): a ranking's hit rate (NaN: no case knows its gold).
        f1_diff_vs_full, f1_diff_low, f1_diff_high: the mean per-case difference of this policy's F1 from Full
            Recompute's (in the caller's order, the same cases) and its 95% paired bootstrap interval
            (``paired_bootstrap``): MuSiQue's metric, and CacheBlend's comparison, F1 against F1.
    """

    policy: str
    accuracy: float
    accuracy_low: float
    accuracy_high: float
    exact_match: float
    f1: float
    accuracy_by_kind: dict[str, float]
    accuracy_by_gold_position: list[float]
    num_gained: int
    num_lost: int
    diff_vs_full: float
    diff_low: float
    diff_high: float
    same_reply_as_full: float
    mean_kl: float
    top1_agreement: float
    answer_kl: float
    answer_top1: float
    mean_recomputed: float
    recompute_fraction: float
    chunk_recompute_fraction: float
    median_link_s: float
    median_speedup_vs_full: float
    order: str = "policy"
    reordered: float = 0.0
    full_link_order_accuracy: float = float("nan")
    diff_vs_link_order: float = float("nan")
    diff_link_order_low: float = float("nan")
    diff_link_order_high: float = float("nan")
    f1_diff_vs_full: float = float("nan")
    f1_diff_low: float = float("nan")
    f1_diff_high: float = float("nan")
    gold_last: float = float("nan")


@dataclass(frozen=True)
class AccuracyReport(ReportMethods):
    """The result of ``evaluate_accuracy``; the first score is Full Recompute's. ``sinks`` holds the
    attention-sink profile per policy (``pic.evaluation.sinks``), measured on the first cases."""

    model: str
    model_name: str
    device: str
    dtype: str
    add_bos: bool
    workload: dict[str, object]
    num_cases_evaluated: int
    scores: list[AccuracyScore]
    sinks: list[SinkProfile]

    def table(self) -> str:
        """A Markdown table, one row per policy."""
        kinds = list(self.scores[0].accuracy_by_kind) if self.scores else []
        rows = [
            "| policy | accuracy (95% CI) | "
            + "".join(f"{k} | " for k in kinds)
            + "+/- vs FR | paired diff (95% CI) | reordered | vs FR in its order (95% CI) | same reply as FR "
            "| F1 (paired F1 diff, 95% bootstrap CI) | KL to FR (answer token) | top-1 agree (answer) "
            "| chunk token-layers recomputed | recomputed token-layers | link ms (speedup vs FR) |",
            "|---|---:|" + "---:|" * len(kinds) + "---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for s in self.scores:
            by_kind = "".join(f"{_pct(s.accuracy_by_kind[k])} | " for k in kinds)
            rows.append(
                f"| {s.policy} | {_pct(s.accuracy)} ({_pct(s.accuracy_low)}-{_pct(s.accuracy_high)}) | {by_kind}"
                f"+{s.num_gained}/-{s.num_lost} | {_signed(s.diff_vs_full)} ({_signed(s.diff_low)} to "
                f"{_signed(s.diff_high)}) | {_pct(s.reordered)} | {_signed(s.diff_vs_link_order)} "
                f"({_signed(s.diff_link_order_low)} to {_signed(s.diff_link_order_high)}) "
                f"| {_pct(s.same_reply_as_full)} "
                f"| {s.f1:.3f} ({_signed_f1(s.f1_diff_vs_full)}: {_signed_f1(s.f1_diff_low)} to "
                f"{_signed_f1(s.f1_diff_high)}) "
                f"| {s.mean_kl:.3f} ({s.answer_kl:.3f}) | {_pct(s.top1_agreement)} ({_pct(s.answer_top1)}) "
                f"| {_pct(s.chunk_recompute_fraction)} | {_pct(s.recompute_fraction)} "
                f"| {1e3 * s.median_link_s:.0f} ({s.median_speedup_vs_full:.2f}x) |"
            )
        return "\n".join(rows)


def _pct(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{100 * value:.1f}%"


def _signed(value: float) -> str:
    """A difference of proportions in points: ``+1.5``, ``-12.0``."""
    return "n/a" if math.isnan(value) else f"{100 * value:+.1f}"


def _signed_f1(value: float) -> str:
    """A difference of mean F1s, in F1's own units: ``+0.012``."""
    return "n/a" if math.isnan(value) else f"{value:+.3f}"


def paired_bootstrap(
    diffs: list[float], *, num_resamples: int = 2000, seed: int = 0, confidence: float = 0.95
) -> tuple[float, float, float]:
    """The mean of per-case differences (a policy's F1 minus Full Recompute's on the same case) and its paired
    bootstrap percentile interval: the cases resampled with replacement ``num_resamples`` times from
    ``random.Random(seed)``, so the same differences give the same interval on every machine. F1 is not a
    proportion of 0s and 1s and many differences are 0 (identical replies), so a resampled interval, not the normal
    approximation, says how far the mean can be trusted. The bounds hold the mean itself; all differences equal
    give that value three times (every resample's mean)."""
    n = len(diffs)
    if n == 0:
        return math.nan, math.nan, math.nan
    mean = math.fsum(diffs) / n
    if all(d == diffs[0] for d in diffs):
        return mean, mean, mean
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(diffs, k=n)) / n for _ in range(num_resamples))
    tail = (1 - confidence) / 2
    return mean, min(mean, _quantile(means, tail)), max(mean, _quantile(means, 1 - tail))


def _quantile(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of sorted values, interpolated linearly between the two nearest (numpy's default)."""
    where = q * (len(ordered) - 1)
    below = math.floor(where)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (where - below) * (ordered[above] - ordered[below])


def paired_difference(diffs: list[int], *, z: float = 1.96) -> tuple[float, float, float]:
    """Mean of per-case differences (each -1, 0 or 1: a policy's correctness minus Full Recompute's on the same
    case) and its 95% interval by the normal approximation (``mean +- z * sd / sqrt(n)``, within [-1, 1])."""
    n = len(diffs)
    if n == 0:
        return math.nan, math.nan, math.nan
    mean = sum(diffs) / n
    var = sum((d - mean) ** 2 for d in diffs) / (n - 1) if n > 1 else 0.0
    half = z * math.sqrt(var / n)
    return mean, max(-1.0, mean - half), min(1.0, mean + half)


def wilson_interval(successes: int, trials: int, *, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (95% for ``z=1.96``): unlike the normal
    approximation, it stays inside [0, 1] and is sound near 0% and 100% and for a few hundred trials."""
    if trials == 0:
        return math.nan, math.nan
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    # the bounds hold the proportion itself: at 0% and 100% the formula's rounding lands a last bit inside it
    return min(p, max(0.0, centre - half)), max(p, min(1.0, centre + half))
