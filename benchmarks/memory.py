"""KV memory under concurrency: chunk blocks shared across live requests against private copies.

python benchmarks/memory.py            # writes benchmarks/results/memory.json and memory.png
python benchmarks/memory.py --quick    # N up to 4, 12 chunks, 4 per request (the test suite's smoke run)
python benchmarks/memory.py --model mistral-7b-random   # GPU: benchmarks/results/memory_gpu.json and .png

``--model mistral-7b-random`` runs the same workload (the same token ids: the block counts are the same) on a
Mistral-7B-shaped model with random bfloat16 weights on CUDA (``benchmarks/_gpu.py``; with ``--quick``, a 2-layer
one on the CPU), so the link times are a 7B's on the GPU's attention backend.

N live requests are held at once, each linking 8 distinct chunks drawn Zipf-like (weights 1/rank^s, without
replacement; the same draws for every variant) from 32 token-id documents of 240-272 tokens, then a 16-token
query. Per variant and N a fresh engine (fresh KV pool, same weights) compiles the chunks, links and keeps the N
requests, and reports the pool's peak used blocks against a floor computed from the layouts alone: each live
request's private blocks (prefix, query, chunk blocks holding a token it writes: all of them for a dynamic policy
or in private mode), one copy of each chunk a live request maps, and the chunks a request reads while it links.
In the spirit of MEPIC's Figure 7, on the CPU. These ~2,200-token prompts exceed stories260K's 512-token context,
so it is stretched (``max_position_embeddings``): outputs past 512 positions are outside its training, but which
blocks a request holds does not depend on them.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

import pic
from pic.model.loading import EMBEDDED_MODEL, load_pretrained

sys.path.insert(0, str(Path(__file__).parent))
import _gpu  # noqa: E402

# name -> (policy, share_chunk_blocks)
VARIANTS = {
    "mepic": ("mepic", True),
    "legolink:16": ("legolink:16", True),
    "cacheblend:0.15": ("cacheblend:0.15", True),
    "mepic private": ("mepic", False),
}
SHARED, PRIVATE = "mepic", "mepic private"
STYLES = [("o", 1.5), ("s", 1.5), ("D", 5.0), ("o", 1.5)]  # (marker, line width) per variant, in order


@dataclass(frozen=True)
class Footprint:
    """What one linked request needs in the pool, derived from its layout and recomputed tokens.

    Attributes:
        private: blocks only it uses (prefix, query, chunk blocks holding a token it writes).
        mapped: chunks with a clean block in its table (they stay resident while it lives).
        chunk_blocks: blocks of each chunk it links (all held while its link pass runs).
    """

    private: int
    mapped: frozenset[str]
    chunk_blocks: dict[str, int]


def footprint(linked: pic.Linked, share: bool) -> Footprint:
    """Blocks the request must own: a chunk block is private when it holds a token the policy writes
    (a static policy writes exactly the tokens in ``recomputed``; a dynamic one every chunk token in its
    early layers), or in private mode always. Recomputed from the layout, not read from the engine."""
    layout, bs = linked.layout, linked.layout.block_size
    writes_all = not share or linked.policy.is_dynamic
    written = set((layout.slots[linked.recomputed & layout.cached] // bs).tolist())
    clean_blocks, mapped, chunk_blocks = 0, set(), {}
    for seg in layout.chunks:
        first, count = (seg.slot_start - seg.num_padding) // bs, (seg.num_padding + seg.num_tokens) // bs
        clean = 0 if writes_all else sum(b not in written for b in range(first, first + count))
        clean_blocks += clean
        chunk_blocks[seg.cache_id] = count
        if clean:
            mapped.add(seg.cache_id)
    private = -(-layout.num_slots // bs) - clean_blocks
    return Footprint(private, frozenset(mapped), chunk_blocks)


def floors(footprints: list[Footprint]) -> tuple[int, int]:
    """(peak floor, live floor): the fewest blocks in use at any moment of linking the requests in order,
    and once they are all linked. A request holds the chunks it reads while it links, then keeps its
    private blocks and the chunks it maps; a chunk is stored once however many requests map it."""
    sizes = {cid: n for fp in footprints for cid, n in fp.chunk_blocks.items()}
    private, mapped, peak = 0, set(), 0
    for fp in footprints:
        private += fp.private
        peak = max(peak, private + sum(sizes[c] for c in mapped | fp.chunk_blocks.keys()))
        mapped |= fp.mapped
    return peak, private + sum(sizes[c] for c in mapped)


def zipf_draw(rng: random.Random, num_chunks: int, k: int, s: float) -> list[int]:
    """``k`` distinct chunk indices, weights ``1 / rank^s`` (index 0 is rank 1), without replacement."""
    left, chosen = list(range(num_chunks)), []
    for _ in range(k):
        i = rng.choices(range(len(left)), weights=[1 / (c + 1) ** s for c in left])[0]
        chosen.append(left.pop(i))
    return chosen


def make_workload(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[tuple[list[int], list[int]]]]:
    """Documents (token ids, avoiding the special ids 0-2) and ``max(N)`` requests (chunk indices, query)."""
    rng = random.Random(args.seed)
    lo, hi = args.doc_tokens
    docs = [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(args.chunks)]
    requests = []
    for _ in range(max(args.concurrency)):
        chunks = zipf_draw(rng, args.chunks, args.per_request, args.zipf)
        requests.append((chunks, [rng.randrange(3, vocab) for _ in range(args.query_tokens)]))
    return docs, requests


def run(
    model: torch.nn.Module,
    tokenizer: object,
    config: pic.PICConfig,
    policy: str,
    docs: list[list[int]],
    requests: list[tuple[list[int], list[int]]],
) -> dict:
    """One fresh engine: compile, link every request and keep them all, then measure and release."""
    engine = pic.PIC(model, tokenizer, config=config)
    ids = engine.compile(docs, progress=False)
    engine.reset_peak()
    assert engine.kv_stats().num_used_blocks == 0, "compiled chunks no request holds should be evictable"
    linked = [engine.link([ids[c] for c in chunks], query, policy=policy) for chunks, query in requests]
    stats = engine.kv_stats()
    footprints = [footprint(one, config.share_chunk_blocks) for one in linked]
    for one, fp in zip(linked, footprints, strict=True):
        assert one.num_private_blocks == fp.private, (one.num_private_blocks, fp.private)
    peak_floor, live_floor = floors(footprints)
    assert stats.num_used_blocks == live_floor, (stats.num_used_blocks, live_floor)
    assert stats.num_evicted_chunks == 0, "the pool is sized so that no chunk is evicted"
    for one in linked:
        one.release()
    assert engine.kv_stats().num_used_blocks == 0, "released requests left blocks in use"
    return {
        "n": len(requests),
        "distinct_chunks": len({c for chunks, _ in requests for c in chunks}),
        "peak_blocks": stats.peak_used_blocks,
        "floor_blocks": peak_floor,
        "peak_over_floor": stats.peak_used_blocks / peak_floor,
        "live_blocks": stats.num_used_blocks,
        "shared_block_refs": stats.num_shared_block_refs,
        "private_blocks": stats.num_private_blocks,
        "median_link_s": statistics.median(one.link_s for one in linked),
    }


def pool_tokens(args: argparse.Namespace) -> int:
    """Room for ``max(N)`` requests with private copies of their longest possible chunks, beside every
    compiled chunk, so no chunk is ever evicted."""
    bs, chunk_blocks = args.block_size, -(-(args.doc_tokens[1] + 1) // args.block_size)  # + BOS
    request_blocks = args.per_request * chunk_blocks + -(-args.query_tokens // bs)
    return (max(args.concurrency) * request_blocks + args.chunks * chunk_blocks) * bs


def private_over_shared(results: dict[str, list[dict]]) -> list[float]:
    """Per N, MEPIC's peak blocks with private copies over its peak with shared chunk blocks."""
    return [p["peak_blocks"] / s["peak_blocks"] for p, s in zip(results[PRIVATE], results[SHARED], strict=True)]


