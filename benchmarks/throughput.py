"""Throughput: the batched engine (``generate_many``) against the one-at-a-time facade (``link().generate()``).

python benchmarks/throughput.py            # writes benchmarks/results/throughput.json and throughput.png
python benchmarks/throughput.py --quick    # 8 requests, 8 new tokens, max_num_seqs 1 and 4, 1 repeat (smoke run)

64 requests each link 4-8 distinct chunks drawn Zipf-like (weights 1/rank^s, s=1, without replacement, seeded)
from 32 compiled chunks of 36-44 tokens, then a 32-token query, and generate exactly 64 tokens (greedy, no EOS).
The chunks' text is the model's own: passages sampled from stories260K (``pic.evaluation.sample_workload``), each
split into a chunk and the 32 tokens that follow it; a request's query is the continuation of its last chunk.
Every prompt fits the 512-token context with its 64 new tokens. One PIC per variant over the same loaded model,
each with its own KV pool (sized so that no chunk is evicted and no request preempted) and the same compiled chunks
(compile is not timed). The facade runs the requests one after another; the engine variants submit all of them at
t=0 to ``generate_many`` with ``max_num_seqs`` 1, 4, 16 and 64. The variants are interleaved per repeat, torch on
one thread; medians over the repeats. TTFT is ``Generation.ttft_s``: for the facade the link time plus the first
token; for the engine it is from arrival, so it includes the time queued behind the other requests.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

import pic
from pic.evaluation.workload import sample_workload
from pic.model.loading import EMBEDDED_MODEL, load_pretrained

sys.path.insert(0, str(Path(__file__).parent))
from memory import zipf_draw  # noqa: E402  (the same Zipf-like draw as the memory benchmark)

FACADE = "facade"
Workload = tuple[list[list[int]], list[tuple[list[int], list[int]]]]  # chunk token ids, (chunk indices, query)


def make_workload(engine: pic.PIC, args: argparse.Namespace) -> Workload:
    """Chunks sampled from the model (each with its 32-token continuation) and the requests over them."""
    low, high = args.chunk_tokens
    sampled = sample_workload(
        engine,
        num_cases=args.chunks,
        num_chunks=1,
        chunk_tokens=(low, high),
        query_tokens=args.query_tokens,
        seed=args.seed,
    )
    docs = [list(case.chunks[0]) for case in sampled.cases]
    rng = random.Random(args.seed)
    requests = []
    for _ in range(args.requests):
        chunks = zipf_draw(rng, args.chunks, rng.randint(*args.per_request), args.zipf)
        requests.append((chunks, list(sampled.cases[chunks[-1]].query)))
    return docs, requests


def pool_tokens(args: argparse.Namespace, max_num_seqs: int) -> int:
    """Every compiled chunk resident beside ``max_num_seqs`` requests owning all their blocks."""
    bs = args.block_size
    chunk_blocks = -(-(args.chunk_tokens[1] + 1) // bs)  # + BOS
    request_blocks = args.per_request[1] * chunk_blocks + -(-(args.query_tokens + args.new_tokens) // bs) + 1
    return (max_num_seqs * request_blocks + args.chunks * chunk_blocks) * bs


def digest(gens: list[pic.Generation]) -> str:
    """A short hash of every request's generated token ids, in order."""
    return hashlib.sha256(json.dumps([g.token_ids for g in gens]).encode()).hexdigest()[:16]


def timed(engine: pic.PIC, run: Callable[[], list[pic.Generation]]) -> tuple[dict, list[pic.Generation]]:
    """Run ``run()`` (returns the generations) and measure it: wall, tokens/s, TTFT, batch size, preemptions."""
    eng = engine.stepper()
    steps, seqs = eng.num_steps, eng.num_batched_seqs
    start = time.perf_counter()
    gens = run()
    wall = time.perf_counter() - start
    tokens = sum(g.stats.num_generated_tokens for g in gens)
    steps, seqs = eng.num_steps - steps, eng.num_batched_seqs - seqs
    row = {
        "wall_s": wall,
        "generated_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "mean_ttft_s": statistics.fmean(g.ttft_s for g in gens),
        "mean_queue_s": statistics.fmean(g.stats.queue_s for g in gens),
        "steps": steps,
        "mean_batch": seqs / steps,
        "preemptions": sum(g.stats.num_preemptions for g in gens),
        "token_digest": digest(gens),
    }
    return row, gens


