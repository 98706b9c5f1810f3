"""SmolLM2-135M-Instruct on a RAG prompt, CPU, one thread: time to first token of ``link_chat`` under mepic,
legolink:16 and cacheblend:0.15 against transformers' prefill and llama.cpp's of the same prompt, decode tokens/s of
all three, and how far each policy's answer agrees with Full Recompute's.

python benchmarks/cpu_rag.py                        # writes benchmarks/results/cpu_rag.json and cpu_rag.png
python benchmarks/cpu_rag.py --quick --out /tmp/r   # a smoke run: 4 short documents, one round

The documents are passages of this repository's docs/ (real English, fixed order): consecutive paragraphs joined
until a passage has at least ``--chunk-tokens`` tokens, each ending in one newline (docs/chat.md, "Separators"), so
Full Recompute over ``link_chat`` is the plain chat prompt, token for token. The question asks about one of them; the
documents go where the user message says ``{documents}``. Compiling them is not timed.

Time to first token, in each round (after one warm-up round), in turn: ``hf``, transformers' forward over the prompt
(float32, SDPA, ``logits_to_keep=1``, then the argmax); ``llama.cpp``, ``llama-cpp-python`` evaluating the same token
ids from an empty cache on the GGUF the package ships (its weights as stored: Q4_1), then the argmax; and for
``full`` and each policy, ``engine.link_chat(ids, messages, policy=p).generate(max_new_tokens=1)``. Medians.
Decode (``_decode_rates``): greedy, ``--new-tokens`` tokens, tokens/s after the first, in interleaved rounds:
transformers' forward per token over its prompt cache, llama.cpp one ``eval`` per token from its prompt's state, pic
after a mepic link with the model's float32 weights and with int8 decode weights (``decode_weights="int8"``), at
batch 1 and, for pic, at each of ``--batches`` copies of the request decoding together. The answers (each policy's
greedy reply beside Full Recompute's, and Full Recompute's with int8 decode weights) come from one more run. Every
engine runs on one thread (torch and llama.cpp's ``n_threads`` and ``n_threads_batch``).

llama.cpp is optional: ``pip install llama-cpp-python`` (it compiles llama.cpp from source, ~10 minutes on 2 cores;
docs/cpu.md). Without it its columns are left out, with a message.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import pic

sys.path.insert(0, str(Path(__file__).parent))
import _gpu  # noqa: E402
from _decode import HF, agreeing, hf_generate  # noqa: E402
from _decode_rates import hf_rate, llama_rate, pic_rate  # noqa: E402

LLAMA_CPP = "llama.cpp"
INT8 = "int8"  # pic with int8 decode weights
POLICIES = ("mepic", "legolink:16", "cacheblend:0.15")
DOCS = ("policies.md", "store.md", "engine.md", "serve.md", "chat.md", "install.md", "api.md", "internals.md")
QUESTION = "Which tokens does the mepic policy recompute, and why?"
_INSTALL = "pip install llama-cpp-python (compiles llama.cpp from source, ~10 minutes on 2 cores)"


def passages(tokenizer, *, num: int, min_tokens: int, max_tokens: int) -> list[str]:
    """``num`` passages of docs/, each of consecutive paragraphs with ``min_tokens`` to ``max_tokens`` tokens,
    ending in one newline; fenced code and tables are skipped."""
    folder, out, current = Path(__file__).parents[1] / "docs", [], []
    for name in DOCS:
        for paragraph in (folder / name).read_text().split("\n\n"):
            paragraph = paragraph.strip()
            if not paragraph or paragraph.startswith(("```", "|", "#")):
                continue
            text = "\n\n".join([*current, paragraph]) + "\n"
            size = len(tokenizer(text, add_special_tokens=False)["input_ids"])
            if size > max_tokens:
                current = [paragraph] if current else []
                continue
            current.append(paragraph)
            if size >= min_tokens:
                out.append(text)
                current = []
                if len(out) == num:
                    return out
    raise SystemExit(f"docs/ holds fewer than {num} passages of {min_tokens}-{max_tokens} tokens")


def messages() -> list[dict]:
    return [
        {"role": "system", "content": "Answer the question using the documents."},
        {"role": "user", "content": f"{{documents}}Question: {QUESTION}"},
    ]


def llama_cpp(path: Path, n_ctx: int):
    """A ``llama_cpp.Llama`` on the GGUF, one thread, or ``None`` (with a message) when it is not installed."""
    try:
        from llama_cpp import Llama
    except ImportError:
        print(f"llama.cpp skipped: llama-cpp-python is not installed ({_INSTALL})", flush=True)
        return None
    return Llama(str(path), n_ctx=n_ctx, n_threads=1, n_threads_batch=1, n_batch=512, verbose=False)


def llama_first(llm, prompt: list[int]) -> int:
    """Evaluate ``prompt`` from an empty cache; the greedy next token."""
    llm.reset()  # n_tokens = 0: eval drops the whole cache, no prefix is reused
    llm.eval(prompt)
    return llama_greedy(llm)


def llama_greedy(llm) -> int:
    """The argmax of the last token's logits (``eval`` keeps only those without ``logits_all``)."""
    import numpy as np

    return int(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).argmax())


