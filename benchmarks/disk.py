"""The disk tier against recompute: reading a compiled chunk back from disk (cold and from the page cache) and
linking a chunk only the disk holds, against prefilling the chunk again, side by side, on one thread.

python benchmarks/disk.py                      # SmolLM2-135M-Instruct; writes benchmarks/results/disk.json
python benchmarks/disk.py --quick --out /tmp/r # a smoke run on the embedded model

Chunks are passages of this repository's docs/ (as ``cpu_rag.py``), ``--chunk-tokens`` to twice that. In each
round, in turn, for one passage: ``prefill``, its ``compile`` on an engine without a store (the recompute a miss
costs); ``compile_to_disk``, its ``compile`` on an engine with a disk tier of its own (the prefill and the write
of its file: what the tier adds to a compile); ``disk_cold``, ``DiskTier.get`` of its chunk (compiled before by a
third engine) after dropping the file from the page cache (``posix_fadvise(DONTNEED)`` after ``fsync``: a read
from the device); ``disk_warm``, the same ``get`` again (the page cache: what a restart on a machine with free
memory sees). Then, for other passages: ``link_from_disk``, on an engine whose pool has never seen the chunk,
``link`` + ``generate(max_new_tokens=1)`` of it (load, promote into the pool, link: the first token of a request
after a restart); ``link_prefill``, ``compile`` + ``link`` + one token of a passage no engine has seen (what that
request costs with no disk tier). Medians over rounds; ratios are prefill time / disk time.
The break-even: a disk read pays while its bandwidth exceeds ``chunk bytes / prefill seconds``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

import pic
from pic.store import DiskTier

sys.path.insert(0, str(Path(__file__).parent))
import _gpu  # noqa: E402
from cpu_rag import passages  # noqa: E402

QUERY = "What is this passage about?"


def drop_from_page_cache(path: Path) -> None:
    """Make the next read of ``path`` come from the device (clean pages only: it was fsynced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def first_token(engine: pic.PIC, ids: list[str]) -> None:
    engine.link(ids, QUERY).generate(max_new_tokens=1)


def disk_tier(engine: pic.PIC) -> DiskTier:
    """The engine's disk tier (safe from any thread, like every lower tier)."""
    with engine.paused() as core:
        return next(t for t in core.store.lower if isinstance(t, DiskTier))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="the embedded model, short passages, two rounds")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.quick:
        args.model, args.chunk_tokens, args.rounds = pic.EMBEDDED_MODEL, 64, 2
    with tempfile.TemporaryDirectory(prefix="pic-disk-bench-", dir=os.environ.get("PIC_BENCH_DIR")) as folder:
        report = run(args, Path(folder))
    _gpu.write_json(args.out / ("disk_quick.json" if args.quick else "disk.json"), report)
    return 0


def run(args: argparse.Namespace, folder: Path) -> dict:
    store = pic.StoreConfig(disk_path=str(folder), disk_bytes=64 << 30)
    writer = pic.load(args.model, store=store, progress=False)  # compiles the chunks the disk serves
    plain = pic.load(args.model, progress=False)  # no store: every compile is a prefill
    reader = pic.load(args.model, store=store, progress=False)  # a "restarted" engine: its pool never saw them
    second = pic.StoreConfig(disk_path=str(folder / "second"), disk_bytes=64 << 30)
    disked = pic.load(args.model, store=second, progress=False)  # compiles what `plain` does, writing to disk
    docs = passages(plain.tokenizer, num=3 * args.rounds + 1, min_tokens=args.chunk_tokens,
                    max_tokens=2 * args.chunk_tokens)  # fmt: skip
    on_disk = writer.compile(docs[: 2 * args.rounds], progress=False)
    tier = disk_tier(writer)
    files = [tier.path / f"{cid}.kv" for cid in on_disk]
    for path in files:
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
    plain.compile([docs[-1]], progress=False)  # warm-up
    fresh = iter(docs[2 * args.rounds : -1])

    def cold(i: int) -> float:
        drop_from_page_cache(files[i])
        return timed(lambda: tier.get(on_disk[i]))

    def link_prefill() -> float:
        return timed(lambda: first_token(plain, plain.compile([next(fresh)], progress=False)))

    raw: dict[str, list[float]] = {"prefill": [], "compile_to_disk": [], "disk_cold": [], "disk_warm": [],
                                   "link_from_disk": [], "link_prefill": []}  # fmt: skip
    for r in range(args.rounds):
        raw["prefill"].append(timed(partial(plain.compile, [docs[r]], progress=False)))  # docs[r]: new to `plain`
        raw["compile_to_disk"].append(timed(partial(disked.compile, [docs[r]], progress=False)))
        raw["disk_cold"].append(cold(r))
        raw["disk_warm"].append(timed(partial(tier.get, on_disk[r])))
        drop_from_page_cache(files[args.rounds + r])
        raw["link_from_disk"].append(timed(partial(first_token, reader, [on_disk[args.rounds + r]])))
        raw["link_prefill"].append(link_prefill())
    return summarize(args, raw, [f.stat().st_size for f in files], plain)


def summarize(args: argparse.Namespace, raw: dict[str, list[float]], sizes: list[int], engine: pic.PIC) -> dict:
    med = _gpu.medians(raw)
    num_bytes = statistics.median(sizes)
    tokens_per_chunk = num_bytes / engine.spec.kv_bytes_per_token
    report = {
        "command": _gpu.command(),
        "environment": _gpu.environment(torch.device("cpu")) | {"torch_threads": 1},
        "model": str(args.model),
        "settings": {"chunk_tokens": args.chunk_tokens, "rounds": args.rounds},
        "chunk_file_bytes_median": num_bytes,
        "chunk_tokens_median": round(tokens_per_chunk),
        "raw_s": raw,
        "median_s": med,
        "read_gb_per_s": {k: num_bytes / med[k] / 1e9 for k in ("disk_cold", "disk_warm")},
        "prefill_over_disk": {k: med["prefill"] / med[k] for k in ("disk_cold", "disk_warm")},
        "link_prefill_over_link_from_disk": med["link_prefill"] / med["link_from_disk"],
        "compile_to_disk_over_prefill": med["compile_to_disk"] / med["prefill"],
        "break_even_gb_per_s": num_bytes / med["prefill"] / 1e9,
    }
    print(f"{args.model}: chunk {num_bytes / 2**20:.1f} MiB (~{tokens_per_chunk:.0f} tokens); prefill "
          f"{med['prefill'] * 1e3:.0f} ms (writing it to disk too: {med['compile_to_disk'] * 1e3:.0f} ms), "
          f"disk cold {med['disk_cold'] * 1e3:.1f} ms "
          f"({report['read_gb_per_s']['disk_cold']:.2f} GB/s), warm {med['disk_warm'] * 1e3:.1f} ms "
          f"({report['read_gb_per_s']['disk_warm']:.2f} GB/s); link from disk {med['link_from_disk'] * 1e3:.0f} ms "
          f"vs compile+link {med['link_prefill'] * 1e3:.0f} ms; break-even {report['break_even_gb_per_s']:.3f} GB/s",
          flush=True)  # fmt: skip
    return report


if __name__ == "__main__":
    sys.exit(main())
