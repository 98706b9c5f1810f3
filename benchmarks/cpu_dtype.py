"""float32 against bfloat16 on the CPU, side by side in one run: pic's Full Recompute and default link against
transformers' prefill in the same dtype, llama.cpp's prefill, and decode tokens/s.

    python benchmarks/cpu_dtype.py                               # SmolLM2, 1K, 2K and 7.5K tokens, 1 and 2 threads
    python benchmarks/cpu_dtype.py --contexts 2048 --threads 1   # one cell
    python benchmarks/cpu_dtype.py --quick --out /tmp/d          # a smoke run: stories260K, seconds

The model is SmolLM2-135M-Instruct (``pic.load("smollm2")``: its GGUF dequantized, then cast), once per dtype. A
context of C tokens is a RAG prompt: prose documents of ~512 tokens (``pic.evaluation.haystack``) compiled once per
engine (not timed), linked in order with a question; transformers and llama.cpp read the same token ids
(``Linked.input_ids``). In each round (after a warm-up round), in turn, per dtype: ``hf``, transformers' forward over
the prompt (``logits_to_keep=1``); ``full``, pic's Full Recompute link and first token; ``auto``, pic's default link
and first token; then llama.cpp's prefill of the ids (its GGUF, Q4_1: the only one the package has) when installed.
Medians of ``--rounds``; ratios of the same round's medians. Decode, at ``--decode-context``: tokens/s after the
first token (``_decode_rates``): pic in float32 and bfloat16, each with its model's weights and with int8 decode
weights, at batches 1, 8 and 16 (the same request, together); transformers in both dtypes and llama.cpp at batch 1.
The prompts' ids go into the JSON too, so ``vllm_prefill.py`` times vLLM's prefill of the same ids in its own
virtualenv. Writes ``--out/cpu_dtype.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import pic
from pic.model.dtypes import cpu_bf16_unit
from pic.model.loading import EMBEDDED_MODEL

sys.path.insert(0, str(Path(__file__).parent))
import _gpu  # noqa: E402
from _decode_rates import hf_rate, llama_rate, pic_rate  # noqa: E402

DTYPES = ("float32", "bfloat16")
QUESTION = "Which of the documents above says the most about where the names come from?"


def documents(tokenizer, num: int, tokens: int) -> list[str]:
    """``num`` prose documents of about ``tokens`` tokens each (the evaluation's haystack sentences)."""
    from pic.evaluation.haystack import sentences

    out, current, words = [], [], sentences()
    for sentence in words:
        current.append(sentence)
        text = " ".join(current)
        if len(tokenizer(text, add_special_tokens=False)["input_ids"]) >= tokens:
            out.append(text + "\n")
            current = []
            if len(out) == num:
                return out
    raise SystemExit(f"the haystack holds fewer than {num} documents of {tokens} tokens")


def prefill_row(engines: dict, docs: list[str], context: int, args, llm) -> dict:
    """One context: every variant in interleaved rounds; medians and ratios."""
    num_docs = max(1, context // args.doc_tokens)
    requests = {}
    for name, engine in engines.items():
        ids = engine.compile(docs[:num_docs], progress=False)
        requests[name] = (engine, ids)
    prompt = engines["float32"].link(requests["float32"][1], QUESTION, policy="full").input_ids.tolist()
    fns = {}
    for name, (engine, ids) in requests.items():
        fns[f"hf {name}"] = _hf(engine.model, prompt)
        for policy in ("full", "auto"):
            fns[f"{policy} {name}"] = _link(engine, ids, policy)
    if llm is not None:
        fns["llama.cpp"] = _llama(llm, prompt)
    _gpu.interleaved(fns, rounds=1)  # warm-up
    raw = _gpu.interleaved(fns, rounds=args.rounds)
    med = _gpu.medians(raw)
    row = {"context_tokens": context, "prompt_tokens": len(prompt), "median_s": med, "rounds_s": raw}
    row["full_over_hf"] = {d: med[f"full {d}"] / med[f"hf {d}"] for d in DTYPES}
    row["bf16_gain"] = {v: med[f"{v} float32"] / med[f"{v} bfloat16"] for v in ("hf", "full", "auto")}
    row["auto_speedup_vs_full"] = {d: med[f"full {d}"] / med[f"auto {d}"] for d in DTYPES}
    row["prompt_ids"] = " ".join(map(str, prompt))  # (one string: the JSON stays small; vllm_prefill.py splits it)
    return row


def _hf(model, prompt: list[int]):
    ids = torch.tensor([prompt])

    def run() -> float:
        start = time.perf_counter()
        with torch.no_grad():
            model(ids, use_cache=False, logits_to_keep=1)
        return time.perf_counter() - start

    return run


def _link(engine, ids: list[str], policy: str):
    def run() -> float:
        start = time.perf_counter()
        engine.link(ids, QUESTION, policy=policy).generate(max_new_tokens=1)
        return time.perf_counter() - start

    return run


def _llama(llm, prompt: list[int]):
    def run() -> float:
        llm.reset()  # an empty cache: nothing reused
        start = time.perf_counter()
        llm.eval(prompt)
        return time.perf_counter() - start

    return run


def _llama_cpp(n_ctx: int, threads: int):
    """llama.cpp on SmolLM2's GGUF with ``threads`` threads, or ``None`` when llama-cpp-python is not installed."""
    try:
        from llama_cpp import Llama
    except ImportError:
        print("llama.cpp skipped: llama-cpp-python is not installed", flush=True)
        return None
    from cpu_rag import smollm2_path

    return Llama(str(smollm2_path()), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512,
                 verbose=False)  # fmt: skip


def decode_row(engines: dict, int8: dict, docs: list[str], context: int, args, llm) -> dict:
    """Decode tokens/s after the first token at ``context``, side by side: pic at each of ``args.batches`` (the same
    request ``batch`` times, together), transformers and llama.cpp at batch 1."""
    num_docs = max(1, context // args.doc_tokens)
    fns = {}
    for name, engine in {**engines, **{f"{d} int8": e for d, e in int8.items()}}.items():
        ids = engine.compile(docs[:num_docs], progress=False)
        for batch in args.batches:
            link = lambda e=engine, i=ids: e.link(i, QUESTION, policy="auto")  # noqa: E731
            fns[f"pic {name} x{batch}"] = pic_rate(link, batch, args.new_tokens)
    prompt = engines["float32"].link(engines["float32"].compile(docs[:num_docs]), QUESTION).input_ids.tolist()
    for name, engine in engines.items():
        fns[f"hf {name}"] = hf_rate(engine.model, prompt, args.new_tokens)
    if llm is not None:
        from cpu_rag import llama_greedy

        fns["llama.cpp"] = llama_rate(llm, prompt, args.new_tokens, llama_greedy)
    _gpu.interleaved(fns, rounds=1)
    raw = _gpu.interleaved(fns, rounds=args.rounds)
    return {"context_tokens": context, "prompt_tokens": len(prompt), "tokens_per_s": _gpu.medians(raw), "rounds": raw}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 7500])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode-context", type=int, default=2048)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16], help="pic's decode batches")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--doc-tokens", type=int, default=500)
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep the rows of other thread counts already in --out")
    parser.add_argument("--quick", action="store_true", help="stories260K, short contexts, one round")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if args.quick:
        args.contexts, args.threads, args.rounds, args.new_tokens, args.doc_tokens = [128], [1], 1, 4, 60
        args.decode_context, args.batches = 128, [1, 2]
    name = EMBEDDED_MODEL if args.quick else "smollm2"
    config = pic.PICConfig(kv_pool_tokens=4 * max(args.contexts) + 4096, eos_token_ids=())  # decode: no EOS
    engines = {d: pic.PIC.from_pretrained(name, dtype=d, config=config) for d in DTYPES}
    int8_config = pic.PICConfig(**config.model_dump(exclude={"decode_weights"}), decode_weights="int8")
    int8 = {d: pic.PIC(e.model, e.tokenizer, config=int8_config) for d, e in engines.items()}
    num_docs = max(args.contexts) // args.doc_tokens + 1
    docs = documents(engines["float32"].tokenizer, num_docs, args.doc_tokens)
    report = {"command": _gpu.command(), "environment": _gpu.environment(torch.device("cpu")),
              "settings": {"model": engines["float32"].model_name, "doc_tokens": args.doc_tokens,
                           "rounds": args.rounds, "new_tokens": args.new_tokens,
                           "bf16_unit": cpu_bf16_unit().value},
              "rows": []}  # fmt: skip
    path = args.out / "cpu_dtype.json"
    if args.keep and path.exists():  # (a run per thread count, each on a machine as quiet as it gets)
        kept = json.loads(path.read_text())
        report["rows"] = [r for r in kept["rows"] if r["threads"] not in args.threads]
        report["decode"] = [r for r in kept.get("decode", []) if r["threads"] not in args.threads]
    for threads in args.threads:
        torch.set_num_threads(threads)
        n_ctx = max(args.contexts) + args.new_tokens + 64
        llm = None if args.quick or args.no_llama_cpp else _llama_cpp(n_ctx, threads)
        for context in args.contexts:
            row = prefill_row(engines, docs, context, args, llm) | {"threads": threads}
            report["rows"].append(row)
            _gpu.write_json(path, report)
            print(f"threads {threads}, {row['prompt_tokens']} tokens: full/hf {row['full_over_hf']}, "
                  f"bf16 gain {row['bf16_gain']}, auto/full {row['auto_speedup_vs_full']}", flush=True)  # fmt: skip
        decode = decode_row(engines, int8, docs, args.decode_context, args, llm) | {"threads": threads}
        report.setdefault("decode", []).append(decode)
        print(f"threads {threads}: decode tok/s {decode['tokens_per_s']}", flush=True)
        _gpu.write_json(path, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
