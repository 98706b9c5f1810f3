"""Why ``regions`` loses needles asked about after the haystack, and which tokens a probe's picks fix instead.

python benchmarks/needle_why.py --cases 40          # SmolLM2 -> benchmarks/results/smollm2_needle_why.json
python benchmarks/needle_why.py --quick --out DIR   # a smoke run (2 cases)

On ``pic eval accuracy --workload niah --niah-kind single --question-after-only``'s cases (RULER's single needle,
chunks compiled in the chat's context, as the default links them), by the needle's depth:

- **where the probe's picks fall** (``auto`` after the question: ProphetKV's top tokens by the query's
  attention): the share in the needle's chunk, in the first 4 tokens of the other chunks (their sinks), in the
  chunk just before the question, and elsewhere; and the share of the query's attention on each;
- **ablations**, each beside Full Recompute: the needle's chunk recomputed whole (what ``regions`` does: BM25
  ranks it first), the probe's picks, the same number of picks with the needle's chunk left out, and Naive.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch
from regions_why import Oracle, _rate  # noqa: PLC2701  (the sibling script: python benchmarks/needle_why.py)

import pic
from pic.engine import generate_together
from pic.evaluation.answers import score_answer
from pic.evaluation.niah import niah_workload
from pic.evaluation.report import json_number
from pic.link.lexical import bm25

RESULTS = Path(__file__).resolve().parent / "results"
BUCKETS = ((0.0, 0.25), (0.25, 0.75), (0.75, 1.0001))
SINK_TOKENS = 4


class OutsideTop(pic.policies.Policy):
    """The probe's top ``ratio`` chunk tokens, as ProphetKV picks them, from every chunk but the one BM25 ranks
    first (the needle's in these cases)."""

    name = "outside_top"
    ratio: float = 0.2

    def select(self, layout: pic.policies.Layout) -> torch.Tensor:
        return torch.zeros(layout.num_tokens, dtype=torch.bool)

    def after_probe(self, probe: pic.policies.Probe) -> torch.Tensor:
        layout, score = probe.layout, probe.mass.mean(0).clone()
        units = [layout.token_ids[seg.tokens].tolist() for seg in layout.chunks]
        top = max(range(len(units)), key=bm25(layout.query_ids, units).__getitem__)
        score[layout.chunks[top].tokens] = -1.0  # below every attention weight
        return pic.policies.top_chunk_tokens(score, layout, self.ratio)


def groups(layout: pic.policies.Layout, gold: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """``[T]`` bool masks of the chunk tokens by role: the needle's chunk, the chunk just before the question,
    the first ``SINK_TOKENS`` of every other chunk (their sinks), and the rest."""
    masks = {name: torch.zeros(layout.num_tokens, dtype=torch.bool) for name in ("needle chunk", "last chunk", "sinks")}
    last = len(layout.chunks) - 1
    for index, seg in enumerate(layout.chunks):
        if index in gold:
            masks["needle chunk"][seg.tokens] = True
        elif index == last:
            masks["last chunk"][seg.tokens] = True
        else:
            masks["sinks"][seg.token_start : seg.token_start + SINK_TOKENS] = True
    masks["other"] = layout.cached & ~(masks["needle chunk"] | masks["last chunk"] | masks["sinks"])
    return masks


def run(engine: pic.PIC, num_cases: int) -> dict:
    workload = niah_workload(num_cases=num_cases, kind="single", question_first=False)
    depths = [d[0] for d in workload.description["depths"]]
    correct: dict[str, list[bool]] = {}
    picks: dict[str, list[float]] = {}
    attention: dict[str, list[float]] = {}
    for case in workload.cases:
        messages = case.messages()
        prefix, query = engine.chat_segments(messages)
        query += case.answer_prefix
        ids = engine.compile(list(case.documents), context=engine.chat_context(messages), progress=False)
        auto = engine.link(ids, query, prefix=prefix, policy="auto")
        ratio = auto.policy.ratio
        linked = {
            "full": engine.link(ids, query, prefix=prefix, policy="full"),
            "auto: the probe's picks": auto,
            "regions: the needle's chunk first": engine.link(ids, query, prefix=prefix, policy="regions"),
            "the needle's chunk whole": engine.link(ids, query, prefix=prefix, policy=Oracle(gold=case.gold)),
            "the probe's picks outside the needle's chunk": engine.link(
                ids, query, prefix=prefix, policy=OutsideTop(ratio=ratio)
            ),
            "naive": engine.link(ids, query, prefix=prefix, policy="naive"),
        }
        layout, chosen = auto.layout, auto.recomputed & auto.layout.cached
        mass = auto.probe.mass.mean(0) * auto.layout.cached
        for name, mask in groups(layout, case.gold).items():
            picks.setdefault(name, []).append(int((chosen & mask).sum()) / max(int(chosen.sum()), 1))
            attention.setdefault(name, []).append(float(mass[mask].sum() / mass.sum()))
        replies = generate_together(list(linked.values()), 24, stop=list(case.stop))
        for name, reply in zip(linked, replies, strict=True):
            correct.setdefault(name, []).append(score_answer(reply.text, case).correct)
    by_depth = {}
    for low, high in BUCKETS:
        rows = [i for i, d in enumerate(depths) if low <= d < high]
        by_depth[f"depth {low:.2f}-{min(high, 1):.2f}"] = {
            "num_cases": len(rows),
            "accuracy": {name: _rate([v[i] for i in rows]) if rows else None for name, v in correct.items()},
            "picks_share": {name: statistics.fmean(v[i] for i in rows) if rows else None for name, v in picks.items()},
            "attention_share": {
                name: statistics.fmean(v[i] for i in rows) if rows else None for name, v in attention.items()
            },
        }
    return {"workload": workload.description, "all": {name: _rate(v) for name, v in correct.items()}, **by_depth}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--cases", type=int, default=40, help="needles (default 40)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 cases")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for smollm2_needle_why.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = pic.load(args.model, dtype="float32")
    results = {
        "command": " ".join(["python", *sys.argv]),
        "model": engine.model_name,
        "device": f"{platform.processor() or platform.machine()} (CPU), torch {torch.__version__}, 1 thread",
        **run(engine, 2 if args.quick else args.cases),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "smollm2_needle_why.json"
    path.write_text(json.dumps(json_number(results), indent=2, allow_nan=False) + "\n")
    print(json.dumps({k: v for k, v in results.items() if k != "workload"}, indent=1))


if __name__ == "__main__":
    main()
