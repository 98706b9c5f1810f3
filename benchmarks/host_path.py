"""A link's host time: its wall time minus the forwards it ran, naive and ``auto``, at 4K to 32K tokens (issue 64).

    python benchmarks/host_path.py                                   # this checkout: 9 rounds at 4K, 16K, 32K
    python benchmarks/host_path.py --roots /tmp/pic_a69 .            # two checkouts, rounds interleaved (A B A B ...)
    python benchmarks/host_path.py --quick --out /tmp/host_path.json  # a smoke run: 2 rounds at 1K and 2K

The model is one whose forwards cost little, so that what a link spends on the host (laying the prompt out, the
policy's choice, the block table, slot positions, attention plans, the engine's hand-offs) is not lost beside them: a
random Llama (seed 0) of 32 layers, hidden size 64 (4 heads of 16, 2 KV heads), intermediate 128, vocabulary 512 (the
embedded stories260K tokenizer's), float32 on the CPU, torch on one thread, built with transformers and given to
``pic.PIC`` (no BOS: ``PICConfig(add_bos=False)``). 64 chunks of 512 random token ids are compiled once; a link at
``C`` tokens links the first ``C / 512`` of them (4K: 8, 16K: 32, 32K: 64) with a query of 32 random token ids.

*A link* is ``engine.link(ids, query, policy=p).generate(max_new_tokens=1)`` timed from the caller's thread: the
link's recompute pass, its first token (sampled from the pass's logits: no decode forward) and its release, i.e.
the whole round trip of a request that leaves nothing behind in the pool (a release left out would be paid by the
next link). The engine's forwards are timed one by one by wrapping the runner *instance*'s ``forward``
(``engine.paused()`` lends the core, as ``pic.model.op_count`` does): the same wrapper for every checkout, none of
which has a hook for it. Per (policy, context), over ``--rounds`` rounds after one untimed warm-up round:

- ``wall_ms``: the link's wall time; ``inside_ms``: its forwards' time (``forwards``: how many);
- ``outside_ms = wall_ms - inside_ms``: the host path, what the issue's targets are about;
- each as the ``median`` and the ``min`` (the least-disturbed round: this machine is shared and noisy).

``--roots A B``: each checkout (a path whose ``pic`` package is imported, checked by ``pic.__file__``) runs in its own
worker process that compiles once and then runs one round per request from this driver, the checkouts in turn in
every round (A B, then B A: neither always runs first), so both see the same machine load. Writes ``--out`` (JSON,
per root) and prints a table with each root's ratio to the first one's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHUNK_TOKENS = 512
QUERY_TOKENS = 32
VOCAB = 512


def _model(num_layers: int, max_tokens: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max(40960, max_tokens + 1024),
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


class ForwardClock:
    """Wraps a ``ModelRunner`` instance's ``forward``: each call's seconds, on the engine's thread."""

    def __init__(self, runner) -> None:
        self._forward, self.calls = runner.forward, []
        runner.forward = self

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self._forward(*args, **kwargs)
        finally:
            self.calls.append(time.perf_counter() - start)


