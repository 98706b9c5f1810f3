"""int8 decode weights against the model's own on SmolLM2's QA workload, paired: the same cases, the same exact
Full Recompute link, then greedy replies decoded once with the float32 weights and once with int8 copies
(``PICConfig.decode_weights="int8"``). Two engines share one model.

python benchmarks/int8_accuracy.py                 # 200 cases; ~10 minutes on one thread; results/int8_accuracy.json
python benchmarks/int8_accuracy.py --quick --out /tmp/r

Reports each mode's accuracy (``pic eval accuracy``'s scoring) with its 95% Wilson interval, the paired difference
with its 95% interval, how many replies are the same text, and the decode tokens/s of each (medians over cases,
first token excluded; the cases' replies are short, so these rates are rough: ``cpu_rag.py`` times decode).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

import pic
from pic.evaluation.accuracy import Row, case_linker
from pic.evaluation.accuracy_report import paired_difference, wilson_interval
from pic.evaluation.answers import score_answer
from pic.evaluation.qa import qa_workload
from pic.link.policies import FullRecompute

sys.path.insert(0, str(Path(__file__).parent))
import _gpu  # noqa: E402

MODES = ("model", "int8")


def run_case(engines: dict[str, pic.PIC], case, max_new_tokens: int) -> dict[str, dict]:
    """The case's reply under each mode: its text, whether it is correct, its decode rate."""
    out = {}
    for mode, engine in engines.items():
        linked = case_linker(engine, case)(Row(FullRecompute(), in_context=False))
        gen = linked.generate(max_new_tokens, stop=list(case.stop))
        rate = (len(gen.token_ids) - 1) / gen.stats.decode_s if len(gen.token_ids) > 1 else None
        out[mode] = {"reply": gen.text, "correct": score_answer(gen.text, case).correct, "tokens_per_s": rate}
    return out


def summarize(rows: list[dict[str, dict]]) -> dict:
    """Accuracy per mode with intervals, the paired difference (int8 - model), equal replies, decode rates."""
    report = {}
    for mode in MODES:
        correct = [row[mode]["correct"] for row in rows]
        low, high = wilson_interval(sum(correct), len(correct))
        rates = [row[mode]["tokens_per_s"] for row in rows if row[mode]["tokens_per_s"] is not None]
        report[mode] = {"accuracy": sum(correct) / len(correct), "accuracy_low": low, "accuracy_high": high,
                        "median_decode_tokens_per_s": statistics.median(rates) if rates else None}  # fmt: skip
    diff, low, high = paired_difference([int(r["int8"]["correct"]) - int(r["model"]["correct"]) for r in rows])
    report["int8_minus_model"] = {"diff": diff, "low": low, "high": high}
    report["same_reply"] = sum(r["int8"]["reply"] == r["model"]["reply"] for r in rows) / len(rows)
    report["num_gained"] = sum(r["int8"]["correct"] and not r["model"]["correct"] for r in rows)
    report["num_lost"] = sum(r["model"]["correct"] and not r["int8"]["correct"] for r in rows)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--quick", action="store_true", help="5 cases: a smoke run")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.quick:
        args.cases = 5
    exact = pic.load("smollm2", progress=False)
    fast = pic.PIC(exact.model, exact.tokenizer, config=pic.PICConfig(decode_weights="int8"))
    engines = {"model": exact, "int8": fast}
    workload = qa_workload(num_cases=args.cases, seed=0)
    rows = [run_case(engines, case, args.max_new_tokens) for case in workload.cases]
    report = {"command": _gpu.command(), "environment": _gpu.environment(torch.device("cpu")) | {"torch_threads": 1},
              "model": "SmolLM2-135M-Instruct (float32)", "workload": workload.description, "policy": "full",
              "max_new_tokens": args.max_new_tokens, "num_cases": len(rows)} | summarize(rows)  # fmt: skip
    report["examples"] = [{"model": r["model"]["reply"], "int8": r["int8"]["reply"]} for r in rows[:5]]
    for mode in MODES:
        m = report[mode]
        print(f"{mode:>5}: accuracy {m['accuracy']:.1%} [{m['accuracy_low']:.1%}, {m['accuracy_high']:.1%}]")
    d = report["int8_minus_model"]
    same = report["same_reply"]
    print(f"int8 - model: {d['diff']:+.1%} [{d['low']:+.1%}, {d['high']:+.1%}] (paired), same reply {same:.1%}")
    _gpu.write_json(args.out / "int8_accuracy.json", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
