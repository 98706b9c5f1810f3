"""Attention kernel time: pic's Triton fused-RoPE paged kernel against SDPA's flash backend over pre-rotated K.

python benchmarks/attention.py                                      # GPU: benchmarks/results/attention.json + .png
python benchmarks/attention.py --quick --out /tmp/attention.json    # CPU smoke run, in Triton's interpreter

Mistral-7B's attention shapes (32 query heads, 8 KV heads, head_dim 128), bfloat16, pages of 16 slots. Per context
(4K, 8K, 16K, 32K): a prefill of the last 512 positions (one sequence, causal by position) and decodes of 1, 4, 16
and 64 sequences (one query token each, at the last position; every sequence has its own KV of that length). Beside
them, link-sized passes over --link-context (16K) keys: the last 32 and 544 positions (a link's query alone, and a
32-chunk MEPIC link's chunk heads and query), where pic splits each query tile's keys across programs when its
programs would leave the GPU idle (``pic``), also timed with the splits forced (--link-splits: ``pic_splits_1`` is
no split) to show what the plan's choice is worth. pic
reads NoPE K and V from the paged cache by block table (blocks shuffled over the pool) and rotates Q and K inside
the kernel. The baseline is ``F.scaled_dot_product_attention`` under ``sdpa_kernel(SDPBackend.FLASH_ATTENTION)`` over
the same K already rotated and laid out contiguous per sequence, ``[B, Hkv, L, D]`` (GQA by ``enable_gqa``; the
prefill's mask is ``causal_lower_right``): what attention costs when K needs no rotation and no block table. The
torch reference backend is timed where its gathered temporaries stay small (batch x context <= --ref-max-slots),
and pic's kernel once more over a cache holding K already rotated (``pic_k_prerotated``): paging alone, so that
``pic / pic_k_prerotated`` is what rotating K costs pic. A recompute pass of 4 query tiles or more per sequence (the
512-row prefill, the 544-row link pass) reads its K rotated once per layer by ``rotate_k_kernel`` (``pic`` includes
that launch; ``pic_rotated_once`` in each row says whether the plan chose it); for those cases the kernel is also
timed rotating K inside its KV loop for every query tile (``pic_k_in_loop``, the kernel of docs/gpu.md's runs) and
the rotation launch alone (``pic_rotate_k_only``), so ``pic_k_in_loop / pic`` is what rotating once saves.
Each case's alternatives are timed in turn, round after round (--rounds), each time by ``triton.testing.do_bench``
(GPU time between CUDA events, L2 flushed before every call, median of its calls; a call's host work overlaps the
flush); the medians over the rounds and pic / SDPA are reported, with TFLOP/s and KV bytes read per second. Beside
them, back to back: --back-to-back calls in a row between two events, no flush (warm caches, each launch queued
behind the last: what a layer loop sees), per call, and pic / SDPA on that figure.
Every case also checks each output against attention computed in float64 from the same bfloat16 inputs
(relative error ||out - exact|| / ||exact||; pic's target is <= 1e-2); the script fails after writing its JSON if
pic misses it. --quick: the CPU, tiny shapes in float16 (the interpreter mishandles bfloat16 loads), 1 round.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

if "--quick" in sys.argv or not torch.cuda.is_available():  # the kernel runs in Triton's interpreter off CUDA,
    os.environ.setdefault("TRITON_INTERPRET", "1")  # chosen when Triton is first imported (transformers imports it)

import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.nn.attention.bias import causal_lower_right  # noqa: E402
from transformers import MistralConfig  # noqa: E402
from transformers.models.mistral.modeling_mistral import MistralRotaryEmbedding  # noqa: E402

from pic.attention import AttentionBatch, AttentionShape, RopeTable, TorchBackend, apply_rope, make_batch  # noqa: E402
from pic.attention.triton_backend import TritonBackend  # noqa: E402
from pic.attention.triton_config import LAUNCH_CONFIGS, TileConfig, overridden  # noqa: E402
from pic.attention.triton_launch import launch_rotate  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import _gpu  # noqa: E402

ERROR_TARGET = 1e-2


@dataclass(frozen=True)
class Case:
    """``batch`` sequences of ``context`` slots (positions 0 .. context - 1), each with ``queries`` query tokens at
    its last positions."""

    mode: str  # "prefill", "link" (a prefill of few rows over a long context) or "decode"
    context: int
    batch: int
    queries: int


@dataclass
class Inputs:
    q: torch.Tensor  # [B * n, Hq, D] NoPE queries
    k_cache: torch.Tensor  # [B * L / page, page, Hkv, D] NoPE K; sequence b's blocks are tables[b]
    v_cache: torch.Tensor  # [B * L / page, page, Hkv, D]
    tables: torch.Tensor  # [B, L / page] int64, a random permutation of the blocks
    batch: AttentionBatch
    q_rot: torch.Tensor  # [B, Hq, n, D] rotated queries (SDPA's)
    k_rot: torch.Tensor  # [B, Hkv, L, D] rotated K, contiguous (SDPA's)
    v: torch.Tensor  # [B, Hkv, L, D] contiguous (SDPA's)
    k_cache_rotated: torch.Tensor  # [B * L / page, page, Hkv, D] k_rot paged like k_cache (pic, K pre-rotated)


def make_inputs(case: Case, args: argparse.Namespace, rope: RopeTable, device: torch.device) -> Inputs:
    """Fresh random inputs for ``case`` (seeded by its shape), paged for pic and contiguous for SDPA."""
    heads_q, heads_kv, dim = args.heads
    batch, length, n, dtype = case.batch, case.context, case.queries, args.dtype
    torch.manual_seed(args.seed + 7 * length + 3 * batch + n)
    num_blocks = batch * length // args.page
    k_cache = torch.randn(num_blocks, args.page, heads_kv, dim, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks, device=device).view(batch, -1)
    q = torch.randn(batch * n, heads_q, dim, device=device, dtype=dtype)
    q_pos = torch.arange(length - n, length, device=device)
    described = make_batch(
        block_tables=list(tables),
        kv_positions=[torch.arange(length, device=device)] * batch,
        q_positions=q_pos.repeat(batch),
        seq_lens=[n] * batch,
        rope=rope,
    )
    cos, sin = rope.cos[:length], rope.sin[:length]  # [L, D] float32
    k_rot = torch.empty(batch, heads_kv, length, dim, device=device, dtype=dtype)
    v = torch.empty_like(k_rot)
    for b in range(batch):  # one sequence at a time: the float32 temporaries stay one sequence's size
        k_rot[b] = apply_rope(k_cache[tables[b]].flatten(0, 1).float(), cos, sin).transpose(0, 1)
        v[b] = v_cache[tables[b]].flatten(0, 1).transpose(0, 1)
    q_rot = apply_rope(q.view(batch, n, heads_q, dim).float(), cos[q_pos], sin[q_pos]).to(dtype)
    k_cache_rotated = torch.empty_like(k_cache)
    for b in range(batch):
        k_cache_rotated[tables[b]] = k_rot[b].transpose(0, 1).reshape(-1, args.page, heads_kv, dim)
    q_rot = q_rot.transpose(1, 2).contiguous()
    return Inputs(q, k_cache, v_cache, tables, described, q_rot, k_rot, v, k_cache_rotated)


def exact(inp: Inputs, case: Case, rope: RopeTable, scaling: float) -> torch.Tensor:
    """Attention in float64 from the same inputs, one sequence and one KV head at a time: ``[B * n, Hq, D]``."""
    heads_q, heads_kv, length, n = inp.q.shape[1], inp.k_cache.shape[2], case.context, case.queries
    group, device = heads_q // heads_kv, inp.q.device
    cos, sin = rope.cos[:length].double(), rope.sin[:length].double()
    q_pos = torch.arange(length - n, length, device=device)
    allowed = torch.arange(length, device=device)[None] <= q_pos[:, None]  # [n, L]
    out = torch.empty(case.batch, n, heads_q, inp.q.shape[2], dtype=torch.float64, device=device)
    for b in range(case.batch):
        q = apply_rope(inp.q[b * n : (b + 1) * n].double(), cos[q_pos], sin[q_pos])  # [n, Hq, D]
        k = apply_rope(inp.k_cache[inp.tables[b]].flatten(0, 1).double(), cos, sin)  # [L, Hkv, D]
        v = inp.v_cache[inp.tables[b]].flatten(0, 1).double()  # [L, Hkv, D]
        for h in range(heads_kv):
            heads = slice(h * group, (h + 1) * group)
            scores = q[:, heads].transpose(0, 1) @ k[:, h].T * scaling  # [group, n, L]
            probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
            out[b, :, heads] = (probs @ v[:, h]).transpose(0, 1)
    return out.flatten(0, 1)


def alternatives(inp: Inputs, case: Case, args: argparse.Namespace) -> dict[str, Callable[[], torch.Tensor]]:
    """pic's kernel, SDPA (flash on CUDA) and, where it fits, the torch reference; each returns ``[B * n, Hq, D]``."""
    scaling = args.heads[2] ** -0.5
    mask = causal_lower_right(case.queries, case.context) if case.queries > 1 else None

    def sdpa() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION) if inp.q.is_cuda else contextlib.nullcontext():  # one use each
            out = F.scaled_dot_product_attention(
                inp.q_rot, inp.k_rot, inp.v, attn_mask=mask, scale=scaling, enable_gqa=True
            )  # [B, Hq, n, D]
        return out.transpose(1, 2).flatten(0, 1)

    heads_q, heads_kv, dim = args.heads
    shape = AttentionShape(heads_q, heads_kv, dim, args.dtype)
    kernel, paging = TritonBackend(shape), TritonBackend(shape, k_is_rotated=True)
    plan, paging_plan = kernel.plan(inp.batch), paging.plan(inp.batch)  # once per forward in the engine: not timed
    fns = {
        "pic": lambda: kernel.attend(inp.q, inp.k_cache, inp.v_cache, plan, scaling=scaling, sliding_window=None),
        "sdpa_flash" if inp.q.is_cuda else "sdpa": sdpa,
        "pic_k_prerotated": lambda: paging.attend(
            inp.q, inp.k_cache_rotated, inp.v_cache, paging_plan, scaling=scaling, sliding_window=None
        ),  # the same kernel without rotating K: what paging alone costs
    }
    if plan.prefill.launch.rotated_once:  # the plan rotates K once per layer: also the kernel rotating it in its loop
        in_loop = TritonBackend(shape, rotate_once=False)
        in_loop_plan = in_loop.plan(inp.batch)
        fns["pic_k_in_loop"] = lambda: in_loop.attend(
            inp.q, inp.k_cache, inp.v_cache, in_loop_plan, scaling=scaling, sliding_window=None
        )
        fns["pic_rotate_k_only"] = lambda: launch_rotate(inp.k_cache, plan, plan.prefill.rotated)  # returns no output
    for splits in args.link_splits if case.mode == "link" else ():  # the plan's split choice against forced ones
        forced = TritonBackend(shape, prefill_splits=splits)
        forced_plan = forced.plan(inp.batch)
        fns[f"pic_splits_{splits}"] = lambda forced=forced, forced_plan=forced_plan: forced.attend(
            inp.q, inp.k_cache, inp.v_cache, forced_plan, scaling=scaling, sliding_window=None
        )
    if case.batch * case.context <= args.ref_max_slots:
        reference = TorchBackend(shape)
        ref_plan = reference.plan(inp.batch)
        fns["torch_reference"] = lambda: reference.attend(
            inp.q, inp.k_cache, inp.v_cache, ref_plan, scaling=scaling, sliding_window=None
        )
    return fns