class Worker:
    """One checkout's engine: the chunks compiled, the clock on its runner."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        from transformers import AutoTokenizer

        import pic

        torch.set_num_threads(1)
        self.pic = pic
        max_tokens = max(args.contexts)
        num_chunks = max_tokens // CHUNK_TOKENS
        tokenizer = AutoTokenizer.from_pretrained(str(pic.EMBEDDED_MODEL))
        config = pic.PICConfig(add_bos=False, kv_pool_tokens=max_tokens + 4096)
        self.engine = pic.PIC(_model(args.layers, max_tokens), tokenizer, config=config)
        gen = torch.Generator().manual_seed(1)
        chunks = [torch.randint(3, VOCAB, (CHUNK_TOKENS,), generator=gen).tolist() for _ in range(num_chunks)]
        self.query = torch.randint(3, VOCAB, (QUERY_TOKENS,), generator=gen).tolist()
        started = time.perf_counter()
        self.ids = self.engine.compile(chunks, progress=False)
        self.compile_s = time.perf_counter() - started
        with self.engine.paused() as core:
            runner = core.runner
        self.clock = ForwardClock(runner)
        self.args = args

    def link(self, policy: str, context: int) -> dict:
        ids = self.ids[: context // CHUNK_TOKENS]
        self.clock.calls.clear()
        start = time.perf_counter()
        linked = self.engine.link(ids, self.query, policy=policy)
        linked.generate(max_new_tokens=1)
        wall = time.perf_counter() - start
        inside = sum(self.clock.calls)
        return {
            "wall_ms": 1e3 * wall, "inside_ms": 1e3 * inside, "outside_ms": 1e3 * (wall - inside),
            "link_ms": 1e3 * linked.link_s, "forwards": len(self.clock.calls), "tokens": int(linked.input_ids.shape[0]),
            "recomputed": linked.num_recomputed, "ran": str(linked.policy),
        }  # fmt: skip

    def round(self) -> dict:
        return {f"{p}@{c}": self.link(p, c) for c in self.args.contexts for p in self.args.policies}


def worker_main(args: argparse.Namespace) -> None:
    """``--worker``: compile, one warm-up round, then one round (a JSON line) per line read from stdin."""
    worker = Worker(args)
    worker.round()  # warm-up: first allocations, the first link of each shape
    info = {"ready": True, "pic_file": worker.pic.__file__, "compile_s": worker.compile_s}
    print(json.dumps(info), flush=True)
    for line in sys.stdin:
        if line.strip() != "round":
            break
        print(json.dumps(worker.round()), flush=True)
    worker.engine.close()


def summarize(rounds: list[dict]) -> dict:
    out = {}
    for key in rounds[0]:
        samples = [r[key] for r in rounds]
        cell = {f: {"median": statistics.median(s[f] for s in samples), "min": min(s[f] for s in samples)}
                for f in ("wall_ms", "inside_ms", "outside_ms", "link_ms")}  # fmt: skip
        cell["outside_ms"]["at_min_wall"] = min(samples, key=lambda s: s["wall_ms"])["outside_ms"]
        cell |= {f: samples[-1][f] for f in ("forwards", "tokens", "recomputed", "ran")}
        cell["samples"] = [{f: round(s[f], 3) for f in ("wall_ms", "inside_ms", "outside_ms")} for s in samples]
        out[key] = cell
    return out


def _spawn(root: str, args: argparse.Namespace) -> subprocess.Popen:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--root", root, "--layers", str(args.layers),
           "--contexts", *map(str, args.contexts), "--policies", *args.policies]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def _read(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"a worker died (exit {proc.wait()})")
    return json.loads(line)


def driver_main(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    roots = [str(Path(r).resolve()) for r in args.roots]
    workers, infos = [], []
    for root in roots:  # one at a time: compiles do not share the CPUs with each other
        workers.append(_spawn(root, args))
        infos.append(_read(workers[-1]))
        print(f"{root}: ready ({infos[-1]['pic_file']}, compiled in {infos[-1]['compile_s']:.1f} s)", flush=True)
    rounds: list[list[dict]] = [[] for _ in roots]
    for r in range(args.rounds):
        order = list(range(len(roots)))
        if r % 2:
            order.reverse()
        for i in order:
            workers[i].stdin.write("round\n")
            workers[i].stdin.flush()
            rounds[i].append(_read(workers[i]))
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    for w in workers:
        w.stdin.close()
        w.wait()
    results = {root: {"pic_file": info["pic_file"], "commit": _commit(root), "compile_s": info["compile_s"],
                      "cells": summarize(rs)} for root, info, rs in zip(roots, infos, rounds, strict=True)}  # fmt: skip
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "model": {"layers": args.layers, "hidden_size": 64, "heads": 4, "kv_heads": 2, "vocab": VOCAB},
        "chunk_tokens": CHUNK_TOKENS, "query_tokens": QUERY_TOKENS, "rounds": args.rounds, "torch_threads": 1,
        "roots": results,
    }  # fmt: skip
    _print(report, roots)
    report["wall_s"] = time.perf_counter() - started
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out} in {report['wall_s']:.0f} s")


def _commit(root: str) -> str | None:
    proc = subprocess.run(["git", "-C", root, "describe", "--always", "--dirty"], capture_output=True, text=True)
    return proc.stdout.strip() or None


def _print(report: dict, roots: list[str]) -> None:
    base = report["roots"][roots[0]]["cells"]
    print(f"{'root':24s} {'cell':12s} {'fw':>3s} {'wall med/min':>15s} {'inside med/min':>15s} "
          f"{'outside med/min':>15s} {'outside/base min':>16s}")  # fmt: skip
    for key in base:
        for root in roots:
            c = report["roots"][root]["cells"][key]
            label = f"{Path(root).name}@{report['roots'][root]['commit'] or '?'}"[:24]
            ratio = c["outside_ms"]["min"] / base[key]["outside_ms"]["min"]
            print(f"{label:24s} {key:12s} {c['forwards']:3d} {_pair(c, 'wall_ms')} {_pair(c, 'inside_ms')} "
                  f"{_pair(c, 'outside_ms')} {ratio:15.2f}x")  # fmt: skip


def _pair(cell: dict, field: str) -> str:
    return f"{cell[field]['median']:7.1f}/{cell[field]['min']:7.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--roots", nargs="+", default=[str(HERE.parent)], help="checkouts to compare, interleaved")
    parser.add_argument("--contexts", nargs="+", type=int, default=[4096, 16384, 32768], help="prompt tokens")
    parser.add_argument("--policies", nargs="+", default=["naive", "auto"])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="2 rounds at 1K and 2K tokens")
    parser.add_argument("--out", default="benchmarks/results/host_path.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--root", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.contexts, args.rounds = [1024, 2048], 2
    if args.worker:
        root = Path(args.root).resolve()
        sys.path.insert(0, str(root))
        import pic

        if not Path(pic.__file__).resolve().is_relative_to(root):
            raise SystemExit(f"pic imported from {pic.__file__}, not from {root}")
        worker_main(args)
    else:
        driver_main(args)


if __name__ == "__main__":
    main()