def llama_decode(llm, prompt: list[int], new_tokens: int) -> dict:
    """Greedy decode after the prompt: its tokens and the time from the first token to the last."""
    tokens = [llama_first(llm, prompt)]
    start = time.perf_counter()
    while len(tokens) < new_tokens:
        llm.eval(tokens[-1:])
        tokens.append(llama_greedy(llm))
    return {"tokens": tokens, "decode_s": time.perf_counter() - start}


def ttft(engine: pic.PIC, llm, ids: list[str], prompt: list[int], args) -> dict:
    """Every variant timed in interleaved rounds; medians, ratios, recomputed tokens, first tokens."""
    first, recomputed = {}, {}

    def hf() -> float:
        start = time.perf_counter()
        with torch.no_grad():
            logits = engine.model(torch.tensor([prompt]), use_cache=False, logits_to_keep=1).logits
        first[HF] = int(logits[0, -1].argmax())
        return time.perf_counter() - start

    def llama() -> float:
        start = time.perf_counter()
        first[LLAMA_CPP] = llama_first(llm, prompt)
        return time.perf_counter() - start

    def link(policy: str):
        def run() -> float:
            start = time.perf_counter()
            linked = engine.link_chat(ids, messages(), policy=policy)
            first[policy] = linked.generate(max_new_tokens=1).token_ids[0]
            recomputed[policy] = linked.num_recomputed
            return time.perf_counter() - start

        return run

    fns = {HF: hf} | ({LLAMA_CPP: llama} if llm is not None else {}) | {p: link(p) for p in ("full", *args.policies)}
    _gpu.interleaved(fns, rounds=1)  # warm-up
    raw = _gpu.interleaved(fns, rounds=args.repeats)
    med = _gpu.medians(raw)
    baselines = [b for b in (HF, LLAMA_CPP) if b in med]
    return {
        "median_s": med,
        "rounds_s": raw,
        "speedup": {b: {p: med[b] / med[p] for p in ("full", *args.policies)} for b in baselines},
        "recomputed_tokens": recomputed,
        "first_token": first,
    }


def answers(engine: pic.PIC, fast: pic.PIC, llm, ids: list[str], prompt: list[int], args) -> dict:
    """Each policy's greedy answer beside Full Recompute's (and transformers', llama.cpp's, and Full Recompute's with
    int8 decode weights)."""
    gens = {p: engine.link_chat(ids, messages(), policy=p).generate(max_new_tokens=args.new_tokens)
            for p in ("full", *args.policies)}  # fmt: skip
    gens[f"full, {INT8}"] = fast.link_chat(ids, messages(), policy="full").generate(max_new_tokens=args.new_tokens)
    hf = hf_generate(engine.model, [prompt], argparse.Namespace(device=torch.device("cpu"), new_tokens=args.new_tokens))
    full = gens["full"].token_ids
    texts = {p: (g.text, g.token_ids) for p, g in gens.items()}
    texts[HF] = (engine.tokenizer.decode(hf["tokens"][0], skip_special_tokens=True), hf["tokens"][0])
    if llm is not None:
        tokens = llama_decode(llm, prompt, args.new_tokens)["tokens"]
        texts[LLAMA_CPP] = (engine.tokenizer.decode(tokens, skip_special_tokens=True), tokens)
    return {name: {"text": text, "tokens_agreeing_with_full": agreeing(tokens, full)}
            for name, (text, tokens) in texts.items()}  # fmt: skip


def decode(engine: pic.PIC, fast: pic.PIC, llm, ids: list[str], prompt: list[int], args) -> dict:
    """Decode tokens/s in interleaved rounds: transformers, llama.cpp, pic (float32 and int8 decode weights) at
    batch 1, and pic at each of ``args.batches``; medians and ratios."""
    fns = {HF: hf_rate(engine.model, prompt, args.new_tokens)}
    if llm is not None:
        fns[LLAMA_CPP] = llama_rate(llm, prompt, args.new_tokens, llama_greedy)
    for batch in (1, *args.batches):
        for name, e in (("pic", engine), (f"pic {INT8}", fast)):
            link = lambda e=e: e.link_chat(ids, messages(), policy="mepic")  # noqa: E731
            fns[f"{name} x{batch}"] = pic_rate(link, batch, args.new_tokens)
    raw = _gpu.interleaved(fns, rounds=args.repeats)
    med = _gpu.medians(raw)
    baselines = [b for b in (HF, LLAMA_CPP) if b in med]
    return {"policy": "mepic", "batches": [1, *args.batches], "tokens_per_s": med, "rounds": raw,
            "ratio": {b: {name: rate / med[b] for name, rate in med.items()} for b in baselines}}  # fmt: skip