def time_ms(fn: Callable[[], object], args: argparse.Namespace) -> float:
    """Milliseconds of one ``fn()``: ``do_bench``'s median on CUDA, one wall-clock call on the CPU."""
    if args.device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median")
    start = time.perf_counter()
    fn()
    return 1000 * (time.perf_counter() - start)


def back_to_back_ms(fn: Callable[[], object], args: argparse.Namespace) -> float:
    """Milliseconds per call of ``--back-to-back`` calls in a row, no L2 flush between them (GPU time between two
    CUDA events on CUDA, wall clock on the CPU)."""
    calls = args.back_to_back
    if args.device.type == "cuda":
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls
    start_s = time.perf_counter()
    for _ in range(calls):
        fn()
    return 1000 * (time.perf_counter() - start_s) / calls


def run_case(case: Case, args: argparse.Namespace, rope: RopeTable) -> dict:
    """Check every alternative's output against float64, then time them in turn, ``--rounds`` times."""
    inp = make_inputs(case, args, rope, args.device)
    fns, errors, notes = alternatives(inp, case, args), {}, []
    if "torch_reference" not in fns:
        notes.append(f"torch_reference skipped: batch x context > --ref-max-slots {args.ref_max_slots}")
    expected = exact(inp, case, rope, args.heads[2] ** -0.5)
    for name, fn in list(fns.items()):  # the first call also compiles the kernels
        try:
            out = fn()
        except (RuntimeError, ValueError) as exc:  # e.g. no flash kernel for these inputs: recorded, not fatal
            if name == "pic":
                raise
            notes.append(f"{name} failed: {type(exc).__name__}: {exc}")
            del fns[name]
            continue
        if isinstance(out, torch.Tensor):  # (the rotation alone has no output)
            errors[name] = float((out.double() - expected).norm() / expected.norm())
    raw = _gpu.interleaved({name: lambda fn=fn: time_ms(fn, args) for name, fn in fns.items()}, rounds=args.rounds)
    med = _gpu.medians(raw)
    warm = {name: back_to_back_ms(fn, args) for name, fn in fns.items()}
    heads_q, heads_kv, dim = args.heads
    n, length = case.queries, case.context
    pairs = case.batch * (n * length - n * (n - 1) // 2)  # query-key pairs attended (causal)
    flops, kv_bytes = 4 * pairs * heads_q * dim, 2 * case.batch * length * heads_kv * dim * inp.q.element_size()
    baseline = "sdpa_flash" if args.device.type == "cuda" else "sdpa"
    in_loop = med.get("pic_k_in_loop")  # timed where the plan rotates K once
    return asdict(case) | {
        "median_ms": med,
        "rounds_ms": raw,
        "pic_over_sdpa": med["pic"] / med[baseline] if baseline in med else None,
        "back_to_back_ms": warm,
        "pic_over_sdpa_back_to_back": warm["pic"] / warm[baseline] if baseline in warm else None,
        "pic_over_pic_k_prerotated": med["pic"] / med["pic_k_prerotated"],  # what rotating K costs
        "pic_rotated_once": in_loop is not None,  # the plan's choice: K rotated once per layer (rotate_k_kernel)
        "pic_k_in_loop_over_sdpa": in_loop / med[baseline] if in_loop is not None and baseline in med else None,
        "pic_k_in_loop_over_pic": in_loop / med["pic"] if in_loop is not None else None,
        "rel_error": errors,
        # (the rotation launch alone does none of the attention: no rate for it)
        "tflop_per_s": {name: flops / ms / 1e9 for name, ms in med.items() if name != "pic_rotate_k_only"},
        "kv_read_tb_per_s": {name: kv_bytes / ms / 1e9 for name, ms in med.items() if name != "pic_rotate_k_only"},
        "notes": notes,
    }


def plot(rows: list[dict], title: str, path: Path) -> None:
    """pic / SDPA against context, one line for the prefill and one per decode batch."""
    plt = _gpu.pyplot(path)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    order = {"prefill": 0, "link": 1, "decode": 2}
    series = sorted({(r["mode"], r["batch"], r["queries"]) for r in rows}, key=lambda s: (order[s[0]], s[1], s[2]))
    for mode, batch, queries in series:
        mine = [r for r in rows if (r["mode"], r["batch"], r["queries"]) == (mode, batch, queries)]
        mine = [r for r in mine if r["pic_over_sdpa"] is not None]
        label = f"decode, batch {batch}" if mode == "decode" else f"{mode}, {queries} query tokens"
        marker = "s" if mode == "link" else "o"
        ax.plot([r["context"] for r in mine], [r["pic_over_sdpa"] for r in mine], marker=marker, label=label)
        in_loop = [r for r in mine if r.get("pic_k_in_loop_over_sdpa") is not None]
        if in_loop:  # the same pass with K rotated in the KV loop (the plan rotates it once)
            ax.plot([r["context"] for r in in_loop], [r["pic_k_in_loop_over_sdpa"] for r in in_loop], marker=marker,
                    ls=":", label=f"{label}, K rotated in the loop")  # fmt: skip
    ax.axhline(1.0, color="k", ls="--", lw=1)
    ax.set_xscale("log", base=2)
    contexts = sorted({r["context"] for r in rows})
    ax.set_xticks(contexts, [f"{c // 1024}K" if c >= 1024 else str(c) for c in contexts])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("time, pic / SDPA (lower is faster)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--prefill-queries", type=int, default=512)
    parser.add_argument("--link-context", type=int, default=16384, help="keys of the link-sized passes (0: none)")
    parser.add_argument("--link-queries", type=int, nargs="*", default=[32, 544], help="query rows of each link pass")
    parser.add_argument("--link-splits", type=int, nargs="*", default=[1, 4], help="forced splits also timed")
    parser.add_argument("--heads", type=int, nargs=3, default=[32, 8, 128], help="query heads, KV heads, head dim")
    parser.add_argument("--page", type=int, default=16, help="slots per KV block")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup-ms", type=int, default=5, help="do_bench warm-up per round")
    parser.add_argument("--rep-ms", type=int, default=20, help="do_bench timed calls per round")
    parser.add_argument("--back-to-back", type=int, default=50, help="calls in a row for the back-to-back figure")
    parser.add_argument("--ref-max-slots", type=int, default=2**19, help="largest batch x context the reference runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="CPU, interpreter, tiny float16 shapes, 1 round")
    parser.add_argument("--out", default="benchmarks/results/attention.json", help="the PNG goes beside it")
    parser.add_argument("--tune", action="store_true", help="instead: sweep the prefill launch's configurations")
    parser.add_argument("--tune-contexts", type=int, nargs="+", default=[16384])
    parser.add_argument("--tune-block-n", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--tune-stages", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--tune-warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--tune-out", default="benchmarks/results/attention_tune.json")
    args = parser.parse_args()
    if not args.quick and not torch.cuda.is_available():
        parser.error("this benchmark needs a CUDA GPU (--quick runs a smoke test on the CPU)")
    args.dtype, args.device = torch.bfloat16, torch.device("cuda")
    if args.quick:
        args.contexts, args.decode_batches, args.prefill_queries, args.heads = [64, 128], [1, 2], 16, [4, 2, 32]
        args.link_context, args.link_queries = 256, [4, 20]
        args.rounds, args.dtype, args.device, args.back_to_back = 1, torch.float16, torch.device("cpu"), 2
        args.tune_contexts, args.tune_block_n, args.tune_stages, args.tune_warps = [128], [16, 32], [1], [4]
    assert all(c % args.page == 0 and c >= args.prefill_queries for c in args.contexts), "whole pages, >= the prefill"
    assert not args.link_context or (args.link_context % args.page == 0 and args.link_context >= max(args.link_queries))
    return args


def make_report(rows: list[dict], args: argparse.Namespace, config: MistralConfig, *, complete: bool) -> dict:
    """The results file: the machine, the command and settings, each case's row, and the error checks: pic's error
    within ``ERROR_TARGET``, and (the issue's bound for the prefill kernel) its ratio to SDPA's on the same inputs."""
    pic_errors = [r["rel_error"]["pic"] for r in rows]
    baseline = "sdpa_flash" if args.device.type == "cuda" else "sdpa"
    over_sdpa = {}
    for r in rows:
        if baseline in r["rel_error"]:
            name = f"{r['mode']} L={r['context']} n={r['queries']} B={r['batch']}"
            over_sdpa[name] = r["rel_error"]["pic"] / r["rel_error"][baseline]
    names = ("contexts", "decode_batches", "prefill_queries", "link_context", "link_queries", "link_splits", "heads")
    settings = {k: getattr(args, k) for k in (*names, "page")}
    settings |= {k: getattr(args, k) for k in ("rounds", "warmup_ms", "rep_ms", "ref_max_slots", "seed")}
    return {
        "environment": _gpu.environment(args.device),
        "command": _gpu.command(),
        "complete": complete,  # False: the run was cut short after these cases
        "settings": settings | {"dtype": str(args.dtype).removeprefix("torch."), "rope": config.rope_parameters},
        "cases": rows,
        "max_pic_rel_error": max(pic_errors),
        "error_target": ERROR_TARGET,
        "pic_within_target": all(e <= ERROR_TARGET for e in pic_errors),  # False for a NaN too
        "pic_error_over_sdpa_error": over_sdpa,  # the prefill kernel's goal: <= 1 (reported, not a failure)
    }


def tune(args: argparse.Namespace, rope: RopeTable) -> None:
    """``--tune``: the recompute passes' launch at ``--prefill-queries`` rows over each of ``--tune-contexts`` keys,
    once per configuration of its ``LAUNCH_CONFIGS`` row (KV tile x stages x warps), reading K rotated once and
    rotating it in the loop, and ``rotate_k_kernel``'s own row (slots per program x warps); each output checked
    against float64, each timed as the cases are. Writes ``--tune-out``: every configuration's time and error, and
    the fastest per kind and context, the rows to put in ``pic/attention/triton_config.py``."""
    results, notes = [], []
    for context in args.tune_contexts:
        tune_context(Case("prefill", context, 1, args.prefill_queries), args, rope, results, notes)
    best = {}
    for row in results:
        if row["kind"] != "sdpa" and row.get("rel_error", 0.0) <= ERROR_TARGET:
            key = f"L={row['context']} {row['kind']}"
            if key not in best or row["median_ms"] < best[key]["median_ms"]:
                best[key] = row
    dim = args.heads[2]
    current = {k: asdict(v) if v else None for k, v in LAUNCH_CONFIGS[next_table_dim(dim)].items()}
    settings = {k: getattr(args, k) for k in ("heads", "page", "prefill_queries", "rounds", "seed")}
    report = {
        "environment": _gpu.environment(args.device),
        "command": _gpu.command(),
        "settings": settings | {"dtype": str(args.dtype).removeprefix("torch.")},
        "current_configs": current,
        "results": results,
        "fastest": best,
        "notes": notes,
    }
    _gpu.write_json(Path(args.tune_out), report)
    for key, row in best.items():
        print(f"fastest {key}: {row}")


def next_table_dim(head_dim: int) -> int:
    """The ``LAUNCH_CONFIGS`` row a head dim reads."""
    return min((d for d in LAUNCH_CONFIGS if d >= head_dim), default=max(LAUNCH_CONFIGS))


def median_ms(fn: Callable[[], object], args: argparse.Namespace) -> float:
    """``time_ms`` of ``fn``, the median over ``--rounds``."""
    return _gpu.medians(_gpu.interleaved({"fn": lambda: time_ms(fn, args)}, rounds=args.rounds))["fn"]


def tune_context(case: Case, args: argparse.Namespace, rope: RopeTable, results: list, notes: list) -> None:
    """``tune`` at one context: rows appended to ``results`` (failures to ``notes``)."""
    heads_q, heads_kv, dim = args.heads
    shape, scaling = AttentionShape(heads_q, heads_kv, dim, args.dtype), dim**-0.5
    inp = make_inputs(case, args, rope, args.device)
    expected = exact(inp, case, rope, scaling)
    kind = f"prefill {TritonBackend(shape).plan(inp.batch).prefill.launch.block_m}"
    grid = [(b, s, w) for b in args.tune_block_n for s in args.tune_stages for w in args.tune_warps]
    for once in (True, False):
        name = f"{kind} once" if once else kind
        for block_n, stages, warps in grid:
            with overridden(dim, name, TileConfig(block_n=block_n, num_warps=warps, num_stages=stages)):
                backend = TritonBackend(shape, rotate_once=once)
                plan = backend.plan(inp.batch)  # the launch reads its configuration here

            def fn(backend: TritonBackend = backend, plan=plan) -> torch.Tensor:
                return backend.attend(inp.q, inp.k_cache, inp.v_cache, plan, scaling=scaling, sliding_window=None)

            row = {"context": case.context, "kind": name, "block_n": block_n, "num_stages": stages, "num_warps": warps}
            try:
                out = fn()
            except Exception as exc:  # e.g. more shared memory than the GPU has: recorded, the sweep goes on
                notes.append(f"{row}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            row["rel_error"] = float((out.double() - expected).norm() / expected.norm())
            row["median_ms"] = median_ms(fn, args)
            results.append(row)
            print(f"L={case.context} {name}: {block_n=} {stages=} {warps=}: {row['median_ms']:.3f} ms, "
                  f"err {row['rel_error']:.1e}")  # fmt: skip
    for block, warps in [(b, w) for b in args.tune_block_n for w in args.tune_warps]:
        with overridden(dim, "rotate", TileConfig(block_n=block, num_warps=warps, num_stages=1)):
            plan = TritonBackend(shape, rotate_once=True).plan(inp.batch)
        ms = median_ms(lambda plan=plan: launch_rotate(inp.k_cache, plan, plan.prefill.rotated), args)
        results.append(
            {"context": case.context, "kind": "rotate", "block_n": block, "num_warps": warps, "median_ms": ms}
        )
        print(f"L={case.context} rotate: {block=} {warps=}: {ms:.3f} ms")
    sdpa = alternatives(inp, case, args)["sdpa_flash" if args.device.type == "cuda" else "sdpa"]
    results.append({"context": case.context, "kind": "sdpa", "median_ms": median_ms(sdpa, args)})


def main() -> None:
    args = parse_args()
    heads_q, heads_kv, dim = args.heads
    config = MistralConfig(
        hidden_size=heads_q * dim, num_attention_heads=heads_q, num_key_value_heads=heads_kv, head_dim=dim
    )  # its rotary module: transformers' default for Mistral (rope theta 10,000, as Mistral-7B v0.1)
    rotary = MistralRotaryEmbedding(config).to(args.device)
    longest = max(args.contexts + [args.link_context])
    rope = RopeTable(rotary, max_positions=max(longest, *args.tune_contexts), dtype=args.dtype, device=args.device)
    if args.tune:
        return tune(args, rope)
    cases = [Case("prefill", c, 1, args.prefill_queries) for c in args.contexts]
    cases += [Case("link", args.link_context, 1, n) for n in args.link_queries if args.link_context]
    cases += [Case("decode", c, b, 1) for c in args.contexts for b in args.decode_batches]
    rows = []
    order = {"prefill": 0, "link": 1, "decode": 2}
    out = Path(args.out)

    def key(c: Case | dict) -> tuple:  # the report's order: by context, then prefill, link, decode
        c = c if isinstance(c, dict) else asdict(c)
        return c["context"], order[c["mode"]], c["batch"], c["queries"]

    # Run the prefill and link passes first, the decodes after: a run cut short by its time limit has the former.
    for case in sorted(cases, key=lambda c: (c.mode == "decode", key(c))):
        rows.append(run_case(case, args, rope))
        row = rows[-1]
        rows.sort(key=key)
        cells = ", ".join(
            f"{k} {v:.3f} ms" + (f" (err {row['rel_error'][k]:.1e})" if k in row["rel_error"] else "")
            for k, v in row["median_ms"].items()
        )
        ratio, warm = row["pic_over_sdpa"] or float("nan"), row["pic_over_sdpa_back_to_back"] or float("nan")
        rotation = row["pic_over_pic_k_prerotated"]
        in_loop = f", K in the loop / once {row['pic_k_in_loop_over_pic']:.2f}" if row["pic_rotated_once"] else ""
        print(
            f"{case.mode:7} L={case.context:6} B={case.batch:3} n={case.queries:4}: {cells}; pic/sdpa {ratio:.2f}, "
            f"back to back {warm:.2f}, rotation {rotation:.2f}{in_loop}"
        )
        if args.device.type == "cuda":
            torch.cuda.empty_cache()
        # Each case's row is written as it ends: a run cut short by its time limit keeps what it measured.
        report = make_report(rows, args, config, complete=len(rows) == len(cases))
        _gpu.write_json(out, report, quiet=len(rows) < len(cases))
    pic_errors = [r["rel_error"]["pic"] for r in rows]
    device = report["environment"]["gpu"] or "CPU (interpreter; timings meaningless)"
    plot(
        rows,
        f"pic's Triton kernel / SDPA, {heads_q}/{heads_kv} heads of {dim}: {device}",
        out.with_suffix(".png"),
    )
    if not report["pic_within_target"]:
        sys.exit(f"pic's relative errors {[f'{e:.1e}' for e in pic_errors]}: not all within {ERROR_TARGET:g}")


if __name__ == "__main__":
    main()
