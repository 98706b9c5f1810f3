"""TTFT and decode speed on a Mistral-7B-shaped model: ``link`` (mepic, legolink:16, naive) against full prefills.

python benchmarks/ttft.py                              # GPU: writes benchmarks/results/ttft.json and ttft.png
python benchmarks/ttft.py --quick --out /tmp/ttft      # CPU smoke run: a tiny Mistral, torch backend, float32

The model is a ``MistralForCausalLM`` of Mistral-7B's shapes (hidden 4096, 32 layers, 32 query / 8 KV heads of 128,
MLP 14336, vocab 32000, no sliding window) with random bfloat16 weights (transformers' init, seeded): no download;
speed does not depend on the weights. Documents are random token ids, chunks of 512 tokens, compiled once (not
timed; each gets its BOS: 513 tokens). A context of C tokens links the first C / 512 chunks, then a random 32-token
query. One PIC (its default backend: the Triton kernel on CUDA) with a KV pool sized for every request here.

TTFT, per context (4K ... 32K), variants in turn, --repeats rounds, medians (an untimed warm-up round at each context):
``full``, ``auto`` (pic's default: the chunks in relevance order, the most relevant recomputed whole; its prompt is
the same tokens in another order), ``mepic``, ``legolink:16``, ``naive`` (the query alone recomputed: the floor of a
link, what attention over the context costs without recompute); on CUDA with the Triton backend, ``auto``, ``mepic``
and ``naive`` again with CUDA graphs for the forwards of few rows (``"<policy> graphs"``, ``pic.model.graphs``):
``engine.link(ids, query, policy=p).generate(max_new_tokens=1)``; TTFT is
``Generation.ttft_s`` (link wall time + the first token), link time ``Linked.link_s``. ``hf``: transformers' own
forward (SDPA) over the same prompt token ids, last-token logits, argmax on the host. Reported: hf / link (the
headline) and full / link per policy, and link time per 1K prompt tokens with a linear fit (is link time linear
in context?).
Decode (--decode-context tokens, --new-tokens greedy tokens, no EOS), pic and transformers in turn, --decode-repeats
rounds after a warm-up round: batch 1, ``link(...).generate()`` against ``model.generate()`` (SDPA) on the same
prompt; batch --decode-batch, ``PIC.generate_many`` of that many requests (chunk sets in rotation, own queries, all
prompts the same length, admitted in one step) against ``model.generate()`` on the batch (no padding needed).
Decode tokens/s = batch x (new - 1) / (last token - first token): the first token is the prefill's. pic links
with --decode-policy (``full``: its tokens can be compared with transformers'; the count that agree is recorded);
on CUDA with Triton, each batch again with CUDA graphs (``"<batch> graphs"``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

import pic

sys.path.insert(0, str(Path(__file__).parent))
import _gpu  # noqa: E402
from _decode import HF, decode, prompt_ids  # noqa: E402

POLICIES = ("full", "auto", "mepic", "legolink:16", "naive")
# Policies timed again with CUDA graphs for the forwards of few rows (``PICConfig.cuda_graphs``; CUDA, Triton only):
# mepic's too, as the hf / mepic goal is read with graphs on now that they are the default on CUDA.
GRAPHED = ("auto", "mepic", "naive")


def pic_ttft(engine: pic.PIC, ids: list[str], query: list[int], policy: str, prompt: list[int]) -> dict:
    """``link`` and the first token under ``policy``; checks that the linked prompt is ``prompt`` (what HF runs)."""
    linked = engine.link(ids, query, policy=policy)
    gen = linked.generate(max_new_tokens=1)
    got = linked.input_ids.tolist()
    if policy == "auto":  # the relevance order: the same chunks in another order, as many tokens as transformers runs
        assert sorted(got) == sorted(prompt), "the linked prompt does not hold the tokens transformers runs"
    else:
        assert got == prompt, "the linked prompt is not the one transformers runs"
    return {"ttft_s": gen.ttft_s, "link_s": linked.link_s, "recomputed": linked.num_recomputed, "token": gen.token_ids}


def hf_ttft(model: torch.nn.Module, prompt: torch.Tensor) -> dict:
    """transformers' forward over the whole prompt ``[1, T]`` (no cache kept) and its first token."""

    def forward() -> list[int]:
        with torch.no_grad():  # [1, 1, vocab]: the last position's logits only
            logits = model(prompt, use_cache=False, logits_to_keep=1).logits
        return [int(logits[0, -1].argmax())]

    seconds, token = _gpu.wall(forward, prompt.device)
    return {"ttft_s": seconds, "token": token}


