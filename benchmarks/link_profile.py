"""What a link spends besides its recomputed rows: each policy's link time beside the forwards it ran, CPU, one thread.

    python benchmarks/link_profile.py                                  # SmolLM2 needles at 2K and 4K tokens
    python benchmarks/link_profile.py --model Q05.gguf --workload profiles --policies full auto naive
    python benchmarks/link_profile.py --quick --out /tmp/p.json        # a smoke run: stories260K, a qa case

One case of ``pic eval accuracy``'s workloads (RULER's single needle asked after the documents by default; the
chunks compiled in the chat's context, as the evaluation links them), linked under each policy in turn, ``--rounds``
rounds interleaved after one warm-up round (A B C A B C: this machine's load moves between rounds, not within one).
Each link is timed as the caller sees it (``Linked.link_s``) and the engine's forwards inside it are timed one by one
(``ModelRunner.forward`` wrapped here, the engine untouched): a static policy runs one forward (its recomputed rows),
a query-aware one two (the probe, then the rows it chose); a pass longer than the engine's token budget (Full
Recompute's) runs in pieces, one forward each. Per policy, medians over the rounds:

- ``link_ms``, the link; ``rows``, the rows of its pass (the recomputed tokens, the query's included), and
  ``rows_ms``, its forwards' time: the recomputed rows' own forward;
- ``probe_ms``, a probe's forward, and ``other_ms``, what is left: laying out, ordering and
  choosing, assembling the blocks, the engine's thread hand-offs;
- ``spent_share``, ``(link_ms - rows_ms) / link_ms``: what the link spends besides its recomputed rows;
- ``speedup``: Full Recompute's link time over the policy's, in the same round (median of the ratios).

Writes ``--out`` (JSON) and prints a table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import pic
from pic.evaluation.niah import niah_workload
from pic.evaluation.profiles import profile_workload
from pic.evaluation.qa import qa_workload

sys.path.insert(0, str(Path(__file__).parent))
from engine_flood import machine, write_report  # noqa: E402


class ForwardClock:
    """Wraps the engine's ``ModelRunner.forward``: each call's seconds and rows, on the engine's thread."""

    def __init__(self, engine: pic.PIC) -> None:
        with engine.paused() as core:
            runner = core.runner
        self._forward, self.calls = runner.forward, []
        runner.forward = self

    def __call__(self, seqs):
        start = time.perf_counter()
        out = self._forward(seqs)
        self.calls.append((time.perf_counter() - start, sum(s.token_ids.shape[0] for s in seqs)))
        return out


def case_of(args: argparse.Namespace, haystack: int):
    if args.workload == "niah":
        return niah_workload(num_cases=1, kind="single", haystack_tokens=haystack, chunk_tokens=args.chunk_tokens,
                             question_first=False, seed=args.seed).cases[0]  # fmt: skip
    make = profile_workload if args.workload == "profiles" else qa_workload
    return make(num_cases=1, question_first=args.layout == "before", seed=args.seed).cases[0]


def profile(engine: pic.PIC, clock: ForwardClock, case, args: argparse.Namespace) -> dict:
    messages = case.messages()
    prefix, query = engine.chat_segments(messages)
    query += case.answer_prefix
    ids = engine.compile(list(case.documents), context=engine.chat_context(messages), progress=False)
    samples: dict[str, list[dict]] = {p: [] for p in args.policies}
    for round_ in range(args.rounds + 1):
        for policy in args.policies:
            clock.calls.clear()
            with engine.link(ids, query, prefix=prefix, policy=policy, order=args.order) as linked:
                link_s, ran, num_tokens = linked.link_s, str(linked.policy), linked.layout.num_tokens
                probed = linked.probe is not None
            if round_ == 0:
                continue  # warm-up
            before = clock.calls[:1] if probed else []  # a probe's forward; the rest are the pass (or its pieces)
            rows_s, rows = (sum(c[i] for c in clock.calls[len(before) :]) for i in (0, 1))
            samples[policy].append({
                "link_ms": 1e3 * link_s, "rows": rows, "rows_ms": 1e3 * rows_s,
                "probe_ms": 1e3 * sum(s for s, _ in before), "probe_rows": sum(n for _, n in before),
                "num_forwards": len(clock.calls), "ran": ran, "num_tokens": num_tokens,
            })  # fmt: skip
    full = samples.get("full")
    out = {}
    for policy, rounds in samples.items():
        med = {k: statistics.median(r[k] for r in rounds) for k in ("link_ms", "rows_ms", "probe_ms", "rows")}
        med["other_ms"] = statistics.median(r["link_ms"] - r["rows_ms"] - r["probe_ms"] for r in rounds)
        med["spent_share"] = statistics.median((r["link_ms"] - r["rows_ms"]) / r["link_ms"] for r in rounds)
        if full:
            med["speedup"] = statistics.median(f["link_ms"] / r["link_ms"] for f, r in zip(full, rounds, strict=True))
        out[policy] = med | {k: rounds[-1][k] for k in ("ran", "num_tokens", "num_forwards", "probe_rows")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--workload", choices=("niah", "profiles", "qa"), default="niah")
    parser.add_argument("--haystack", nargs="+", type=int, default=[2700, 5400], help="niah: tokens of 4 characters")
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--layout", choices=("before", "after"), default="after", help="qa, profiles: the question")
    parser.add_argument("--policies", nargs="+", default=["full", "auto", "naive", "prophetkv:0.2", "suffix:0.05,whole=true"])
    parser.add_argument("--order", default="relevance", help="the chunks' order in every link (default: relevance)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default=None, help="pic.load's dtype (default: float32 on the CPU)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="stories260K, a qa case, 2 rounds")
    parser.add_argument("--out", default="benchmarks/results/link_profile.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.quick:
        args.model, args.workload, args.rounds = "stories260K", "qa", 2
    started = time.perf_counter()
    engine = pic.load(dtype=args.dtype) if args.model == "stories260K" else pic.load(args.model, dtype=args.dtype)
    if args.quick:  # stories260K has no chat template: a plain one, for the chat segments
        engine.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    clock = ForwardClock(engine)
    lengths = args.haystack if args.workload == "niah" else [0]
    report = {"model": args.model, "dtype": engine.dtype_choice.name, "workload": args.workload, "layout": args.layout,
              "order": args.order, "rounds": args.rounds, "torch_threads": 1, "machine": machine(),
              "cases": {}}  # fmt: skip
    for haystack in lengths:
        result = profile(engine, clock, case_of(args, haystack), args)
        num_tokens = next(iter(result.values()))["num_tokens"]
        report["cases"][str(num_tokens)] = result
        print(f"--- {args.workload}, {num_tokens} prompt tokens")
        print(f"{'policy':26s} {'ran':26s} {'link ms':>8s} {'rows':>5s} {'rows ms':>8s} {'probe ms':>8s} "
              f"{'other ms':>8s} {'spent':>6s} {'speedup':>7s}")  # fmt: skip
        for policy, r in result.items():
            print(f"{policy:26s} {r['ran'][:26]:26s} {r['link_ms']:8.1f} {r['rows']:5.0f} {r['rows_ms']:8.1f} "
                  f"{r['probe_ms']:8.1f} {r['other_ms']:8.1f} {r['spent_share']:6.1%} {r.get('speedup', 0):6.2f}x")  # fmt: skip
    report["wall_s"] = time.perf_counter() - started
    write_report(report, args.out)


if __name__ == "__main__":
    main()