def run_variant(
    engine: pic.PIC, ids: list[str], requests: list[tuple[list[int], list[int]]], facade: bool, args: argparse.Namespace
) -> tuple[dict, list[pic.Generation]]:
    """All the requests through the facade one by one, or at once through ``generate_many``."""
    policy, new = args.policy, args.new_tokens
    if facade:
        links = [([ids[c] for c in chunks], query) for chunks, query in requests]
        return timed(engine, lambda: [engine.link(c, q, policy=policy).generate(max_new_tokens=new) for c, q in links])
    reqs = [pic.Request([ids[c] for c in chunks], q, policy=policy, max_new_tokens=new) for chunks, q in requests]
    return timed(engine, lambda: engine.generate_many(reqs, progress=False))


def measure(
    engines: dict[str, tuple[pic.PIC, list[str]]], requests: list[tuple[list[int], list[int]]], args: argparse.Namespace
) -> dict[str, list[dict]]:
    """Interleaved repeats (A B C ..., A B C ...); asserts every run's tokens equal the facade's, per request."""
    raw: dict[str, list[dict]] = {name: [] for name in engines}
    reference: list[list[int]] | None = None
    for _ in range(args.repeats):
        for name, (engine, ids) in engines.items():
            row, gens = run_variant(engine, ids, requests, name == FACADE, args)
            tokens = [g.token_ids for g in gens]
            reference = reference or tokens
            for i, (got, want) in enumerate(zip(tokens, reference, strict=True)):
                assert got == want, f"{name}: request {i} generated other tokens than {FACADE}"
            assert row["generated_tokens"] == len(requests) * args.new_tokens, (name, row["generated_tokens"])
            raw[name].append(row)
    return raw


def summarize(raw: dict[str, list[dict]]) -> dict[str, dict]:
    """Per variant, the median of each measure over the repeats, and its tokens/s over the facade's."""
    keys = ("wall_s", "tokens_per_s", "mean_ttft_s", "mean_queue_s", "mean_batch", "preemptions")
    medians = {name: {k: statistics.median(r[k] for r in rows) for k in keys} for name, rows in raw.items()}
    for m in medians.values():
        m["tokens_per_s_over_facade"] = m["tokens_per_s"] / medians[FACADE]["tokens_per_s"]
    return medians


