"""How often the relevance order puts the gold documents last, next to the query, per workload and layout.

    python benchmarks/ranking_hits.py --models smollm2 qwen0.5b --cases 60 --wheels WHEELS   # -> ranking_hits.json

``auto`` recomputes the last document of the relevance order whole (BM25 over token ids between each document and the
query, ``pic.link.order``): where the document that holds the answer is not last, the recomputed one is another. The
order needs the tokenizer only (no forward), so this ranks every case of the grid's workloads as a link would: the
documents' tokens, and the query the evaluation links (the chat template's text after the documents and the reply's
start, ``PIC.chat_segments``), with the grid's seed. A case with two gold documents (qa's two-document questions,
twohop's person and town) is a hit when both are the last two; ``last`` counts a case whose last document is one of
its gold, ``hit`` one whose gold are all last.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cells import MODELS, model_arg  # noqa: E402

import pic  # noqa: E402
from pic.evaluation.niah import niah_workload  # noqa: E402
from pic.evaluation.profiles import profile_workload  # noqa: E402
from pic.evaluation.qa import qa_workload  # noqa: E402
from pic.evaluation.twohop import twohop_workload  # noqa: E402
from pic.link.order import Order, chunk_order  # noqa: E402

SEED = 2  # the grid's (benchmarks/order_grid.py)
WORKLOADS = {
    "qa": lambda n, first: qa_workload(num_cases=n, question_first=first, seed=SEED),
    "profiles": lambda n, first: profile_workload(num_cases=n, question_first=first, seed=SEED),
    "niah-single": lambda n, first: niah_workload(
        num_cases=n, kind="single", haystack_tokens=2700, chunk_tokens=256, question_first=first, seed=SEED
    ),
    "niah-multikey": lambda n, first: niah_workload(
        num_cases=n, kind="multikey", haystack_tokens=2700, chunk_tokens=256, question_first=first, seed=SEED
    ),
    "twohop": lambda n, first: twohop_workload(num_cases=n, question_first=first, seed=SEED),
}


def rank(engine: pic.PIC, workload: str, num_cases: int, question_first: bool) -> dict:
    encode = lambda text: engine.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    hits = last = 0
    cases = WORKLOADS[workload](num_cases, question_first).cases
    for case in cases:
        _, query = engine.chat_segments(case.messages())
        order = chunk_order(Order.RELEVANCE, encode(query + case.answer_prefix), [encode(d) for d in case.documents])
        tail = order.indices[len(order.indices) - len(case.gold) :]
        hits += set(tail) == set(case.gold)
        last += order.indices[-1] in case.gold
    return {"num_cases": len(cases), "hit": hits / len(cases), "last": last / len(cases)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=["smollm2"])
    parser.add_argument("--cases", type=int, default=60)
    parser.add_argument("--wheels", default=None)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "ranking_hits.json")
    args = parser.parse_args()
    found = []
    for model in args.models:
        with pic.load(model_arg(model, args.wheels)) as engine:
            for workload in WORKLOADS:
                for layout, first in (("before", True), ("after", False)):
                    row = {
                        "model": model,
                        "workload": workload,
                        "layout": layout,
                        **rank(engine, workload, args.cases, first),
                    }
                    print(row, flush=True)
                    found.append(row)
    args.out.write_text(json.dumps({"command": " ".join(sys.argv), "seed": SEED, "cells": found}, indent=2) + "\n")


if __name__ == "__main__":
    main()
