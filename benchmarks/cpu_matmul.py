"""One token's matrix products on a CPU, one thread: float32 against bfloat16 and int8 (dynamic activation
quantization, fbgemm; and weight-only ``_weight_int8pack_mm``), for SmolLM2-135M's matrix shapes.

python benchmarks/cpu_matmul.py                    # writes benchmarks/results/cpu_matmul.json
python benchmarks/cpu_matmul.py --quick --out /tmp/r

A decode step reads every weight once, so each shape is timed over as many distinct matrices as one step reads
of it (30 layers; one LM head): the weights then come from memory, not from the cache, as in a real step. The
figures are medians of 5 repetitions, microseconds per product; ratios are float32 time / variant time. The int8
variants change the products' values (they are not exact): they answer whether a quantized mode could pay here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import _gpu  # noqa: E402

# SmolLM2-135M: (in, out, matrices per decode step)
SHAPES = {
    "q_proj, o_proj (576x576)": (576, 576, 60),
    "k_proj, v_proj (576x192)": (576, 192, 60),
    "gate, up (576x1536)": (576, 1536, 60),
    "down (1536x576)": (1536, 576, 30),
    "lm_head (576x49152)": (576, 49152, 1),
}


def timed(fn: Callable[[], object], repeats: int) -> float:
    fn()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def variants(num_in: int, num_out: int, count: int) -> dict[str, Callable[[], object]]:
    """Each variant's product of one token with ``count`` distinct ``[num_out, num_in]`` matrices."""
    weights = [torch.randn(num_out, num_in) / num_in**0.5 for _ in range(count)]
    x = torch.randn(1, num_in)
    linears = []
    for w in weights:
        linear = torch.nn.Linear(num_in, num_out, bias=False)
        linear.weight.data = w
        linears.append(linear)
    with warnings.catch_warnings():  # torch deprecates the quantized tensor types quantize_dynamic makes
        warnings.simplefilter("ignore")
        dynamic = [
            torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(lin), {torch.nn.Linear}) for lin in linears
        ]
    bf16, xb = [w.bfloat16() for w in weights], x.bfloat16()
    scales = [w.abs().amax(1) / 127 for w in weights]
    packed = [(w / s[:, None]).round().to(torch.int8) for w, s in zip(weights, scales, strict=True)]
    with torch.no_grad():
        return {
            "float32": lambda: [torch.nn.functional.linear(x, w) for w in weights],
            "bfloat16": lambda: [torch.nn.functional.linear(xb, w) for w in bf16],
            "int8 dynamic (fbgemm)": lambda: [m(x) for m in dynamic],
            "int8 weight-only (_weight_int8pack_mm)": lambda: [
                torch._weight_int8pack_mm(x, p, s) for p, s in zip(packed, scales, strict=True)
            ],
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="few matrices, one repetition: a smoke run")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows, step = {}, {}
    for name, (num_in, num_out, count) in SHAPES.items():
        count = min(count, 2) if args.quick else count
        with torch.no_grad():
            times = {
                k: timed(fn, 1 if args.quick else args.repeats) / count
                for k, fn in variants(num_in, num_out, count).items()
            }
        rows[name] = {k: t * 1e6 for k, t in times.items()} | {
            f"float32 / {k}": times["float32"] / t for k, t in times.items() if k != "float32"
        }
        for k, t in times.items():
            step[k] = step.get(k, 0.0) + t * SHAPES[name][2] * 1e3
        print(name, ", ".join(f"{k} {v:.2f}" for k, v in rows[name].items()), flush=True)
    report = {"command": _gpu.command(), "environment": _gpu.environment(torch.device("cpu")) | {"torch_threads": 1},
              "quantized_engine": torch.backends.quantized.engine, "us_per_product": rows,
              "ms_per_decode_step": step}  # fmt: skip
    print("per decode step (ms):", {k: round(v, 1) for k, v in step.items()})
    _gpu.write_json(args.out / ("cpu_matmul_quick.json" if args.quick else "cpu_matmul.json"), report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