def table(medians: dict[str, dict]) -> str:
    """Markdown: per variant, wall, tokens/s, mean TTFT, mean batch and tokens/s over the facade."""
    head = ["variant", "wall s", "tokens/s", "mean TTFT ms", "mean batch", "tokens/s vs facade"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for name, m in medians.items():
        cells = [f"{m['wall_s']:.2f}", f"{m['tokens_per_s']:.0f}", f"{1000 * m['mean_ttft_s']:.0f}"]
        cells += [f"{m['mean_batch']:.1f}", f"{m['tokens_per_s_over_facade']:.2f}x"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(medians: dict[str, dict], title: str, path: Path) -> None:
    """Left: tokens/s over the facade's per max_num_seqs; right: mean TTFT per variant."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot ({path}); pip install 'pic-kv[eval]'")
        return
    engines = [name for name in medians if name != FACADE]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), dpi=110)
    ratios = [medians[n]["tokens_per_s_over_facade"] for n in engines]
    bars = left.bar([n.removeprefix("engine ") for n in engines], ratios, color="tab:blue")
    left.bar_label(bars, [f"{r:.2f}x" for r in ratios], fontsize=8)
    left.axhline(1.0, color="k", ls="--", lw=1, label="facade (one at a time)")
    left.set_xlabel("engine max_num_seqs (all requests arrive at t=0)")
    left.set_ylabel("generated tokens/s over the facade's")
    left.legend(fontsize=8)
    ttft = [1000 * medians[n]["mean_ttft_s"] for n in medians]
    right.bar(list(medians), ttft, color=["tab:gray"] + ["tab:blue"] * len(engines))
    right.set_yscale("log")
    right.set_ylabel("mean TTFT ms (engine: queueing included)")
    for ax in (left, right):
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-num-seqs", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=32, help="compiled chunks to draw from")
    parser.add_argument("--per-request", type=int, nargs=2, default=[4, 8], help="chunks each request links")
    parser.add_argument("--chunk-tokens", type=int, nargs=2, default=[36, 44], help="content tokens per chunk")
    parser.add_argument("--query-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--zipf", type=float, default=1.0, help="exponent s of the chunk weights 1/rank^s")
    parser.add_argument("--policy", default="legolink:16")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="8 requests, 8 new tokens, max_num_seqs 1 4, 1 repeat")
    parser.add_argument("--out", default="benchmarks/results", help="folder for throughput.json and .png")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.new_tokens, args.max_num_seqs, args.repeats = 8, 8, [1, 4], 1
    assert args.per_request[1] <= args.chunks, "requests link distinct chunks"
    return args


def make_report(args: argparse.Namespace, raw: dict[str, list[dict]], medians: dict[str, dict]) -> dict:
    """The JSON: machine, exact command, workload, per-variant medians and raw repeats, and the ratios."""
    names = ("requests", "chunks", "per_request", "chunk_tokens", "query_tokens", "new_tokens", "zipf", "policy")
    workload = {k: getattr(args, k) for k in (*names, "block_size", "seed", "max_num_seqs", "repeats")}
    return {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "env": {k: v for k, v in os.environ.items() if k.startswith(("MALLOC_", "OMP_", "MKL_", "LD_PRELOAD"))},
        "torch_threads": torch.get_num_threads(),
        "model": "stories260K (embedded), float32, CPU",
        "command": " ".join(["python", Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "workload": workload | {"pool_tokens": {str(n): pool_tokens(args, n) for n in args.max_num_seqs}},
        "ttft_note": "engine: from arrival (all requests at t=0), queueing included; facade: link + first token, "
        "not counting the requests run before it",
        "identical_tokens": True,  # measure() asserts it: every run of every variant, per request
        "medians": medians,
        "raw": raw,
        "tokens_per_s_over_facade": {name: m["tokens_per_s_over_facade"] for name, m in medians.items()},
    }


def build(model: torch.nn.Module, tokenizer: object, args: argparse.Namespace, max_num_seqs: int) -> pic.PIC:
    """A PIC over the shared model with its own pool; no EOS, so every request generates ``--new-tokens``."""
    tokens = pool_tokens(args, max_num_seqs)
    config = pic.PICConfig(
        max_num_seqs=max_num_seqs, eos_token_ids=(), kv_pool_tokens=tokens, block_size=args.block_size
    )
    return pic.PIC(model, tokenizer, config=config)


def main() -> None:
    torch.set_num_threads(1)
    args = parse_args()
    start = time.perf_counter()
    model, tokenizer = load_pretrained(EMBEDDED_MODEL, device=torch.device("cpu"), dtype=torch.float32)
    variants = {FACADE: 1} | {f"engine {n}": n for n in args.max_num_seqs}  # the facade runs one at a time anyway
    instances = {name: build(model, tokenizer, args, n) for name, n in variants.items()}
    docs, requests = make_workload(instances[FACADE], args)
    engines = {name: (engine, engine.compile(docs, progress=False)) for name, engine in instances.items()}
    raw = measure(engines, requests, args)
    medians = summarize(raw)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "throughput.json").write_text(json.dumps(make_report(args, raw, medians), indent=2) + "\n")
    print(table(medians))
    title = f"stories260K, CPU, 1 thread: {args.requests} requests, {args.policy}, {args.new_tokens} new tokens each"
    plot(medians, title, out / "throughput.png")
    print(f"wrote {out / 'throughput.json'} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
