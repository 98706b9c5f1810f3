"""Inter-token latency of running streams while a large compile runs, and the engine's batched throughput.

python benchmarks/engine_flood.py --label before --out benchmarks/results/engine_flood_before.json
python benchmarks/engine_flood.py --label after --out benchmarks/results/engine_flood_after.json

Issue 32 ("the engine schedules all work"): ``compile`` used to run as one command on the engine's thread, so
every running stream froze until a compile of many documents was done. On the embedded stories260K (``pic.load``),
CPU, torch on one thread:

1. Inter-token latency. 16 threads each link two small compiled chunks with a query and ``Linked.stream`` text
   pieces (no EOS; 300-420 new tokens, staggered, capped by the 512-token context), timestamping every piece, and
   link again when a stream ends, until the measurement is over. A gap is the time between two consecutive pieces
   of one stream. Each round measures (a) *alone*: the gaps overlapping a window with nothing else running, as
   long as the last compile took (1-5 s), then (b) *flood*: the gaps overlapping the window of one ``PIC.compile`` call
   (made from the main thread) of 200 new documents of about 290 tokens (seeded random words; every round's
   documents are new, checked). A warm-up round (one unmeasured compile) runs first. p50/p99/max are over every
   gap of every measured round pooled; ``p99_ratio`` is p99(flood) / p99(alone).
2. Throughput at 16 sequences: ``benchmarks/throughput.py``'s workload and functions (64 requests linking 4-8
   of 32 chunks, 64 new tokens, ``legolink:16``), only the facade and ``generate_many`` at ``max_num_seqs`` 16,
   interleaved, medians over the repeats: ``tokens_per_s_over_facade`` is docs/engine.md's "engine,
   max_num_seqs 16" row (3.33x when it was measured alongside 1, 4 and 64).

Only public API: ``pic.load``, ``PIC.compile``, ``PIC.link``, ``Linked.stream``, ``PIC.generate_many`` (through
throughput.py), ``pic.Request``, ``pic.PICConfig``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import threading
import time
from itertools import pairwise
from pathlib import Path

import torch

import pic

HERE = Path(__file__).resolve().parent
NUM_STREAMS = 16
NUM_DOCS = 200
WORDS_PER_DOC = 102  # about 290 stories260K tokens with BOS (measured and reported)
DOC_BLOCK_TOKENS = 352  # room for a document in the pool: 22 blocks of 16 (the longest seen; about 19 on average)
WORDS = (
    "the a and little big small girl boy dog cat bird fish mom dad friend teacher baby king queen dragon "
    "ball tree park sun moon star house garden school box cake toy book car boat hat shoe flower apple "
    "red blue green yellow happy sad loud quiet kind brave funny shiny soft old new fast slow "
    "ran jumped played saw said liked wanted found made gave took went came looked smiled laughed cried "
    "ate drank sang danced walked climbed opened helped shared hugged was were had is in on under with to "
    "of for from after before then so but very one day night morning time"
).split()
STREAM_CHUNKS = [
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun.",
    "Tom had a big red ball. He liked to throw it to his dog, Max, in the park.",
    "One day, a small bird flew into the garden. It was looking for some food.",
    "Sam and Sue went to the beach with their mom. They built a big castle in the sand.",
    "There was a kind old man who lived in a little house near the woods.",
    "The cat sat on the mat. It was warm and soft, and the cat was very happy.",
    "Ben wanted to bake a cake for his friend. He asked his dad to help him.",
    "A little boat sailed on the blue sea. The sun was shining and the wind was soft.",
]
QUERIES = ["One day,", "Then", "After that,", "The next morning,", "Suddenly,", "Later,", "So", "At night,"]


def make_docs(tag: str, seed: int) -> list[str]:
    """``NUM_DOCS`` documents of seeded random words; ``tag`` (the round) makes them new in every round."""
    rng = random.Random(f"{seed}-{tag}")
    docs = []
    for i in range(NUM_DOCS):
        words = [rng.choice(WORDS) for _ in range(WORDS_PER_DOC)]
        docs.append(f"Document {tag}-{i}. " + " ".join(words) + ".")
    return docs


def quantile(values: list[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default) of a non-empty list."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


class Streams:
    """``NUM_STREAMS`` threads that link and stream, again and again, recording every piece's arrival time."""

    def __init__(self, engine: pic.PIC, chunk_ids: list[str], max_new_tokens: list[int]) -> None:
        self.engine, self.chunk_ids, self.max_new_tokens = engine, chunk_ids, max_new_tokens
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.streams: list[list[float]] = []  # one list of piece times per stream (a thread makes many)
        self.num_pieces = 0
        self.num_tokens = 0  # generated tokens of the streams that finished (to compare with pieces)
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(NUM_STREAMS)]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def _run(self, index: int) -> None:
        n = len(self.chunk_ids)
        ids = [self.chunk_ids[index % n], self.chunk_ids[(index + 3) % n]]
        query = QUERIES[index % len(QUERIES)]
        try:
            while not self.stop.is_set():
                times: list[float] = []
                with self.lock:
                    self.streams.append(times)
                pieces = self.engine.link(ids, query).stream(self.max_new_tokens[index])
                try:
                    while True:
                        next(pieces)
                        times.append(time.perf_counter())
                        if self.stop.is_set():
                            break
                except StopIteration as done:  # the stream's Generation
                    with self.lock:
                        self.num_tokens += done.value.stats.num_generated_tokens
                        self.num_pieces += len(times)
                finally:
                    pieces.close()
        except BaseException as exc:  # noqa: BLE001  (reported by the main thread)
            self.errors.append(exc)

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=120)
        if self.errors:
            raise RuntimeError("a stream failed") from self.errors[0]

    def window(self, start: float, end: float) -> dict:
        """The gaps between consecutive pieces of one stream that overlap ``[start, end]``, the longest time
        with no piece from any stream that overlaps it, and the pieces per second received in it."""
        with self.lock:
            streams = [list(times) for times in self.streams]
        gaps = [b - a for times in streams for a, b in pairwise(times) if b >= start and a <= end]
        merged = sorted(t for times in streams for t in times)
        stalls = [b - a for a, b in pairwise(merged) if b >= start and a <= end]
        inside = sum(start <= t <= end for t in merged)
        return {"gaps": gaps, "stall": max(stalls, default=end - start), "pieces_per_s": inside / (end - start)}


