"""Compile pic's Triton kernels for an NVIDIA GPU on a machine without one, exactly as the engine launches
them, and report what each costs an SM.

python tests/compile_kernels.py [--arch 90] [--dtype bf16] [--num-q-heads 32] [--num-kv-heads 8] [--head-dim 128]

Triton's compiler and its bundled ptxas need no GPU. ``TritonBackend.precompile`` (what the engine runs
at start) compiles every variant through the JIT's own launch path, with real tensor arguments on the CPU
standing in for the GPU's: the JIT specializes them as it would a launch (``tt.divisibility=16`` on
aligned pointers and on integers divisible by 16). Here the active driver is replaced by one that only
names the target GPU, so nothing needs CUDA. Prints one JSON line per compiled kernel: registers, stack
(spilled bytes), shared memory, ``cp.async`` copies and the deepest ``cp.async.wait_group`` (copies in
flight: the loop is pipelined) and programs per SM, with the Triton version. Then it plans batches of
other sizes, context lengths and split counts and launches them (compile only): the last line,
``compiled_after_precompile``, counts the variants those launches compiled anew per kernel, which must be
none. Must run without ``TRITON_INTERPRET`` (the test runs it in a subprocess).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

from pic.attention import AttentionShape, triton_kernels
from pic.attention.triton_backend import TritonBackend
from pic.attention.triton_compile import kernel_resources
from pic.attention.triton_launch import launch_attention
from tests.attention_cases import make_case

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class TargetOnlyDriver:
    """What ``JITFunction.run(warmup=True)`` asks of the active driver: the target and a device and stream."""

    def __init__(self, arch: int) -> None:
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


def compile_launches(*, arch: int, dtype: str, num_q_heads: int, num_kv_heads: int, head_dim: int, page: int,
                     window: int | None) -> list[dict]:  # fmt: skip
    """Every kernel the engine launches for this shape, compiled for ``arch`` as launched; one report each,
    and last the variants that batches unlike precompile's compiled anew (``compiled_after_precompile``)."""
    windows = (None,) if window is None else (None, window)
    shape = AttentionShape(num_q_heads, num_kv_heads, head_dim, DTYPES[dtype], windows)
    backend = TritonBackend(shape, capability=divmod(arch, 10))
    cache = torch.empty(4, page, num_kv_heads, head_dim, dtype=DTYPES[dtype])
    driver.set_active(TargetOnlyDriver(arch))  # for this process: a machine without a GPU has no other
    compiled = backend.precompile(cache, cache.clone())
    reports = []
    for launch in compiled:
        for kernel in launch.kernels:
            report = {"launch": launch.name, "window": launch.window, "kernel": kernel.name, "arch": arch}
            report |= {"dtype": dtype, "shape": [num_q_heads, num_kv_heads, head_dim], "triton": triton.__version__}
            reports.append(report | asdict(kernel_resources(kernel, arch=arch)))
    before = jit_cache_sizes()
    launch_unlike_precompile(backend, page=page)
    after = jit_cache_sizes()
    return reports + [{"compiled_after_precompile": {name: after[name] - before[name] for name in before}}]


def jit_cache_sizes() -> dict[str, int]:
    """Compiled variants each of pic's kernels holds in the JIT's cache, over all devices."""
    kernels = (triton_kernels.paged_attention_kernel, triton_kernels.combine_splits_kernel)
    kernels += (triton_kernels.rotate_k_kernel,)
    return {k.__name__: sum(len(cache[0]) for cache in k.device_caches.values()) for k in kernels}


def launch_unlike_precompile(backend: TritonBackend, *, page: int) -> None:
    """Plan and launch (compile only) batches unlike ``precompile``'s two-sequence one: decodes beside long
    recompute passes, contexts from one tile to thousands of slots, 1 to 64 decode and recompute-pass splits,
    every window."""
    shape = backend.shape
    batches = ([(300, "all"), (40, "decode"), (200, "decode")], [(2000, "subset"), (17, "decode")], [(63, "decode")])
    asked = dict(backend.splits)
    for num_splits in (None, 2, 7, 16, 64):
        backend.splits = {True: num_splits, False: num_splits}
        for seqs in batches:
            case = make_case(seqs=seqs, num_q_heads=shape.num_q_heads, num_kv_heads=shape.num_kv_heads,
                             head_dim=shape.head_dim, page=page).cast(shape.dtype)  # fmt: skip
            plan = backend.plan(case.batch)
            for tiles in (plan.decode, plan.prefill):
                for window in set(shape.sliding_windows) if tiles.num_tiles else ():
                    out = torch.empty_like(case.q)
                    launch_attention(case.q, case.k_cache, case.v_cache, out, plan, tiles, scaling=case.scaling,
                                     window=window, warmup=True)  # fmt: skip
    backend.splits = asked


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") != "1", "compiling needs Triton's compiler, not its interpreter"
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (80: A100, 90: H100)")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--num-q-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page", type=int, default=16)
    parser.add_argument("--window", type=int, default=4096, help="also compile the windowed variants (0: none)")
    args = parser.parse_args()
    options = vars(args) | {"window": args.window or None}
    for report in compile_launches(**options):
        print(json.dumps(report))


if __name__ == "__main__":
    main()
