"""Where a long link spends its time: wall time, top CUDA ops, kernel launches and host syncs per policy.

python benchmarks/profile_link.py                          # GPU: benchmarks/results/profile.txt
python benchmarks/profile_link.py --quick --out /tmp/p.txt # CPU smoke run: the tiny Mistral of ttft.py --quick
python benchmarks/profile_link.py --graphs                 # GPU: each policy again with CUDA graphs (issue 56)

The model, chunks and engine of ``benchmarks/ttft.py`` (Mistral-7B's shapes, random bfloat16 weights, chunks of 512
tokens): one link of --context tokens (the first context / 512 chunks, then a random 32-token query) and its first
token, per policy (naive, mepic, full by default). Per policy: two untimed links, then --repeats timed ones (wall
time with the device synchronised, and ``Generation.ttft_s``), then one under ``torch.profiler``: its top CUDA
ops by GPU time, top CPU ops, the kernel launches (``cudaLaunchKernel`` and ``cuLaunchKernel*`` calls) and the
host syncs (``cudaDeviceSynchronize``, ``cudaStreamSynchronize``, blocking ``cudaMemcpy``); and one more link under
torch's sync debug mode, which names the line of each synchronizing call (the engine's own thread runs the link;
the profiler's CUDA and runtime-API rows cover every thread, its CPU op rows only this one). Writes it all to --out.
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from pic.kv.transfer import sync_sites

sys.path.insert(0, str(Path(__file__).parent))
import _gpu  # noqa: E402
import ttft  # noqa: E402

SYNCS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy ")


def link_once(engine, ids: list[str], query: list[int], policy: str):
    """One link and its first token; the ``Generation``."""
    return engine.link(ids, query, policy=policy).generate(max_new_tokens=1)


def profile_policy(engine, ids, query, policy: str, args, log, *, label: str = "") -> None:
    """Wall time, the profiler's tables and counts, and the sync sites of one policy's link (logged as ``label``)."""
    name = label or policy
    for _ in range(2):
        link_once(engine, ids, query, policy)
    _gpu.sync(args.device)
    start = time.perf_counter()
    for _ in range(args.repeats):
        gen = link_once(engine, ids, query, policy)
    _gpu.sync(args.device)
    wall_ms = 1000 * (time.perf_counter() - start) / args.repeats
    log(f"{name}: wall per link + first token {wall_ms:.1f} ms, ttft_s {1000 * gen.ttft_s:.1f} ms")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        link_once(engine, ids, query, policy)
        _gpu.sync(args.device)
    ops = prof.key_averages()
    sort = "cuda_time_total" if args.device.type == "cuda" else "cpu_time_total"
    log(f"--- {name}: top ops by {sort}")
    log(ops.table(sort_by=sort, row_limit=args.rows, max_name_column_width=60))
    launches = sum(e.count for e in ops if "LaunchKernel" in e.key)
    syncs = sum(e.count for e in ops if e.key.startswith(SYNCS) or e.key == "cudaMemcpy")
    run = lambda: link_once(engine, ids, query, policy)  # noqa: E731
    sites = collections.Counter(f"{f}:{n}" for f, n in (sync_sites(run) if args.device.type == "cuda" else []))
    log(f"{name}: kernel launches {launches}, host syncs {syncs} (profiler); sync debug mode: {sum(sites.values())}")
    for site, count in sites.most_common(8):
        log(f"    {count} x {site}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=16384, help="tokens of chunks linked")
    parser.add_argument("--policies", nargs="+", default=["naive", "mepic", "full"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", type=int, default=15, help="ops listed per table")
    parser.add_argument("--quick", action="store_true", help="CPU: tiny Mistral, chunks of 32, torch backend")
    parser.add_argument("--graphs", action="store_true", help="each policy again with CUDA graphs (CUDA, Triton)")
    parser.add_argument("--out", default="benchmarks/results/profile.txt")
    args = parser.parse_args()
    if not args.quick and not torch.cuda.is_available():
        parser.error("this benchmark needs a CUDA GPU (--quick runs a smoke test on the CPU)")
    # ttft.build's settings: its model, chunks and engine, one context, no decode batch
    args.contexts, args.chunk_tokens, args.query_tokens, args.new_tokens = [args.context], 512, 32, 8
    args.decode_context, args.decode_batch, args.block_size, args.seed = 0, 0, 16, 0
    args.shape, args.device, args.dtype, args.backend = _gpu.MISTRAL_7B, torch.device("cuda"), torch.bfloat16, "auto"
    if args.quick:
        args.contexts, args.context, args.chunk_tokens, args.query_tokens, args.repeats = [128], 128, 32, 8, 1
        args.shape, args.dtype, args.backend = _gpu.TINY_MISTRAL, torch.float32, "torch"
        args.device = torch.device("cpu")
    return args


def main() -> None:
    args = parse_args()
    start = time.perf_counter()
    _, engine, _, ids = ttft.build(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as file:

        def log(text: str) -> None:
            print(text)
            print(text, file=file, flush=True)

        env = _gpu.environment(args.device)
        log(f"{_gpu.command()}\n{env['gpu'] or 'CPU'}, torch {env['torch']}, {engine.attention_backend} attention")
        rng = random.Random(args.seed + 1)
        query = [rng.randrange(3, args.vocab) for _ in range(args.query_tokens)]
        chunks = ids[: args.context // args.chunk_tokens]
        log(f"{len(chunks)} chunks of {args.chunk_tokens} tokens and {len(query)} query tokens; ready in "
            f"{time.perf_counter() - start:.0f} s")  # fmt: skip
        for policy in args.policies:
            profile_policy(engine, chunks, query, policy, args, log)
        if args.graphs and args.device.type == "cuda" and engine.attention_backend == "triton":
            with engine.paused() as core:  # captured per bucket in profile_policy's untimed links
                graphed = core.runner.use_graphs(capture=True)
            for policy in args.policies:
                profile_policy(engine, chunks, query, policy, args, log, label=f"{policy} graphs")
            log(f"graphs: {graphed.num_replays} forwards replayed, {graphed.num_eager} eager (plan differed)")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