def summary(gaps: list[float]) -> dict:
    return {
        "p50": 1000 * quantile(gaps, 0.50),
        "p99": 1000 * quantile(gaps, 0.99),
        "max": 1000 * max(gaps),
        "mean": 1000 * statistics.fmean(gaps),
        "n": len(gaps),
    }


def resident_chunks(engine: pic.PIC) -> dict:
    """Resident and evicted chunk counts when the engine reports them (``kv_stats``), else empty."""
    try:
        stats = engine.kv_stats()
    except AttributeError:
        return {}
    return {"resident": stats.num_resident_chunks, "evicted": stats.num_evicted_chunks}


def measure_itl(args: argparse.Namespace) -> tuple[dict, pic.PIC]:
    """Part 1: warm-up, then per round an alone window and a flood window (one compile of new documents)."""
    pool = NUM_STREAMS * 2 * 512 + (args.rounds + 1) * NUM_DOCS * DOC_BLOCK_TOKENS + 64 * 16
    budget = {} if args.max_num_batched_tokens is None else {"max_num_batched_tokens": args.max_num_batched_tokens}
    config = pic.PICConfig(kv_pool_tokens=pool, eos_token_ids=(), max_num_seqs=NUM_STREAMS, **budget)
    engine = pic.load(config=config)
    chunk_ids = engine.compile(STREAM_CHUNKS, progress=False)
    doc_tokens = [len(engine.tokenizer(d)["input_ids"]) for d in make_docs("probe", args.seed)]
    max_new = [300 + 8 * i for i in range(NUM_STREAMS)]  # staggered, so the streams do not all end together
    streams = Streams(engine, chunk_ids, max_new)
    seen: set[str] = set()

    def compile_round(tag: str) -> tuple[float, float, float]:
        docs = make_docs(tag, args.seed)
        before = resident_chunks(engine)
        start = time.perf_counter()
        ids = engine.compile(docs, progress=False)
        end = time.perf_counter()
        after = resident_chunks(engine)
        assert len(set(ids)) == NUM_DOCS and not seen & set(ids), "a round's documents were not all new"
        seen.update(ids)
        if before and after:
            assert after["resident"] - before["resident"] == NUM_DOCS, (before, after)
            assert after["evicted"] == 0, after
        return start, end, end - start

    streams.start()
    time.sleep(args.settle)
    *_, last_compile = compile_round("warmup")
    time.sleep(args.settle)
    rounds = []
    alone_gaps: list[float] = []
    flood_gaps: list[float] = []
    try:
        for r in range(args.rounds):
            start = time.perf_counter()
            time.sleep(min(max(last_compile, args.min_window), args.max_window))
            alone = streams.window(start, time.perf_counter())
            start, end, last_compile = compile_round(str(r))
            time.sleep(args.settle)  # the pieces that end the compile's gaps arrive after it
            flood = streams.window(start, end)
            alone_gaps += alone["gaps"]
            flood_gaps += flood["gaps"]
            rounds.append(
                {
                    "compile_s": last_compile,
                    "alone": summary(alone["gaps"]) | {"stall_ms": 1000 * alone["stall"]},
                    "flood": summary(flood["gaps"]) | {"stall_ms": 1000 * flood["stall"]},
                    "alone_pieces_per_s": alone["pieces_per_s"],
                    "flood_pieces_per_s": flood["pieces_per_s"],
                }
            )
            row = rounds[-1]
            print(
                f"round {r}: compile {last_compile:.2f} s; gap p50/p99/max ms alone "
                f"{row['alone']['p50']:.1f}/{row['alone']['p99']:.1f}/{row['alone']['max']:.1f}, flood "
                f"{row['flood']['p50']:.1f}/{row['flood']['p99']:.1f}/{row['flood']['max']:.1f}; pieces/s "
                f"{row['alone_pieces_per_s']:.0f} alone, {row['flood_pieces_per_s']:.0f} flood"
            )
    finally:
        streams.finish()
    itl = {
        "itl_unit": "ms",
        "itl_alone": summary(alone_gaps),
        "itl_flood": summary(flood_gaps),
        "compile_s": statistics.median(r["compile_s"] for r in rounds),
        "compile_s_rounds": [r["compile_s"] for r in rounds],
        "p99_ratio": quantile(flood_gaps, 0.99) / quantile(alone_gaps, 0.99),
        "pieces_per_token": streams.num_pieces / max(streams.num_tokens, 1),
        "doc_tokens": {"mean": statistics.fmean(doc_tokens), "min": min(doc_tokens), "max": max(doc_tokens)},
        "chunks": resident_chunks(engine),
        "rounds": rounds,
        "config": {
            "kv_pool_tokens": pool,
            "eos_token_ids": [],
            "max_num_seqs": NUM_STREAMS,
            "streams": NUM_STREAMS,
            "stream_max_new_tokens": [max_new[0], max_new[-1]],
            "docs_per_compile": NUM_DOCS,
            "words_per_doc": WORDS_PER_DOC,
            "rounds": args.rounds,
            "settle_s": args.settle,
            "min_window_s": args.min_window,
            "max_window_s": args.max_window,
            "seed": args.seed,
        },
    }
    return itl, engine


