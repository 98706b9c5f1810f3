"""CPU speed on a random Llama: link under every policy and Full Recompute against transformers' prefill, and
decode against transformers' ``generate``, side by side, one torch thread.

python benchmarks/cpu.py                             # 1K/4K/8K; writes benchmarks/results/cpu.json and cpu.png
python benchmarks/cpu.py --quick --out /tmp/cpu      # a smoke run on a tiny Llama (seconds)

The model is a ``LlamaForCausalLM`` (hidden 512, 8 layers, 8 query / 2 KV heads, MLP 1376, vocab 32000) with
transformers' random init (seeded), float32, SDPA, no EOS: speed does not depend on the weights. Documents are random
token ids, chunks of 511 tokens (512 with their BOS), compiled once (not timed). A context of C tokens links the
first C / 512 chunks and a random 32-token query. Per context, in each round (after one warm-up round), in turn:
``hf``, transformers' forward over the prompt with ``logits_to_keep=32``, and for ``full`` and each policy,
``engine.link(ids, query, policy=p).generate(max_new_tokens=1)`` (link and first token); medians of the rounds.
Decode: ``_decode.decode`` at batch 1 (pic links with Full Recompute, so its tokens can be compared with
transformers'), tokens/s after the first token. Then, at the last decode context, ``_decode_rates`` in interleaved
rounds: transformers at batch 1 and pic after mepic links, with the model's weights and with int8 decode weights
(``decode_weights="int8"``), at batch 1 and at each of ``--batches`` requests decoding together.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

import pic

sys.path.insert(0, str(Path(__file__).parent))
import _gpu  # noqa: E402
from _decode import HF, decode, prompt_ids  # noqa: E402
from _decode_rates import hf_rate, pic_rate  # noqa: E402

SHAPE = {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2,
         "intermediate_size": 1376, "vocab_size": 32000}  # fmt: skip
QUICK_SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "intermediate_size": 128, "vocab_size": 512}  # fmt: skip
POLICIES = ("mepic", "legolink:16", "naive", "cacheblend:0.15")


def random_llama(shape: dict[str, int], *, max_positions: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**shape, max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=None,
                         pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()


def context_request(
    engine: pic.PIC, ids: list[str], docs, context: int, args
) -> tuple[list[str], list[int], list[int]]:
    """A context's request: the cache ids of its first ``context / chunk_tokens`` chunks, its random query (seeded by
    the context), and the whole prompt's token ids as transformers reads them."""
    rng = random.Random(args.seed + context)
    chunks = list(range(context // args.chunk_tokens))
    query = [rng.randrange(3, args.vocab) for _ in range(args.query_tokens)]
    return [ids[c] for c in chunks], query, prompt_ids(docs, chunks, query, engine.bos_token_id)


def prefill_row(engine: pic.PIC, model, ids: list[str], docs, context: int, args) -> dict:
    """One context: every variant timed in interleaved rounds; medians, ratios and recomputed tokens."""
    links, query, prompt = context_request(engine, ids, docs, context, args)
    first_tokens, recomputed = {}, {}

    def hf() -> float:
        start = time.perf_counter()
        with torch.no_grad():
            logits = model(torch.tensor([prompt]), use_cache=False, logits_to_keep=args.query_tokens).logits
        first_tokens[HF] = int(logits[0, -1].argmax())
        return time.perf_counter() - start

    def link(policy: str):
        def run() -> float:
            start = time.perf_counter()
            linked = engine.link(links, query, policy=policy)
            first_tokens[policy] = linked.generate(max_new_tokens=1).token_ids[0]
            recomputed[policy] = linked.num_recomputed
            return time.perf_counter() - start

        return run

    fns = {HF: hf, "full": link("full")} | {p: link(p) for p in args.policies}
    _gpu.interleaved(fns, rounds=1)  # warm-up
    raw = _gpu.interleaved(fns, rounds=args.repeats)
    med = _gpu.medians(raw)
    return {
        "context_tokens": context,
        "prompt_tokens": len(prompt),
        "median_s": med,
        "rounds_s": raw,
        "full_over_hf": med["full"] / med[HF],
        "hf_over_link": {p: med[HF] / med[p] for p in args.policies},
        "recomputed_tokens": recomputed,
        "full_first_token_equals_hf": first_tokens["full"] == first_tokens[HF],
    }


def memory_row(engine: pic.PIC, model, ids: list[str], docs, context: int, args) -> dict:
    """Peak resident memory (KiB) above the level before, of transformers' prefill and of a link and its first
    token (Full Recompute and mepic) at ``context``: freed memory is returned to the OS first (``malloc_trim``) and
    the kernel's peak reset (``/proc/self/clear_refs``), so each peak is the variant's own temporaries."""
    links, query, prompt = context_request(engine, ids, docs, context, args)
    runs = {HF: lambda: model(torch.tensor([prompt]), use_cache=False, logits_to_keep=args.query_tokens)}
    runs |= {p: (lambda p=p: engine.link(links, query, policy=p).generate(max_new_tokens=1)) for p in ("full", "mepic")}
    peaks = {name: peak_rss_kib(run) for name, run in runs.items()}
    return {"context_tokens": context, "prompt_tokens": len(prompt), "peak_kib": peaks}


def peak_rss_kib(run) -> int:
    """Peak resident memory (KiB) of ``run()`` above the level before it (Linux): freed memory is returned to the OS
    (``malloc_trim``) and the kernel's peak counter reset (``/proc/self/clear_refs``) first."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status_kib("VmRSS")
    with torch.no_grad():
        run()
    return _status_kib("VmHWM") - before


def _status_kib(field: str) -> int:
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1])


def plot(report: dict, path: Path) -> None:
    plt = _gpu.pyplot(path)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    rows, policies = report["prefill"], report["settings"]["policies"]
    width = 0.8 / len(policies)
    for i, policy in enumerate(policies):
        xs = [j + i * width for j in range(len(rows))]
        ax.bar(xs, [r["hf_over_link"][policy] for r in rows], width, label=policy)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))], [f"{r['context_tokens'] // 1024}K" for r in rows])
    ax.set_ylabel("transformers prefill / link time")
    ax.set_yscale("log")
    ax.set_title("CPU, 1 thread: link speed-up over a full prefill (random Llama)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def decode_rates(engine: pic.PIC, fast: pic.PIC, model, ids: list[str], docs: list[list[int]], args) -> dict:
    """Decode tokens/s at the last decode context: transformers at batch 1, pic (model and int8 decode weights) at
    batch 1 and each of ``args.batches``, after mepic links of one request; interleaved rounds, medians."""
    context = args.decode_contexts[-1]
    chunks = list(range(context // args.chunk_tokens))
    rng = random.Random(args.seed + 1)
    query = [rng.randrange(3, args.vocab) for _ in range(args.query_tokens)]
    prompt = prompt_ids(docs, chunks, query, engine.bos_token_id)
    fast.compile([docs[c] for c in chunks], progress=False)
    fns = {HF: hf_rate(model, prompt, args.new_tokens)}
    for batch in (1, *args.batches):
        for name, e in (("pic", engine), ("pic int8", fast)):
            link = lambda e=e: e.link([ids[c] for c in chunks], query, policy="mepic")  # noqa: E731
            fns[f"{name} x{batch}"] = pic_rate(link, batch, args.new_tokens)
    _gpu.interleaved(fns, rounds=1)  # warm-up
    med = _gpu.medians(raw := _gpu.interleaved(fns, rounds=args.decode_repeats))
    return {"prompt_tokens": len(prompt), "policy": "mepic", "tokens_per_s": med, "rounds": raw,
            "over_hf": {name: rate / med[HF] for name, rate in med.items()}}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--decode-contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--policies", nargs="+", default=list(POLICIES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-repeats", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batches", type=int, nargs="*", default=[8, 16], help="pic's decode batches beside batch 1")
    parser.add_argument("--memory-context", type=int, default=8192, help="peak RSS at this context (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a tiny Llama, short contexts, one round: a smoke run")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    shape = QUICK_SHAPE if args.quick else SHAPE
    if args.quick:
        args.contexts, args.decode_contexts, args.repeats, args.decode_repeats, args.new_tokens = (
            [128, 256],
            [128],
            1,
            1,
            4,
        )
        args.memory_context, args.batches = 256, [2]
    args.chunk_tokens, args.query_tokens, args.vocab = (64 if args.quick else 512), 32, shape["vocab_size"]
    args.device, args.decode_policy = torch.device("cpu"), "full"
    model = random_llama(shape, max_positions=max(args.contexts) + 256)
    config = pic.PICConfig(kv_pool_tokens=3 * max(args.contexts) + 4096, attention_backend="torch")
    engine = pic.PIC(model, _gpu.embedded_tokenizer(), config=config)
    rng = random.Random(args.seed)
    docs = [[rng.randrange(3, args.vocab) for _ in range(args.chunk_tokens - 1)]
            for _ in range(max(args.contexts) // args.chunk_tokens)]  # fmt: skip
    ids = engine.compile(docs, progress=False)
    environment = _gpu.environment(args.device) | {"torch_threads": 1, "note": "CPU benchmark, one torch thread"}
    report = {"command": _gpu.command(), "environment": environment,
              "settings": {"shape": shape, "chunk_tokens": args.chunk_tokens, "query_tokens": args.query_tokens,
                           "policies": args.policies, "repeats": args.repeats}}  # fmt: skip
    report["prefill"] = []
    for context in args.contexts:
        row = prefill_row(engine, model, ids, docs, context, args)
        print(f"{context:>6}: full/hf {row['full_over_hf']:.2f}x; hf/link "
              + ", ".join(f"{p} {r:.1f}x" for p, r in row["hf_over_link"].items()), flush=True)  # fmt: skip
        report["prefill"].append(row)
    first, last = report["prefill"][0], report["prefill"][-1]
    report["link_growth"] = {p: last["median_s"][p] / first["median_s"][p] for p in ["full", *args.policies]} | {
        "tokens": last["prompt_tokens"] / first["prompt_tokens"],
        HF: last["median_s"][HF] / first["median_s"][HF],
    }
    report["decode"] = []
    for context in args.decode_contexts:
        args.decode_context = context
        row = decode(engine, model, ids, docs, 1, args)
        print(f"{context:>6}: decode pic/hf {row['pic_over_hf_decode_tokens_per_s']:.2f}x", flush=True)
        report["decode"].append(row)
    int8 = pic.PICConfig(**config.model_dump(exclude={"decode_weights"}), decode_weights="int8")
    fast = pic.PIC(model, engine.tokenizer, config=int8)
    report["decode_rates"] = decode_rates(engine, fast, model, ids, docs, args)
    rates = report["decode_rates"]
    shown = [f"{n} {r:.1f} ({rates['over_hf'][n]:.2f}x hf)" for n, r in rates["tokens_per_s"].items()]
    print(f"{rates['prompt_tokens']:>6}: decode tok/s " + ", ".join(shown), flush=True)
    if args.memory_context and sys.platform == "linux":
        report["memory"] = memory_row(engine, model, ids, docs, args.memory_context, args)
        print(f"{args.memory_context:>6}: peak RSS above the start, KiB: {report['memory']['peak_kib']}", flush=True)
    _gpu.write_json(args.out / "cpu.json", report)
    plot(report, args.out / "cpu.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
