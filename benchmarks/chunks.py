"""Fidelity and accuracy against the number of linked chunks (2-16) and their order, on a real model.

python benchmarks/chunks.py                    # SmolLM2-135M-Instruct -> benchmarks/results/smollm2_chunks.json, .png
python benchmarks/chunks.py --quick --out DIR  # a smoke run (2 cases per point, 2 policies)

The workload is ``pic eval accuracy``'s multi-document QA (``pic.evaluation.qa``) with 2, 4, 8 and 16
documents per question, the same seed for every count. Each count is evaluated with ``evaluate_accuracy``:
accuracy with its interval, and KL / top-1 agreement with Full Recompute at the answer token and over the
query. For order, the 4-document cases are also linked with their documents reversed: the same questions,
the same documents, other positions; what changes is which chunk follows which, and the answer document's
distance from the question.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

import pic
from pic.evaluation.accuracy import evaluate_accuracy
from pic.evaluation.accuracy_report import AccuracyReport
from pic.evaluation.qa import QAWorkload, qa_workload
from pic.evaluation.report import json_number

RESULTS = Path(__file__).resolve().parent / "results"
POLICIES = ("naive", "legolink:16", "mepic", "cacheblend:0.15")


def summary(report: AccuracyReport) -> dict[str, dict[str, float]]:
    """Per policy, the figures this benchmark plots (from the full report)."""
    keys = ("accuracy", "accuracy_low", "accuracy_high", "answer_kl", "answer_top1", "mean_kl", "top1_agreement")
    return {s.policy: {k: getattr(s, k) for k in keys} for s in report.scores}


def reversed_workload(workload: QAWorkload) -> QAWorkload:
    cases = tuple(c.reordered(list(range(len(c.documents)))[::-1]) for c in workload.cases)
    return QAWorkload(cases=cases, description={**workload.description, "order": "reversed"})


def run(engine: pic.PIC, *, counts: list[int], num_cases: int, policies: list[str], seed: int) -> dict:
    by_count, prompt_tokens, reports = {}, {}, {}
    for n in counts:
        start = time.perf_counter()
        workload = qa_workload(num_cases=num_cases, num_documents=n, seed=seed)
        reports[n] = evaluate_accuracy(engine, workload=workload, policies=policies, num_sink_cases=0)
        by_count[str(n)] = summary(reports[n])
        prompt_tokens[str(n)] = reports[n].score("full").mean_recomputed  # Full Recompute runs every token
        print(f"{n} documents: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    n = 4 if 4 in counts else counts[0]
    backwards = evaluate_accuracy(
        engine, workload=reversed_workload(qa_workload(num_cases=num_cases, num_documents=n, seed=seed)),
        policies=policies, num_sink_cases=0,
    )  # fmt: skip
    return {
        "by_num_documents": by_count,
        "mean_prompt_tokens": prompt_tokens,
        "order": {"num_documents": n, "as_drawn": summary(reports[n]), "reversed": summary(backwards)},
        "accuracy_by_gold_position": {s.policy: s.accuracy_by_gold_position for s in reports[n].scores},
    }


def plot(results: dict, path: Path) -> None:
    from matplotlib import pyplot as plt

    counts = [int(n) for n in results["by_num_documents"]]
    fig, (acc, kl) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=110)
    for number, policy in enumerate(results["by_num_documents"][str(counts[0])]):
        rows = [results["by_num_documents"][str(n)][policy] for n in counts]
        y = [100 * r["accuracy"] for r in rows]
        low = [100 * (r["accuracy"] - r["accuracy_low"]) for r in rows]
        high = [100 * (r["accuracy_high"] - r["accuracy"]) for r in rows]
        style = {"marker": "o", "label": policy, "color": f"C{number}"}  # one colour per policy in both panels
        acc.errorbar(counts, y, yerr=[low, high], capsize=3, **style)
        if policy != "full":
            kl.plot(counts, [r["answer_kl"] for r in rows], **style)
    acc.set(xlabel="documents (chunks) per question", ylabel="accuracy (%), 95% interval", ylim=(0, 100))
    kl.set(xlabel="documents (chunks) per question", ylabel="KL(FR || policy) at the answer token, nats")
    for ax in (acc, kl):
        ax.set_xscale("log", base=2)
        ax.minorticks_off()
        ax.set_xticks(counts, [str(n) for n in counts])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{results['model']}: accuracy and fidelity against the number of linked chunks")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--cases", type=int, default=50, help="questions per document count (default 50)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 cases, counts 2 and 4, two policies")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for smollm2_chunks.json and .png")
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = pic.load(args.model, dtype="float32")
    counts, cases, policies = ([2, 4], 2, ["naive", "mepic"]) if args.quick else ([2, 4, 8, 16], args.cases, POLICIES)
    results = {
        "command": " ".join(["python", *sys.argv]),
        "model": engine.model_name,
        "device": f"{platform.processor() or platform.machine()} (CPU), torch {torch.__version__}, 1 thread",
        "add_bos": engine.config.add_bos,
        "num_cases": cases,
        "seed": args.seed,
        **run(engine, counts=counts, num_cases=cases, policies=list(policies), seed=args.seed),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "smollm2_chunks.json").write_text(json.dumps(json_number(results), indent=2, allow_nan=False) + "\n")
    plot(results, args.out / "smollm2_chunks.png")
    print(json.dumps(results["order"], indent=2))


if __name__ == "__main__":
    main()