def measure_throughput(engine: pic.PIC, repeats: int) -> dict:
    """Part 2: throughput.py's facade and ``engine 16`` variants over the loaded model, interleaved."""
    sys.path.insert(0, str(HERE))
    import throughput as tp

    argv = sys.argv
    try:
        sys.argv = ["throughput.py", "--max-num-seqs", "16", "--repeats", str(repeats)]
        args = tp.parse_args()
    finally:
        sys.argv = argv
    variants = {tp.FACADE: 1, "engine 16": 16}
    instances = {name: tp.build(engine.model, engine.tokenizer, args, n) for name, n in variants.items()}
    docs, requests = tp.make_workload(instances[tp.FACADE], args)
    engines = {name: (e, e.compile(docs, progress=False)) for name, e in instances.items()}
    raw = tp.measure(engines, requests, args)
    medians = tp.summarize(raw)
    for e in instances.values():
        e.close()
    print(tp.table(medians))
    return {
        "workload": "benchmarks/throughput.py defaults, --max-num-seqs 16 --repeats " + str(repeats),
        "tokens_per_s_over_facade": medians["engine 16"]["tokens_per_s_over_facade"],
        "docs_engine_md_figure": 3.33,
        "medians": medians,
        "raw_tokens_per_s": {name: [r["tokens_per_s"] for r in rows] for name, rows in raw.items()},
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(HERE / "results" / "engine_flood.json"), help="the JSON to write")
    parser.add_argument("--label", default="run", help="a name for this run (before, after)")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds (one alone and one flood window each)")
    parser.add_argument("--throughput-repeats", type=int, default=3, help="0: skip the throughput part")
    parser.add_argument("--settle", type=float, default=0.5, help="seconds between windows")
    parser.add_argument("--min-window", type=float, default=1.0, help="shortest alone window, seconds")
    parser.add_argument("--max-window", type=float, default=5.0, help="longest alone window, seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="the engine's token budget per step (default: its own)"
    )
    return parser.parse_args()


def main() -> None:
    torch.set_num_threads(1)
    args = parse_args()
    began = time.perf_counter()
    itl, engine = measure_itl(args)
    print(
        f"{args.label}: gap p50/p99/max ms alone {itl['itl_alone']['p50']:.1f}/{itl['itl_alone']['p99']:.1f}/"
        f"{itl['itl_alone']['max']:.1f}, during compile {itl['itl_flood']['p50']:.1f}/{itl['itl_flood']['p99']:.1f}/"
        f"{itl['itl_flood']['max']:.1f}; compile {itl['compile_s']:.2f} s; p99 ratio {itl['p99_ratio']:.1f}x"
    )
    throughput = measure_throughput(engine, args.throughput_repeats) if args.throughput_repeats > 0 else None
    engine.close()
    report = {
        "label": args.label,
        "model": "stories260K (embedded), float32, CPU",
        "torch_threads": torch.get_num_threads(),
        "pic": str(Path(pic.__file__).parent),
        "machine": machine(),
        "command": " ".join(["python", *sys.argv]),
        "config": itl.pop("config"),
        **itl,
        "throughput": throughput,
        "wall_s": time.perf_counter() - began,
    }
    write_report(report, args.out)


def machine() -> dict:
    """The machine a result was measured on."""
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__}


def write_report(report: dict, path: str) -> None:
    """Write ``report`` (with its ``wall_s``) as indented JSON to ``path``, and say so."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out} in {report['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