def graphs_on(engine: pic.PIC, graphed) -> None:
    """Serve the engine's forwards of few rows from ``graphed`` (its ``GraphedForwards``), or eagerly (``None``)."""
    with engine.paused() as core:
        core.runner.graphed = graphed


def with_graphs(engine: pic.PIC, graphed, run):
    graphs_on(engine, graphed)
    try:
        return run()
    finally:
        graphs_on(engine, None)


def ttft_context(engine, model, ids, docs, context: int, args, *, rounds: int, graphed=None) -> dict:
    """Every variant at one context, in turn, ``rounds`` times; with ``graphed``, ``GRAPHED``'s policies again
    through CUDA graphs (``"<policy> graphs"``)."""
    rng = random.Random(args.seed + context)
    query = [rng.randrange(3, args.vocab) for _ in range(args.query_tokens)]
    chunks = list(range(context // args.chunk_tokens))
    prompt = prompt_ids(docs, chunks, query, engine.bos_token_id)
    tensor = torch.tensor([prompt], device=args.device)  # [1, T]
    runs = {HF: lambda: hf_ttft(model, tensor)}
    runs |= {p: lambda p=p: pic_ttft(engine, [ids[c] for c in chunks], query, p, prompt) for p in POLICIES}
    if graphed is not None:
        runs |= {f"{p} graphs": lambda p=p: with_graphs(engine, graphed, runs[p]) for p in GRAPHED}
    raw = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            raw[name].append(run())
    ttft = {name: statistics.median(r["ttft_s"] for r in rows) for name, rows in raw.items()}
    return {
        "context_tokens": context,
        "chunks": len(chunks),
        "prompt_tokens": len(prompt),
        "ttft_s": ttft,
        "ttft_s_rounds": {name: [r["ttft_s"] for r in rows] for name, rows in raw.items()},
        "link_s": {p: statistics.median(r["link_s"] for r in raw[p]) for p in POLICIES},
        "recomputed_tokens": {p: raw[p][0]["recomputed"] for p in POLICIES},
        "full_over_link": {p: ttft["full"] / ttft[p] for p in POLICIES[1:]},
        "hf_over_link": {p: ttft[HF] / ttft[p] for p in POLICIES},
        "full_first_token_equals_hf": all(r["token"] == raw[HF][0]["token"] for r in raw["full"]),
        "graphs": {
            p: {
                "ttft_s": ttft[f"{p} graphs"],
                "eager_over_graphs": ttft[p] / ttft[f"{p} graphs"],
                "hf_over_link": ttft[HF] / ttft[f"{p} graphs"],
            }
            for p in GRAPHED
            if f"{p} graphs" in ttft
        },
    }


def link_scaling(rows: list[dict]) -> dict:
    """Per policy: link ms per 1K prompt tokens at each context, and a least-squares line through link time."""
    out = {}
    for p in POLICIES:
        x, y = [r["prompt_tokens"] / 1000 for r in rows], [1000 * r["link_s"][p] for r in rows]
        fit = statistics.linear_regression(x, y) if len(rows) > 1 else None
        out[p] = {"ms_per_1k_tokens": [b / a for a, b in zip(x, y, strict=True)]}
        if fit is not None:
            r2 = statistics.correlation(x, y) ** 2 if len(set(y)) > 1 else 1.0
            out[p] |= {"fit_intercept_ms": fit.intercept, "fit_ms_per_1k_tokens": fit.slope, "fit_r2": r2}
    return out


def pool_tokens(args: argparse.Namespace) -> int:
    """Every chunk resident, beside the largest request (``full`` copies all its chunk blocks) or the decode batch."""
    bs, chunk_blocks = args.block_size, -(-(args.chunk_tokens + 1) // args.block_size)  # + BOS
    tail = -(-(args.query_tokens + args.new_tokens) // bs) + 1
    num_docs = max(args.contexts) // args.chunk_tokens
    batch = args.decode_batch * (args.decode_context // args.chunk_tokens * chunk_blocks + tail)
    return (num_docs * chunk_blocks + max(num_docs * chunk_blocks + tail, batch)) * bs


def plot(rows: list[dict], scaling: dict, title: str, path: Path) -> None:
    """TTFT against context per variant (log-log), and link time against prompt tokens with its linear fit."""
    plt = _gpu.pyplot(path)
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5), dpi=110)
    contexts = [r["context_tokens"] for r in rows]
    for name in (HF, *POLICIES):
        left.plot(contexts, [r["ttft_s"][name] for r in rows], marker="o", label=name)
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xticks(contexts, [f"{c // 1024}K" if c % 1024 == 0 else str(c) for c in contexts])
    left.set(xlabel="context (tokens of chunks)", ylabel="TTFT (s)", title="time to first token")
    tokens = [r["prompt_tokens"] for r in rows]
    for p in POLICIES[1:]:
        right.plot(tokens, [1000 * r["link_s"][p] for r in rows], marker="o", label=p)
        fit = scaling[p]
        if "fit_ms_per_1k_tokens" in fit:
            line = [fit["fit_intercept_ms"] + fit["fit_ms_per_1k_tokens"] * t / 1000 for t in tokens]
            right.plot(tokens, line, "k:", lw=1)
    right.set(xlabel="prompt tokens", ylabel="link time (ms)", title="link time (dotted: least-squares line)")
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--query-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="TTFT rounds (after one warm-up round)")
    parser.add_argument("--decode-context", type=int, default=4096, help="tokens of chunks per decode request")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--decode-batch", type=int, default=16, help="requests of the batched decode (0: none)")
    parser.add_argument("--decode-repeats", type=int, default=2, help="decode rounds (after one warm-up round)")
    parser.add_argument("--decode-policy", default="full")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="CPU: tiny Mistral, chunks of 32, torch backend")
    parser.add_argument("--out", default="benchmarks/results", help="folder for ttft.json and ttft.png")
    args = parser.parse_args()
    if not args.quick and not torch.cuda.is_available():
        parser.error("this benchmark needs a CUDA GPU (--quick runs a smoke test on the CPU)")
    args.shape, args.device, args.dtype, args.backend = _gpu.MISTRAL_7B, torch.device("cuda"), torch.bfloat16, "auto"
    if args.quick:
        args.contexts, args.chunk_tokens, args.query_tokens, args.new_tokens = [64, 96, 128], 32, 8, 8
        args.decode_context, args.decode_batch, args.repeats, args.decode_repeats = 64, 4, 1, 1
        args.shape, args.dtype, args.backend = _gpu.TINY_MISTRAL, torch.float32, "torch"
        args.device = torch.device("cpu")
    assert args.decode_context <= max(args.contexts), "decode requests link chunks of the largest context"
    return args


def table(rows: list[dict]) -> str:
    """Markdown: TTFT per variant and context, hf / link (the headline: transformers' SDPA prefill is the bar, not
    pic's own full prefill) and full / link."""
    links = POLICIES[1:]
    head = ["context", *(f"{v} TTFT" for v in (HF, *POLICIES)), *(f"hf / {p}" for p in links)]
    head += [f"full / {p}" for p in links]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in rows:
        cells = [f"{1000 * r['ttft_s'][v]:.1f} ms" for v in (HF, *POLICIES)]
        cells += [f"{r['hf_over_link'][p]:.2f}x" for p in links] + [f"{r['full_over_link'][p]:.2f}x" for p in links]
        lines.append(f"| {r['context_tokens']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def build(args: argparse.Namespace) -> tuple[torch.nn.Module, pic.PIC, list[list[int]], list[str]]:
    """The model, one PIC over it, the documents (token ids) and their cache ids (compiled here, not timed)."""
    num_docs, per_chunk = max(args.contexts) // args.chunk_tokens, args.chunk_tokens + 1
    longest = num_docs * per_chunk + args.query_tokens + args.new_tokens
    positions = max(longest, 32768 if args.device.type == "cuda" else 0)  # Mistral-7B's 32K context
    model = _gpu.random_mistral(args.shape, max_positions=positions, device=args.device, dtype=args.dtype)
    args.vocab = model.config.vocab_size
    rng = random.Random(args.seed)
    docs = [[rng.randrange(3, args.vocab) for _ in range(args.chunk_tokens)] for _ in range(num_docs)]
    budget = max(8192, args.decode_batch * (args.decode_context // args.chunk_tokens * per_chunk + args.query_tokens))
    config = pic.PICConfig(
        kv_pool_tokens=pool_tokens(args),
        block_size=args.block_size,
        eos_token_ids=(),
        max_num_batched_tokens=budget,  # every decode request's link pass in one step: they decode together
        attention_backend=args.backend,
        cuda_graphs=False,  # eager unless a variant turns them on (graphs_on): both are timed
    )
    engine = pic.PIC(model, _gpu.embedded_tokenizer(), config=config)
    return model, engine, docs, engine.compile(docs, progress=False)


def main() -> None:
    args = parse_args()
    start = time.perf_counter()
    model, engine, docs, ids = build(args)
    backend = engine.attention_backend
    print(f"model and {len(docs)} chunks ready in {time.perf_counter() - start:.0f} s, {backend} attention")
    rows, decodes, errors = [], {}, []
    graphed = None
    if args.device.type == "cuda" and backend == "triton":  # captured per bucket in the warm-up rounds
        with engine.paused() as core:
            graphed = core.runner.use_graphs(capture=True)
            core.runner.graphed = None
    for context in args.contexts:  # a failure (out of memory, say) is recorded; the other results still get written
        try:  # a warm-up round at each context: kernels specialize and tune per shape, allocators grow per size
            ttft_context(engine, model, ids, docs, context, args, rounds=1, graphed=graphed)
            rows.append(ttft_context(engine, model, ids, docs, context, args, rounds=args.repeats, graphed=graphed))
        except Exception as exc:  # noqa: BLE001
            errors.append(f"TTFT at {context}: {type(exc).__name__}: {exc}")
            print(errors[-1])
    print(table(rows))
    for batch in [1, args.decode_batch] if args.decode_batch else [1]:
        try:
            result = decodes[str(batch)] = decode(engine, model, ids, docs, batch, args)
            rates = [f"{n} {result[n]['decode_tokens_per_s']:.1f} tokens/s" for n in ("pic", HF)]
            print(f"decode batch {batch}: " + ", ".join(rates))
            if graphed is not None:
                eager_hf = result[HF]["decode_tokens_per_s"]  # graphs change pic alone: one transformers baseline
                result = decodes[f"{batch} graphs"] = with_graphs(
                    engine, graphed, lambda b=batch: decode(engine, model, ids, docs, b, args, hf=False)
                )
                result["pic_over_hf_decode_tokens_per_s"] = result["pic"]["decode_tokens_per_s"] / eager_hf
                print(f"decode batch {batch}, graphs: pic {result['pic']['decode_tokens_per_s']:.1f} tokens/s")
        except Exception as exc:  # noqa: BLE001
            errors.append(f"decode batch {batch}: {type(exc).__name__}: {exc}")
            print(errors[-1])
    if graphed is not None:
        print(f"graphs: {graphed.num_replays} forwards replayed, {graphed.num_eager} eager (plan differed)")
    report = make_report(args, rows, decodes, errors, engine) | {"wall_s": time.perf_counter() - start}
    if graphed is not None:
        report["graphs"] = {"replayed": graphed.num_replays, "eager": graphed.num_eager}
    out = Path(args.out)
    _gpu.write_json(out / "ttft.json", report)
    model_name = f"{args.shape['num_hidden_layers']}-layer Mistral, random {report['model']['dtype']} weights"
    device = report["environment"]["gpu"] or "CPU (timings meaningless)"
    plot(rows, report["link_scaling"], f"{model_name}: {device}", out / "ttft.png")
    if errors:
        sys.exit("; ".join(errors))


def make_report(args, rows: list[dict], decodes: dict, errors: list[str], engine: pic.PIC) -> dict:
    """The JSON: machine, exact command, model, workload, TTFT rows, link scaling, decode results."""
    names = ("contexts", "chunk_tokens", "query_tokens", "repeats", "decode_context", "new_tokens", "decode_batch")
    workload = {k: getattr(args, k) for k in (*names, "decode_repeats", "decode_policy", "block_size", "seed")}
    return {
        "environment": _gpu.environment(args.device),
        "command": _gpu.command(),
        "model": {"family": "MistralForCausalLM, random weights", "dtype": str(args.dtype).removeprefix("torch.")}
        | args.shape,
        "attention_backend": engine.attention_backend,
        "workload": workload | {"pool_tokens": pool_tokens(args)},
        "ttft": rows,
        "link_scaling": link_scaling(rows),
        "decode": decodes,
        "errors": errors,
    }


if __name__ == "__main__":
    main()
