"""``evaluate_accuracy``: does each policy still answer the questions Full Recompute answers?

Fidelity (``evaluate_fidelity``) says how far a policy's next-token distributions are from Full
Recompute's; this says what that costs on a task. Every case of a multi-document QA workload
(``pic.evaluation.qa``) is put in the model's chat template (``PIC.chat_segments``), linked under Full
Recompute and under every policy side by side, and answered greedily; each reply is scored against the
case's answers, and each link is also measured as in the fidelity evaluation (KL and top-1 agreement
with Full Recompute, recomputed tokens, link time). The first ``num_sink_cases`` cases are linked once
more with the attention observer on, for the attention-sink profile (``pic.evaluation.sinks``).

A row may reorder the chunks (``Row.order``: ``spec/relevance``, or ``auto``'s own choice), and then it is scored
against two references, paired on the same cases: Full Recompute in the caller's order (what the user gets
without pic: ``diff_vs_full``) and Full Recompute in the order the row's link ran (``diff_vs_link_order``: the
link's own fidelity, the order's effect left out).

Each row's mean F1 is paired with Full Recompute's too (``f1_diff_vs_full``, with a bootstrap interval): F1 is
MuSiQue's metric and CacheBlend's comparison (``pic.evaluation.musique``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from pic.engine import PIC, Linked, generate_together
from pic.errors import PicError
from pic.evaluation.accuracy_report import (
    AccuracyReport,
    AccuracyScore,
    paired_bootstrap,
    paired_difference,
    wilson_interval,
)
from pic.evaluation.answers import AnswerScore, score_answer
from pic.evaluation.fidelity import LinkMeasurement, checked_policies, measure_link
from pic.evaluation.qa import QACase, QAKind, QAWorkload, qa_workload
from pic.evaluation.report import model_fields
from pic.evaluation.sinks import CaseSinks, measure_sinks, summarize_sinks
from pic.link.order import Order, parse_order
from pic.link.policies import FullRecompute, Policy
from pic.progress import tqdm


@dataclass(frozen=True)
class Outcome:
    """One policy on one case: its link measured against Full Recompute's, its reply and the reply's score, the
    order its chunks ran in (the case's document indices), and whether Full Recompute in that order answered."""

    link: LinkMeasurement
    reply: str
    score: AnswerScore
    order: tuple[int, ...] = ()
    full_in_order: bool = False


CaseOutcomes = dict[str, "Outcome"]  # one case: each row's label -> its outcome


@dataclass(frozen=True)
class Row:
    """One row of the accuracy table: a policy, over chunks compiled alone or in the chat's context
    (``PIC.chat_context``: after the system turn), in an order (``Order.POLICY``: the policy's choice). A policy
    that needs chunks in context is always linked so."""

    policy: Policy
    in_context: bool
    order: Order = Order.POLICY

    @property
    def label(self) -> str:
        label = self.policy.spec + (CONTEXT_SUFFIX if self.in_context and not self.policy.needs_context else "")
        return label if self.order is Order.POLICY else f"{label}{ORDER_SEPARATOR}{self.order.value}"


# A policy spec followed by this compiles the chunks in the chat's context (``naive@context``).
CONTEXT_SUFFIX = "@context"
# Then this and an order's name links the chunks in that order (``auto@context/relevance``, ``full/given``).
ORDER_SEPARATOR = "/"
# The accuracy evaluation's default rows: every family, and the in-context variants that matter on SmolLM2.
ACCURACY_POLICIES = (
    "naive", "legolink0", "mepic", "legolink:16", "legolink:32", "cacheblend:0.15", "cacheblend:0.3",
    "prophetkv:0.2", "prophetkv:0.2@context", "a3:0.15", "ape", "naive@context", "legolink:16@context",
    "regions", "regions@context", "regions:0.2@context",
)  # fmt: skip


def accuracy_rows(
    engine: PIC, policies: Sequence[str | Policy], orders: Sequence[str | Order] = (Order.POLICY,)
) -> list[Row]:
    """The table's rows: ``policies`` (specs, ``spec@context``, ``spec[@context]/order``, or objects) checked
    against the engine's model, each in every order of ``orders`` unless its spec names one; Full Recompute in
    the caller's order (the reference) and repeats dropped.

    Raises:
        PolicyError: an unknown spec, a bad argument, or a policy that cannot run on this model.
        InvalidInputError: an unknown order.
    """
    if isinstance(policies, (str, Policy)):
        policies = [policies]
    orders = [parse_order(o) for o in ([orders] if isinstance(orders, (str, Order)) else orders)]
    rows: dict[str, Row] = {}
    for item in policies:
        spec, in_context, item_orders = item, False, orders
        if isinstance(item, str) and ORDER_SEPARATOR in item:
            spec, order = item.rsplit(ORDER_SEPARATOR, 1)
            item_orders = [parse_order(order)]
        if isinstance(spec, str) and spec.endswith(CONTEXT_SUFFIX):
            spec, in_context = spec.removesuffix(CONTEXT_SUFFIX), True
        (policy,) = checked_policies(engine, [spec]) or [FullRecompute()]
        for order in item_orders:
            row = Row(policy, in_context=in_context or policy.needs_context, order=order)
            if not _is_reference(row):
                rows.setdefault(row.label, row)
    return list(rows.values())


def _is_reference(row: Row) -> bool:
    """Full Recompute in the caller's order over chunks compiled alone: the table's first row."""
    return isinstance(row.policy, FullRecompute) and not row.in_context and row.order in (Order.POLICY, Order.GIVEN)


def evaluate_accuracy(
    engine: PIC,
    *,
    workload: QAWorkload | None = None,
    policies: Sequence[str | Policy] = ACCURACY_POLICIES,
    orders: Sequence[str | Order] = (Order.POLICY,),
    max_new_tokens: int = 24,
    num_sink_cases: int = 20,
    progress: bool = False,
    on_case: Callable[[AccuracyReport], None] | None = None,
    done: Mapping[int, CaseOutcomes] | None = None,
    on_outcomes: Callable[[int, CaseOutcomes], None] | None = None,
) -> AccuracyReport:
    """Score policies against Full Recompute on a QA workload.

    Args:
        engine: the model; it needs a chat template (``InvalidInputError`` otherwise, on the first case).
        workload: the cases (default: ``qa_workload()``, 200 cases of 4 documents).
        policies: policy objects or spec strings, checked before any work; Full Recompute is always the
            reference row, and a policy listed twice is scored once.
        orders: the orders every policy runs in (a spec ``spec/order`` names its own): ``"policy"`` (the
            policy's choice), ``"given"``, ``"relevance"``.
        max_new_tokens: the longest reply (greedy; a case's stop strings usually end it sooner; MuSiQue's cases
            have none, and CacheBlend gives them ``pic.evaluation.musique.MAX_NEW_TOKENS``, 32).
        num_sink_cases: cases (the first ones) on which the attention-sink profile is measured.
        on_case: called after every case with the report so far (to save partial results).
        done: the outcomes of cases run before (by case number: ``pic.evaluation.case_log``), not run again.
        on_outcomes: called after every case run with its number and outcomes (to log them for a resume).

    Raises:
        PolicyError: an unknown policy spec, or one that cannot run on this model (before any work).
        PicError: a case the engine rejects; the message names the case.
    """
    rows = accuracy_rows(engine, policies, orders)
    workload = workload or qa_workload()
    full = Row(FullRecompute(), in_context=False)
    labels = [row.label for row in [full, *rows]]
    outcomes: dict[str, list[Outcome]] = {label: [] for label in labels}
    sinks: list[dict[str, CaseSinks]] = []
    cases: list[QACase] = []
    for number, case in enumerate(tqdm(workload.cases, desc="pic eval accuracy", unit="case", disable=not progress)):
        try:
            if done is not None and number in done:
                found = {label: done[number][label] for label in labels}  # KeyError: checked by the caller
            else:
                link = case_linker(engine, case)
                found = _run_case(link, case, full, rows, max_new_tokens)
                if number < num_sink_cases:
                    sinks.append(measure_sinks(engine, link, {row.label: row for row in [full, *rows]}))
                if on_outcomes is not None:
                    on_outcomes(number, found)
        except PicError as exc:
            raise type(exc)(f"workload case {number}: {exc}") from exc
        for label, outcome in found.items():
            outcomes[label].append(outcome)  # a case counts for every policy or for none
        cases.append(case)
        if on_case is not None:
            on_case(_report(engine, workload, cases, outcomes, sinks))
    return _report(engine, workload, cases, outcomes, sinks)


def case_linker(engine: PIC, case: QACase) -> Callable[..., Linked]:
    """``link(row, indices=None)``: the case's documents compiled for the row's policy (alone, or in the chat's
    context; cached after the first time) and linked where the chat template puts them, in the row's order, with
    the reply's start appended to the query. ``indices``: link the documents in that order, as given."""
    messages = case.messages()
    prefix, query = engine.chat_segments(messages)
    query += case.answer_prefix
    documents = list(case.documents)
    context = engine.chat_context(messages)

    def link(row: Row, indices: Sequence[int] | None = None) -> Linked:
        ids = engine.compile(documents, policy=row.policy, context=context if row.in_context else None, progress=False)
        if indices is not None:
            return engine.link([ids[i] for i in indices], query, prefix=prefix, policy=row.policy, order=Order.GIVEN)
        return engine.link(ids, query, prefix=prefix, policy=row.policy, order=row.order)

    return link


def _run_case(
    link: Callable[..., Linked], case: QACase, full: Row, rows: list[Row], max_new_tokens: int
) -> CaseOutcomes:
    """The case under Full Recompute (the reference) and under every row, and Full Recompute again in each other
    order a row ran: each linked and measured in turn, then all answered together (batched decoding gives each
    the reply it gets alone, at a fraction of the time)."""
    link(full).release()  # warm-up: the first link of a case pays one-off costs (and compiles)
    reference = link(full)
    ref_logp = reference.logits.log_softmax(-1)  # [Q, vocab]
    query = reference.input_ids[reference.layout.query.tokens]

    linked = {full.label: reference} | {row.label: link(row) for row in rows}
    orders = {label: item.order.indices for label, item in linked.items()}
    in_order = {indices: link(full, indices) for indices in set(orders.values()) - {orders[full.label]}}
    measured = {label: measure_link(item, ref_logp, query) for label, item in linked.items()}
    everything = [*linked.values(), *in_order.values()]
    replies = generate_together(everything, max_new_tokens, stop=list(case.stop))  # decoded as a batch
    scores = [score_answer(reply.text, case) for reply in replies]
    full_scores = [scores[0], *scores[len(linked) :]]  # FR in the caller's order, then in each other order
    full_correct = {
        indices: score.correct for indices, score in zip([orders[full.label], *in_order], full_scores, strict=True)
    }
    return {
        label: Outcome(
            link=measured[label],
            reply=reply.text,
            score=score,
            order=orders[label],
            full_in_order=full_correct[orders[label]],
        )  # fmt: skip
        for label, reply, score in zip(linked, replies, scores, strict=False)
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
    in_order = paired_difference([int(m.score.correct) - int(m.full_in_order) for m in measured])
    f1_diff = paired_bootstrap([m.score.f1 - f.score.f1 for m, f in pairs])
    kinds = [kind for kind in QAKind if any(c.kind is kind for c in cases)]
    single = [(c.gold[0], m.score.correct) for c, m in zip(cases, measured, strict=True) if len(c.gold) == 1]
    # no case that knows its gold documents (CacheBlend's MuSiQue file does not say): no positions to score by
    num_documents = max((len(c.documents) for c in cases), default=0) if any(c.gold for c in cases) else 0
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
        order=spec.rsplit(ORDER_SEPARATOR, 1)[1] if ORDER_SEPARATOR in spec else Order.POLICY.value,
        reordered=mean(m.order != tuple(range(len(m.order))) for m in measured),
        full_link_order_accuracy=mean(m.full_in_order for m in measured),
        diff_vs_link_order=in_order[0],
        diff_link_order_low=in_order[1],
        diff_link_order_high=in_order[2],
        f1_diff_vs_full=f1_diff[0],
        f1_diff_low=f1_diff[1],
        f1_diff_high=f1_diff[2],
        gold_last=mean(
            set(m.order[len(m.order) - len(c.gold) :]) == set(c.gold)
            for c, m in zip(cases, measured, strict=True)
            if c.gold and m.order
        ),
    )
