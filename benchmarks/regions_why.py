"""Why ``regions`` ranks by words and recomputes whole regions, and how far recompute can go, on a real model.

python benchmarks/regions_why.py                    # SmolLM2 -> benchmarks/results/smollm2_regions_why.json
python benchmarks/regions_why.py --quick --out DIR  # a smoke run (2 cases per workload)

Per workload (``pic eval accuracy``'s ``qa`` and ``profiles``, the question asked first), on the same cases:

- **ranking**: how often the document holding the answer comes first by the query's attention over the
  naively linked chunks (the probe ProphetKV reads: ``Probe.mass`` summed over each chunk, averaged over the
  layers; and the last third of the layers alone), and by BM25 over token ids (what ``regions`` uses);
- **oracles**: accuracy when the answer's whole document is recomputed (chunks compiled alone, and in the
  chat's context) beside Full Recompute, ``regions`` and Naive over in-context chunks, with the share of the
  chunk tokens each recomputes: the best a policy that finds the right document and recomputes it can do.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

import pic
from pic.engine import generate_together
from pic.evaluation.accuracy_report import wilson_interval
from pic.evaluation.answers import score_answer
from pic.evaluation.profiles import profile_workload
from pic.evaluation.qa import QACase, QAWorkload, qa_workload
from pic.evaluation.report import json_number
from pic.link.order import bm25

RESULTS = Path(__file__).resolve().parent / "results"


class Oracle(pic.policies.Policy):
    """Recompute the documents holding the answer, whole (the benchmark knows them; a policy cannot)."""

    name = "oracle"
    gold: tuple[int, ...] = ()

    def select(self, layout: pic.policies.Layout) -> torch.Tensor:
        chosen = torch.zeros(layout.num_tokens, dtype=torch.bool)
        for index in self.gold:
            chosen[layout.chunks[index].tokens] = True
        return chosen


def rank_hits(engine: pic.PIC, case: QACase, prefix: str, query: str, ids: list[str]) -> dict[str, bool]:
    """Whether each ranking puts a gold document first."""
    with engine.link(ids, query, prefix=prefix, policy="prophetkv:0") as linked:  # the probe, then Naive
        probe, layout = linked.probe, linked.layout
    layers = probe.mass.shape[0]

    def first(scores: list[float]) -> bool:
        return max(range(len(scores)), key=lambda i: scores[i]) in case.gold

    mass, late = probe.mass.mean(0), probe.mass[2 * layers // 3 :].mean(0)
    units = [layout.token_ids[seg.tokens].tolist() for seg in layout.chunks]
    return {
        "probe mass, all layers": first([float(mass[seg.tokens].sum()) for seg in layout.chunks]),
        "probe mass, last third of the layers": first([float(late[seg.tokens].sum()) for seg in layout.chunks]),
        "bm25 over token ids": first(bm25(layout.query_ids, units)),
    }


def run_workload(engine: pic.PIC, workload: QAWorkload) -> dict:
    hits: dict[str, list[bool]] = {}
    correct: dict[str, list[bool]] = {}
    shares: dict[str, list[float]] = {}
    for case in workload.cases:
        messages = case.messages()
        prefix, query = engine.chat_segments(messages)
        query += case.answer_prefix
        alone = engine.compile(list(case.documents), progress=False)
        in_context = engine.compile(list(case.documents), context=engine.chat_context(messages), progress=False)
        for name, hit in rank_hits(engine, case, prefix, query, alone).items():
            hits.setdefault(name, []).append(hit)
        oracle = Oracle(gold=case.gold)
        rows = {
            "full": (alone, "full"),
            "gold document whole": (alone, oracle),
            "gold document whole, in context": (in_context, oracle),
            "regions, in context": (in_context, "regions"),
            "naive, in context": (in_context, "naive"),
        }
        linked = {name: engine.link(ids, query, prefix=prefix, policy=policy) for name, (ids, policy) in rows.items()}
        for name, item in linked.items():
            num_chunk = int(item.layout.cached.sum())
            shares.setdefault(name, []).append(int((item.recomputed & item.layout.cached).sum()) / num_chunk)
        replies = generate_together(list(linked.values()), 24, stop=list(case.stop))
        for name, reply in zip(linked, replies, strict=True):
            correct.setdefault(name, []).append(score_answer(reply.text, case).correct)
    full = correct["full"]
    return {
        "workload": workload.description,
        "ranking_first_is_gold": {name: _rate(values) for name, values in hits.items()},
        "accuracy": {
            name: {
                **_rate(values),
                "num_lost_vs_full": sum(f and not v for v, f in zip(values, full, strict=True)),
                "num_gained_vs_full": sum(v and not f for v, f in zip(values, full, strict=True)),
                "chunk_tokens_recomputed": statistics.fmean(shares[name]),
            }
            for name, values in correct.items()
        },
    }


def _rate(values: list[bool]) -> dict[str, float]:
    low, high = wilson_interval(sum(values), len(values))
    return {"rate": sum(values) / len(values), "low": low, "high": high, "num_cases": len(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--cases", type=int, default=60, help="questions per workload (default 60)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 cases per workload")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for smollm2_regions_why.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = pic.load(args.model, dtype="float32")
    cases = 2 if args.quick else args.cases
    results = {
        "command": " ".join(["python", *sys.argv]),
        "model": engine.model_name,
        "device": f"{platform.processor() or platform.machine()} (CPU), torch {torch.__version__}, 1 thread",
        "qa": run_workload(engine, qa_workload(num_cases=cases)),
        "profiles": run_workload(engine, profile_workload(num_cases=cases)),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "smollm2_regions_why.json"
    path.write_text(json.dumps(json_number(results), indent=2, allow_nan=False) + "\n")
    for workload in ("qa", "profiles"):
        print(workload, json.dumps(results[workload]["ranking_first_is_gold"], indent=1))
        print(workload, json.dumps(results[workload]["accuracy"], indent=1))


if __name__ == "__main__":
    main()
