"""What one decode step spends on a CPU, by category, for pic and for transformers: SmolLM2-135M-Instruct after a
RAG prompt (``cpu_rag.py``'s), batch 1, one torch thread (issue 34's first question: what bounds a decode step).

python benchmarks/decode_profile.py                   # writes benchmarks/results/decode_profile.json
python benchmarks/decode_profile.py --quick --out /tmp/r

Both engines run the same model modules (pic's runner calls the Hugging Face model's own projections, norms and
MLP), so one set of labels serves both: ``torch.profiler.record_function`` ranges opened by forward hooks on the
model's modules and by wrappers of pic's attention backend and sampler. Categories (inclusive CPU time of the
ranges, per step):
  projections   q/k/v/o and MLP ``nn.Linear`` products (576x576 ... 576x1536 matrices, one token: matrix-vector)
  lm_head       the 576 x 49,152 output product
  norms         RMSNorm modules
  activation    the MLP's SiLU (its elementwise product is counted under "other")
  attention     pic: the backend's plan, KV store and attend (rotary of q and of new K included); transformers: the
                attention module minus its projections (rotary, KV cache update, SDPA)
  sampling      pic's sampler; transformers: its logits processing and argmax are under "other"
  embedding     the token embedding lookup
  other         the step's wall time minus the above: Python, dispatch, residual adds, the scheduler, copies
The profiler's own cost is shown by timing the same number of steps without it (``unprofiled_step_ms``).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import pic
from pic.engine.commands import OnCoreThread
from pic.evaluation.workload import cache_argument

sys.path.insert(0, str(Path(__file__).parent))
import _gpu  # noqa: E402
from cpu_rag import messages, passages  # noqa: E402

LABELS = ("projections", "lm_head", "norms", "activation", "attention", "sampling", "embedding")
_ATTN_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")


def hook_modules(model: torch.nn.Module) -> list:
    """Open a labelled range around each module of interest (forward pre-hook) and close it (forward hook)."""
    handles, lm_head = [], model.get_output_embeddings()

    def label(module: torch.nn.Module, name: str) -> None:
        ranges: list = []

        def enter(_module, _args):
            ranges.append(record_function(name).__enter__())

        def leave(_module, _args, _out):
            ranges.pop().__exit__(None, None, None)

        handles.extend([module.register_forward_pre_hook(enter), module.register_forward_hook(leave)])

    for name, module in model.named_modules():
        if module is lm_head:
            label(module, "lm_head")
        elif isinstance(module, torch.nn.Linear):
            label(module, "attn_projections" if name.endswith(_ATTN_PROJ) else "projections")
        elif type(module).__name__.endswith("RMSNorm"):
            label(module, "norms")
        elif name.endswith("act_fn"):
            label(module, "activation")
        elif isinstance(module, torch.nn.Embedding):
            label(module, "embedding")
        elif name.endswith("self_attn"):
            label(module, "attention_module")  # transformers only: pic's runner calls the projections itself
    return handles


@contextlib.contextmanager
def wrapped(owner: object, attribute: str, name: str):
    """``owner.attribute`` (a function) inside a labelled range for the block."""
    original = getattr(owner, attribute)

    def run(*args, **kwargs):
        with record_function(name):
            return original(*args, **kwargs)

    setattr(owner, attribute, run)
    try:
        yield
    finally:
        setattr(owner, attribute, original)


@contextlib.contextmanager
def int8_ranges(products: object, lm_head: torch.nn.Module):
    """Label int8 decode products (``pic.model.products.Int8Products._run``, every packed matrix: q/k/v, o, gate/up,
    down, the LM head; no module call, so no hook sees them) as projections or the LM head; the float products it
    falls back to are modules, labelled by their hooks."""
    original = getattr(products, "_run", None)
    if original is None:  # float products: module calls
        yield
        return

    def run(owner, x):
        with record_function("lm_head" if owner is lm_head else "projections"):
            return original(owner, x)

    products._run = run
    try:
        yield
    finally:
        del products._run


def totals(prof) -> dict[str, float]:
    """Inclusive CPU milliseconds of each category in a profile (the attention module less its projections)."""
    found = {e.key: e.cpu_time_total / 1e3 for e in prof.key_averages()}
    out = {k: found.get(k, 0.0) for k in LABELS}
    out["projections"] += found.get("attn_projections", 0.0)
    if "attention_module" in found:
        out["attention"] += found["attention_module"] - found.get("attn_projections", 0.0)
    return out


def top_ops(prof) -> dict[str, tuple[float, int]]:
    """Self CPU milliseconds and calls of every aten op."""
    return {e.key: (e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages() if e.key.startswith("aten::")}


def profiled(
    run: Callable[[], float], on_thread: Callable[[Callable[[], object]], object] = lambda fn: fn()
) -> tuple[float, dict[str, float], dict[str, tuple[float, int]]]:
    """``run()`` under the CPU profiler, started and stopped by ``on_thread`` (the profiler records the thread
    that starts it: pic's engine thread runs the steps)."""
    prof = profile(activities=[ProfilerActivity.CPU])
    on_thread(prof.start)
    seconds = run()
    on_thread(prof.stop)
    return seconds, totals(prof), top_ops(prof)


def per_step(long: tuple, short: tuple, num_steps: int) -> dict:
    """Milliseconds per decode step: the long run's figures less the short run's (what the extra steps took)."""
    wall_s, cats, ops = long
    _, short_cats, short_ops = short
    row = {k: (cats[k] - short_cats[k]) / num_steps for k in LABELS}
    row = {"step_ms": wall_s * 1e3 / num_steps, **row}
    row["other"] = row["step_ms"] - sum(row[k] for k in LABELS)
    diff = {op: ((ms - short_ops.get(op, (0.0, 0))[0]) / num_steps, (n - short_ops.get(op, (0.0, 0))[1]) / num_steps)
            for op, (ms, n) in ops.items()}  # fmt: skip
    top = sorted(diff.items(), key=lambda item: item[1][0], reverse=True)[:12]
    row["top_aten_ops"] = [{"op": op, "self_ms_per_step": ms, "calls_per_step": n} for op, (ms, n) in top]
    row["aten_calls_per_step"] = sum(n for _, n in diff.values())
    row["mm_calls_per_step"] = diff.get("aten::mm", (0.0, 0))[1]  # a count, whatever the top list's timings rank
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24, help="decode steps profiled per engine")
    parser.add_argument("--quick", action="store_true", help="the embedded model, short prompt: a smoke run")
    parser.add_argument("--decode-weights", choices=["model", "int8"], default="model", help="pic's (PICConfig)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    name = pic.EMBEDDED_MODEL if args.quick else "smollm2"
    config = pic.PICConfig(attention_backend="torch", decode_weights=args.decode_weights)
    engine = pic.load(name, config=config, progress=False)
    if args.quick:
        ids = engine.compile(["Tom had a red ball. He liked to kick it.\n", "Lily loved to sing.\n"], progress=False)
        link = lambda: engine.link(ids, "One day, Tom and Lily", policy="mepic")  # noqa: E731
    else:
        ids = engine.compile(passages(engine.tokenizer, num=8, min_tokens=256, max_tokens=512), progress=False)
        link = lambda: engine.link_chat(ids, messages(), policy="mepic")  # noqa: E731
    prompt = link().input_ids  # the linked prompt: transformers decodes after the same tokens
    report = {"command": _gpu.command(), "environment": _gpu.environment(torch.device("cpu")) | {"torch_threads": 1},
              "model": str(name), "decode_weights": args.decode_weights, "steps": args.steps,
              "prompt_tokens": int(prompt.shape[0])}  # fmt: skip
    report["pic"] = measure_pic(engine, link, args.steps)
    report["transformers"] = measure_hf(engine.model, prompt, args.steps)
    stem = "decode_profile" + ("_int8" if args.decode_weights == "int8" else "") + ("_quick" if args.quick else "")
    _gpu.write_json(args.out / f"{stem}.json", report)
    for who in ("pic", "transformers"):
        row = report[who]
        print(f"{who:>12}: {row['step_ms']:.1f} ms/step profiled ({row['unprofiled_step_ms']:.1f} unprofiled): "
              + ", ".join(f"{k} {row[k]:.1f}" for k in (*LABELS, "other")), flush=True)  # fmt: skip
    return 0


def measure_pic(engine: pic.PIC, link: Callable[[], pic.Linked], num_steps: int) -> dict:
    """pic: link + ``num_steps + 1`` tokens against link + 1 token, both profiled: the difference is the decode."""

    def run(n: int) -> float:
        return link().generate(max_new_tokens=n + 1).stats.decode_s

    run(4)  # warm-up
    plain = statistics.median(run(num_steps) for _ in range(3))
    import pic.model.executor as executor

    with engine.paused() as core:
        backend, products = core.runner.attention_backend, core.runner._decode
    handles = hook_modules(engine.model)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(int8_ranges(products, engine.model.get_output_embeddings()))
            stack.enter_context(wrapped(executor, "sample_rows", "sampling"))
            for method in ("plan", "store", "attend"):
                stack.enter_context(wrapped(backend, method, "attention"))
            on_engine = lambda fn: engine._channel.call(lambda reply: OnCoreThread(fn, reply))  # noqa: E731
            short, long = profiled(lambda: run(0), on_engine), profiled(lambda: run(num_steps), on_engine)
    finally:
        for handle in handles:
            handle.remove()
    return per_step(long, short, num_steps) | {"unprofiled_step_ms": plain * 1e3 / num_steps}


def measure_hf(model: torch.nn.Module, prompt: torch.Tensor, num_steps: int) -> dict:
    """transformers: greedy steps with its cache after the prefill (the prefill outside the profile)."""

    def run(n: int) -> float:
        with torch.no_grad():
            out = model(prompt[None], use_cache=True, logits_to_keep=1)
            cache, token = out.past_key_values, out.logits[0, -1].argmax()
            name = cache_argument(model)
            start = time.perf_counter()
            for _ in range(n):
                out = model(token.view(1, 1), use_cache=True, **{name: cache})
                cache, token = out.past_key_values, out.logits[0, -1].argmax()
            int(token)
            return time.perf_counter() - start

    run(4)
    plain = statistics.median(run(num_steps) for _ in range(3))
    handles = hook_modules(model)
    try:
        short, long = profiled(lambda: run(0)), profiled(lambda: run(num_steps))
    finally:
        for handle in handles:
            handle.remove()
    return per_step(long, short, num_steps) | {"unprofiled_step_ms": plain * 1e3 / num_steps}


if __name__ == "__main__":
    sys.exit(main())