def plot(report: dict, path: Path) -> None:
    plt = _gpu.pyplot(path)
    if plt is None:
        return
    med = report["ttft"]["median_s"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh(list(med), list(med.values()), color=["gray" if n in (HF, LLAMA_CPP, "full") else "C0" for n in med])
    ax.set_xscale("log")
    ax.set_xlabel("time to first token, s (log)")
    ax.set_title(f"SmolLM2-135M, {report['prompt_tokens']}-token RAG prompt, CPU, 1 thread")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--chunk-tokens", type=int, default=256, help="each passage has 256 to 2x this many tokens")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batches", type=int, nargs="*", default=[8, 16], help="pic's decode batches beside batch 1")
    parser.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp out even when installed")
    parser.add_argument("--quick", action="store_true", help="4 short passages, one round: a smoke run")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.quick:
        args.chunks, args.chunk_tokens, args.repeats, args.new_tokens, args.batches = 4, 48, 1, 4, [2]
    configs = {
        w: pic.PICConfig(attention_backend="torch", kv_pool_tokens=32768, decode_weights=w) for w in ("model", INT8)
    }
    engine = pic.load("smollm2", config=configs["model"], progress=False)
    build_s = {}  # an engine over the loaded model: what int8 decode weights add to start-up (packing them)
    for name, config in configs.items():
        start = time.perf_counter()
        built = pic.PIC(engine.model, engine.tokenizer, config=config)
        build_s[name] = time.perf_counter() - start
    fast = built
    with fast.paused() as core:  # that the int8 copies were made (a str mode once slipped past validation)
        int8_bytes = core.runner._decode.num_bytes
    docs = passages(engine.tokenizer, num=args.chunks, min_tokens=args.chunk_tokens, max_tokens=2 * args.chunk_tokens)
    ids = engine.compile(docs, progress=False)
    assert fast.compile(docs, progress=False) == ids  # int8 decode weights compile the same KV
    probe = engine.link_chat(ids, messages(), policy="full")
    prompt = probe.input_ids.tolist()
    probe.generate(max_new_tokens=1)  # releases its blocks
    from pic.model.gguf import smollm2_path

    llm = None if args.no_llama_cpp else llama_cpp(smollm2_path(), len(prompt) + args.new_tokens + 16)
    environment = _gpu.environment(torch.device("cpu")) | {"torch_threads": 1, "llama_cpp_threads": 1,
                                                           "llama_cpp": _gpu._version("llama-cpp-python")}  # fmt: skip
    report = {"command": _gpu.command(), "environment": environment, "model": "SmolLM2-135M-Instruct",
              "weights": {"pic and transformers": "float32 (the GGUF dequantized)", LLAMA_CPP: "Q4_1 (the GGUF)",
                          f"pic {INT8}": "int8 copies of the large matrices in decode steps (pic.model.products)"},
              "settings": {"chunks": args.chunks, "chunk_tokens": [len(engine.tokenizer(d)["input_ids"]) for d in docs],
                           "question": QUESTION, "policies": args.policies, "repeats": args.repeats,
                           "new_tokens": args.new_tokens, "batches": args.batches},
              "prompt_tokens": len(prompt), "engine_build_s": build_s,
              "int8_weight_bytes": int8_bytes}  # fmt: skip
    report["ttft"] = ttft(engine, llm, ids, prompt, args)
    report["answers"] = answers(engine, fast, llm, ids, prompt, args)
    for name, s in report["ttft"]["median_s"].items():
        speedups = ", ".join(f"{b}/{name} {r[name]:.1f}x" for b, r in report["ttft"]["speedup"].items() if name in r)
        agree = report["answers"][name]["tokens_agreeing_with_full"]
        print(f"{name:>16}: TTFT {s:.3f} s  {speedups}  agrees with full for {agree} tokens", flush=True)
    report["decode"] = decode(engine, fast, llm, ids, prompt, args)
    for name, rate in report["decode"]["tokens_per_s"].items():
        ratios = ", ".join(f"/{b} {r[name]:.2f}x" for b, r in report["decode"]["ratio"].items())
        print(f"{name:>16}: decode {rate:.1f} tok/s  {ratios}", flush=True)
    _gpu.write_json(args.out / "cpu_rag.json", report)
    plot(report, args.out / "cpu_rag.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