def table(results: dict[str, list[dict]]) -> str:
    """Markdown: per N, each variant's peak blocks (peak / floor), and private over shared MEPIC."""
    head = ["N", "distinct chunks", *(f"{v} peak (/floor)" for v in results), "private / mepic"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for i, (row, ratio) in enumerate(zip(results[SHARED], private_over_shared(results), strict=True)):
        cells = [f"{r[i]['peak_blocks']} ({r[i]['peak_over_floor']:.2f})" for r in results.values()]
        lines.append(f"| {row['n']} | {row['distinct_chunks']} | " + " | ".join(cells) + f" | {ratio:.2f}x |")
    return "\n".join(lines)


def plot(results: dict[str, list[dict]], title: str, path: Path) -> None:
    """Peak used KV blocks against live requests, one line per variant, MEPIC's floor dashed."""
    try:
        import matplotlib
        import matplotlib.ticker

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot ({path}); pip install 'pic-kv[eval]'")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for (name, rows), (marker, width) in zip(results.items(), STYLES, strict=False):  # coinciding lines stay visible
        ax.plot([r["n"] for r in rows], [r["peak_blocks"] for r in rows], marker=marker, lw=width, label=name)
    shared = results[SHARED]
    floor_label = "mepic floor (from the layouts)"
    ax.plot([r["n"] for r in shared], [r["floor_blocks"] for r in shared], "k--", lw=1, label=floor_label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks([r["n"] for r in shared], [str(r["n"]) for r in shared])
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("live requests (N)")
    ax.set_ylabel("peak used KV blocks")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--chunks", type=int, default=32, help="compiled chunks to draw from")
    parser.add_argument("--per-request", type=int, default=8, help="distinct chunks each request links")
    parser.add_argument("--doc-tokens", type=int, nargs=2, default=[240, 272], help="content tokens per chunk")
    parser.add_argument("--query-tokens", type=int, default=16)
    parser.add_argument("--zipf", type=float, default=1.0, help="exponent s of the chunk weights 1/rank^s")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="N 1 2 4, 12 chunks, 4 per request (smoke test)")
    parser.add_argument("--model", choices=["stories260K", "mistral-7b-random"], default="stories260K")
    parser.add_argument("--out", help="JSON path, the PNG beside it (default: results/memory.json, memory_gpu.json)")
    args = parser.parse_args()
    if args.quick:
        args.concurrency, args.chunks, args.per_request = [1, 2, 4], 12, 4
    mistral = args.model != "stories260K"
    args.out = args.out or f"benchmarks/results/memory{'_gpu' if mistral else ''}.json"
    args.device = torch.device("cuda" if mistral and not args.quick else "cpu")
    assert args.per_request <= args.chunks, "requests link distinct chunks"
    return args


def load_model(args: argparse.Namespace) -> tuple[torch.nn.Module, object, str]:
    """The model, its tokenizer, and what the report calls it; the context stretched to the longest prompt."""
    needed = args.per_request * (args.doc_tokens[1] + 1) + args.query_tokens
    if args.model == "stories260K":
        model, tokenizer = load_pretrained(EMBEDDED_MODEL, device=args.device, dtype=torch.float32)
        trained = model.config.max_position_embeddings
        model.config.max_position_embeddings = max(trained, needed)
        context = f"context stretched from {trained} to {model.config.max_position_embeddings} positions"
        return model, tokenizer, f"stories260K (embedded), float32, {context}"
    shape = _gpu.TINY_MISTRAL if args.quick else _gpu.MISTRAL_7B
    dtype = torch.bfloat16 if args.device.type == "cuda" else torch.float32
    model = _gpu.random_mistral(shape, max_positions=max(32768, needed), device=args.device, dtype=dtype)
    name = f"MistralForCausalLM, random weights, {str(dtype).removeprefix('torch.')}, {shape}"
    return model, _gpu.embedded_tokenizer(), name


def make_report(args: argparse.Namespace, results: dict[str, list[dict]], model: str) -> dict:
    """The JSON: machine, exact command, workload, per-variant rows, and the ratios the table prints."""
    workload = {k: getattr(args, k) for k in ("concurrency", "chunks", "per_request", "doc_tokens", "query_tokens")}
    workload |= {"zipf": args.zipf, "seed": args.seed, "block_size": args.block_size}
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__, "note": "CPU"}
    return {
        "machine": machine if args.device.type == "cpu" else _gpu.environment(args.device),
        "model": model,
        "command": " ".join(["python", Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "torch_threads": torch.get_num_threads(),
        "workload": workload | {"pool_blocks": pool_tokens(args) // args.block_size},
        "variants": {name: {"policy": p, "share_chunk_blocks": s} for name, (p, s) in VARIANTS.items()},
        "results": results,
        "private_over_mepic": private_over_shared(results),
    }


def main() -> None:
    torch.set_num_threads(1)
    args = parse_args()
    model, tokenizer, model_name = load_model(args)
    docs, requests = make_workload(args, 512)  # stories260K's vocabulary: every model runs the same token ids
    results: dict[str, list[dict]] = {}
    for name, (policy, share) in VARIANTS.items():
        config = pic.PICConfig(share_chunk_blocks=share, kv_pool_tokens=pool_tokens(args), block_size=args.block_size)
        results[name] = []
        for n in args.concurrency:
            results[name].append(run(model, tokenizer, config, policy, docs, requests[:n]))
            if args.device.type == "cuda":  # each run's engine allocated its own pool: free it before the next
                gc.collect()
                torch.cuda.empty_cache()
    for s, p in zip(results[SHARED], results[PRIVATE], strict=True):  # what the README says of these numbers
        assert s["peak_blocks"] == s["floor_blocks"], f"shared MEPIC above its floor at N={s['n']}"
        assert s["peak_blocks"] <= p["peak_blocks"], f"sharing used more blocks than copying at N={s['n']}"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = make_report(args, results, model_name)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(results))
    link_ms = {name: [round(1000 * r["median_link_s"], 1) for r in rows] for name, rows in results.items()}
    print(f"\nmedian link ms at N = {args.concurrency}: " + "; ".join(f"{k} {v}" for k, v in link_ms.items()))
    title = f"{args.per_request} of {args.chunks} chunks per request (Zipf {args.zipf:g}), block {args.block_size}"
    where = f"{args.model}, {report['machine'].get('gpu') or 'CPU'}"  # "stories260K, CPU" by default
    plot(results, f"{where}: {title}", out.with_suffix(".png"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
