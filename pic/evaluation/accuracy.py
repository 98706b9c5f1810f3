"""``evaluate_accuracy``: does each policy still answer the questions Full Recompute answers?

Fidelity (``evaluate_fidelity``) says how far a policy's next-token distributions are from Full
Recompute's; this says what that costs on a task. Every case of a multi-document QA workload
(``pic.evaluation.qa``) is put in the model's chat template (``PIC.chat_segments``), linked under Full
Recompute and under every policy side by side, and answered greedily; each reply is scored against the
case's answers, and each link is also measured as in the fidelity evaluation (KL and top-1 agreement
with Full Recompute, recomputed tokens, link time). The first ``num_sink_cases`` cases are linked once
more with the attention observer on, for the attention-sink profile (``pic.evaluation.sinks``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tqdm.auto import tqdm

from pic.engine import PIC, Linked, generate_together
from pic.errors import PicError
from pic.evaluation.accuracy_report import AccuracyReport, AccuracyScore, paired_difference, wilson_interval
from pic.evaluation.answers import AnswerScore, score_answer
from pic.evaluation.fidelity import LinkMeasurement, checked_policies, measure_link
from pic.evaluation.qa import QACase, QAKind, QAWorkload, qa_workload
from pic.evaluation.report import model_fields
from pic.evaluation.sinks import CaseSinks, measure_sinks, summarize_sinks
from pic.link.policies import FullRecompute, Policy


@dataclass(frozen=True)
class Outcome:
    """One policy on one case: its link measured against Full Recompute's, its reply and the reply's score."""

    link: LinkMeasurement
    reply: str
    score: AnswerScore


@dataclass(frozen=True)
class Row:
    """One row of the accuracy table: a policy, over chunks compiled alone or in the chat's context
    (``PIC.chat_context``: after the system turn). A policy that needs chunks in context is always linked so."""

    policy: Policy
    in_context: bool

    @property
    def label(self) -> str:
        return self.policy.spec + (CONTEXT_SUFFIX if self.in_context and not self.policy.needs_context else "")


# A policy spec followed by this compiles the chunks in the chat's context (``naive@context``).
CONTEXT_SUFFIX = "@context"
# The accuracy evaluation's default rows: every family, and the in-context variants that matter on SmolLM2.
ACCURACY_POLICIES = (
    "naive", "legolink0", "mepic", "legolink:16", "legolink:32", "cacheblend:0.15", "cacheblend:0.3",
    "prophetkv:0.2", "prophetkv:0.2@context", "a3:0.15", "ape", "naive@context", "legolink:16@context",
    "regions", "regions@context", "regions:0.2@context",
)  # fmt: skip


def accuracy_rows(engine: PIC, policies: Sequence[str | Policy]) -> list[Row]:
    """The table's rows: ``policies`` (specs, ``spec@context``, or objects) checked against the engine's model,
    Full Recompute and repeats dropped.

    Raises:
        PolicyError: an unknown spec, a bad argument, or a policy that cannot run on this model.
    """
    if isinstance(policies, (str, Policy)):
        policies = [policies]
    rows: dict[str, Row] = {}
    for item in policies:
        spec, in_context = item, False
        if isinstance(item, str) and item.endswith(CONTEXT_SUFFIX):
            spec, in_context = item.removesuffix(CONTEXT_SUFFIX), True
        (policy,) = checked_policies(engine, [spec]) or [FullRecompute()]
        row = Row(policy, in_context=in_context or policy.needs_context)
        if row.label != FullRecompute().spec:
            rows.setdefault(row.label, row)
    return list(rows.values())


def evaluate_accuracy(
    engine: PIC,
    *,
    workload: QAWorkload | None = None,
    policies: Sequence[str | Policy] = ACCURACY_POLICIES,
    max_new_tokens: int = 24,
    num_sink_cases: int = 20,
    progress: bool = False,
    on_case: Callable[[AccuracyReport], None] | None = None,
) -> AccuracyReport:
    """Score policies against Full Recompute on a QA workload.

    Args:
        engine: the model; it needs a chat template (``InvalidInputError`` otherwise, on the first case).
        workload: the cases (default: ``qa_workload()``, 200 cases of 4 documents).
        policies: policy objects or spec strings, checked before any work; Full Recompute is always the
            reference row, and a policy listed twice is scored once.
        max_new_tokens: the longest reply (greedy; a case's stop strings usually end it sooner).
        num_sink_cases: cases (the first ones) on which the attention-sink profile is measured.
        on_case: called after every case with the report so far (to save partial results).

    Raises:
        PolicyError: an unknown policy spec, or one that cannot run on this model (before any work).
        PicError: a case the engine rejects; the message names the case.
    """
    rows = accuracy_rows(engine, policies)
    workload = workload or qa_workload()
    full = Row(FullRecompute(), in_context=False)
    outcomes: dict[str, list[Outcome]] = {row.label: [] for row in [full, *rows]}
    sinks: list[dict[str, CaseSinks]] = []
    done: list[QACase] = []
    for number, case in enumerate(tqdm(workload.cases, desc="pic eval accuracy", unit="case", disable=not progress)):
        try:
            link = case_linker(engine, case)
            for label, outcome in _run_case(link, case, full, rows, max_new_tokens).items():
                outcomes[label].append(outcome)  # a case counts for every policy or for none
            if number < num_sink_cases:
                sinks.append(measure_sinks(engine, link, {row.label: row for row in [full, *rows]}))
        except PicError as exc:
            raise type(exc)(f"workload case {number}: {exc}") from exc
        done.append(case)
        if on_case is not None:
            on_case(_report(engine, workload, done, outcomes, sinks))
    return _report(engine, workload, done, outcomes, sinks)


def case_linker(engine: PIC, case: QACase) -> Callable[[Row], Linked]:
    """``link(row)``: the case's documents compiled for the row's policy (alone, or in the chat's context;
    cached after the first time) and linked where the chat template puts them, with the reply's start appended
    to the query."""
    messages = case.messages()
    prefix, query = engine.chat_segments(messages)
    query += case.answer_prefix
    documents = list(case.documents)
    context = engine.chat_context(messages)

    def link(row: Row) -> Linked:
        ids = engine.compile(documents, policy=row.policy, context=context if row.in_context else None, progress=False)
        return engine.link(ids, query, prefix=prefix, policy=row.policy)

    return link


def _run_case(
    link: Callable[[Row], Linked], case: QACase, full: Row, rows: list[Row], max_new_tokens: int
) -> dict[str, Outcome]:
    """The case under Full Recompute (the reference) and under every row: each linked and measured in turn,
    then all answered together (batched decoding gives each the reply it gets alone, at a fraction of the time)."""
    link(full).release()  # warm-up: the first link of a case pays one-off costs (and compiles)
    reference = link(full)
    ref_logp = reference.logits.log_softmax(-1)  # [Q, vocab]
    query = reference.input_ids[reference.layout.query.tokens]

    linked = {full.label: reference} | {row.label: link(row) for row in rows}
    measured = {label: measure_link(item, ref_logp, query) for label, item in linked.items()}
    replies = generate_together(list(linked.values()), max_new_tokens, stop=list(case.stop))  # decoded as a batch
    return {
        label: Outcome(link=measured[label], reply=reply.text, score=score_answer(reply.text, case))
        for label, reply in zip(linked, replies, strict=True)
    }


def _report(
    engine: PIC,
    workload: QAWorkload,
    cases: list[QACase],
    outcomes: dict[str, list[Outcome]],
    sinks: list[dict[str, CaseSinks]],
) -> AccuracyReport:
    full = outcomes[FullRecompute().spec]
    return AccuracyReport(
        **model_fields(engine),
        add_bos=bool(engine.config.add_bos),
        workload=workload.description,
        num_cases_evaluated=len(cases),
        scores=[_summarize(policy, measured, full, cases) for policy, measured in outcomes.items()],
        sinks=summarize_sinks(sinks),
    )


def _summarize(spec: str, measured: list[Outcome], full: list[Outcome], cases: list[QACase]) -> AccuracyScore:
    def mean(values) -> float:
        values = list(values)
        return statistics.fmean(values) if values else float("nan")

    correct = [m.score.correct for m in measured]
    low, high = wilson_interval(sum(correct), len(correct))
    pairs = list(zip(measured, full, strict=True))
    diff, diff_low, diff_high = paired_difference([int(m.score.correct) - int(f.score.correct) for m, f in pairs])
    kinds = [kind for kind in QAKind if any(c.kind is kind for c in cases)]
    single = [(c.gold[0], m.score.correct) for c, m in zip(cases, measured, strict=True) if len(c.gold) == 1]
    num_documents = max((len(c.documents) for c in cases), default=0)
    return AccuracyScore(
        policy=spec,
        accuracy=mean(correct),
        accuracy_low=low,
        accuracy_high=high,
        exact_match=mean(m.score.exact for m in measured),
        f1=mean(m.score.f1 for m in measured),
        accuracy_by_kind={
            kind.value: mean(m.score.correct for c, m in zip(cases, measured, strict=True) if c.kind is kind)
            for kind in kinds
        },
        accuracy_by_gold_position=[mean(ok for gold, ok in single if gold == i) for i in range(num_documents)],
        num_gained=sum(m.score.correct and not f.score.correct for m, f in pairs),
        num_lost=sum(f.score.correct and not m.score.correct for m, f in pairs),
        diff_vs_full=diff,
        diff_low=diff_low,
        diff_high=diff_high,
        same_reply_as_full=mean(m.reply == f.reply for m, f in pairs),
        mean_kl=mean(m.link.kl for m in measured),
        top1_agreement=mean(m.link.top1 for m in measured),
        answer_kl=mean(m.link.kl_last for m in measured),
        answer_top1=mean(m.link.top1_last for m in measured),
        mean_recomputed=mean(m.link.recomputed for m in measured),
        recompute_fraction=mean(m.link.fraction for m in measured),
        chunk_recompute_fraction=mean(m.link.chunk_fraction for m in measured),
        median_link_s=statistics.median(m.link.link_s for m in measured) if measured else float("nan"),
        median_speedup_vs_full=statistics.median(f.link.link_s / m.link.link_s for m, f in pairs)
        if pairs
        else float("nan"),
    )
