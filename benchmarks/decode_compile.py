"""What ``torch.compile`` (inductor, CPU) saves on a SmolLM2 decode step, one thread: every layer's work outside
attention (input norm, q/k/v/o projections, residuals, post-attention norm, MLP) for one token, eager against
compiled, in interleaved rounds; and how long compiling takes.

python benchmarks/decode_compile.py                 # writes benchmarks/results/decode_compile.json
python benchmarks/decode_compile.py --quick --out /tmp/r

Attention is left out on purpose: its shapes change with the context at every step (a compiled graph would be
recompiled or made dynamic), and it already runs as one fused SDPA call per layer. One function is compiled and called
for all 30 layers (the modules are its arguments, so one graph serves every layer). Compiled code is not bit for bit
the eager code (inductor fuses and reorders float operations); the largest difference is reported.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import pic

sys.path.insert(0, str(Path(__file__).parent))
import _gpu  # noqa: E402


def layer_body(layer: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """A decoder layer for ``hidden`` ``[1, hidden_size]`` with its attention output replaced by the queries."""
    attn = layer.self_attn
    x = layer.input_layernorm(hidden)
    q, _, _ = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    hidden = hidden + attn.o_proj(q)
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


def steps(body, layers, hidden: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        hidden = body(layer, hidden)
    return hidden


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--quick", action="store_true", help="the embedded model, 2 rounds: a smoke run")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = pic.load(pic.EMBEDDED_MODEL if args.quick else "smollm2", progress=False)
    if args.quick:
        args.rounds = 2
    layers = engine.model.model.layers
    hidden = torch.randn(1, engine.model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(layer_body, dynamic=False)
    with torch.no_grad():
        start = time.perf_counter()
        steps(compiled, layers, hidden)
        compile_s = time.perf_counter() - start
        fns = {"eager": lambda: steps(layer_body, layers, hidden), "compiled": lambda: steps(compiled, layers, hidden)}
        raw = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                start = time.perf_counter()
                fn()
                raw[name].append((time.perf_counter() - start) * 1e3)
        difference = (fns["eager"]() - fns["compiled"]()).abs().max().item()
    med = {name: statistics.median(values) for name, values in raw.items()}
    report = {"command": _gpu.command(), "environment": _gpu.environment(torch.device("cpu")) | {"torch_threads": 1},
              "model": engine.model_name, "num_layers": len(layers), "first_call_s": compile_s,
              "median_ms_per_step": med, "rounds_ms": raw, "eager_over_compiled": med["eager"] / med["compiled"],
              "max_abs_difference": difference}  # fmt: skip
    print(f"compile {compile_s:.1f} s; eager {med['eager']:.2f} ms, compiled {med['compiled']:.2f} ms per step "
          f"({report['eager_over_compiled']:.2f}x); max |difference| {difference:.2g}")  # fmt: skip
    _gpu.write_json(args.out / "decode_compile.json", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
