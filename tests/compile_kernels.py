"""Compile pic's Triton kernels for NVIDIA GPUs on a machine without one, and report their resources.

python tests/compile_kernels.py [--arch 90] [--dtype bf16] [--group 4] [--head-dim 128] ...

Triton's compiler and its bundled ptxas need no GPU: this catches what the interpreter tolerates (a dot
too small, a branch yielding different types, a constexpr it cannot lower) and reports registers and
stack (spills) per configuration, read from the cubin with the bundled ``cuobjdump``. Prints one JSON
line per kernel. Must run without ``TRITON_INTERPRET`` (the test runs it in a subprocess).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pic.attention.triton_kernels import combine_splits_kernel, paged_attention_kernel, store_kv_kernel

INT_POINTERS = ("rope_off_ptr", "tile_seq_ptr", "tile_row_ptr", "cu_q_ptr", "q_pos_ptr", "tables_ptr")
INT_POINTERS += ("kv_pos_ptr", "kv_len_ptr")


def _compile(fn, types: dict[str, str], constants: dict, *, arch: int, num_warps: int) -> dict:
    signature = {n: "constexpr" if n in constants else types.get(n, "i32") for n in fn.arg_names}
    source = ASTSource(fn=fn, signature=signature, constexprs=constants)
    kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        Path(f.name).write_bytes(kernel.asm["cubin"])
        tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        usage = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = dict(re.findall(r"(REG|STACK|SHARED):(\d+)", usage))
    resources = {k.lower(): int(v) for k, v in found.items()}
    return {"kernel": fn.__name__, "arch": arch, "num_warps": num_warps, **resources}


def compile_attention(*, arch, dtype, group, head_dim, block_m, block_n, splits, window, num_warps) -> dict:
    split_out = "fp32" if splits > 1 else dtype
    types = dict.fromkeys(INT_POINTERS, "*i32") | {"cos_ptr": "*fp32", "sin_ptr": "*fp32", "sm_scale_log2": "fp32"}
    types |= {"q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}"}
    types |= {"out_ptr": f"*{split_out}", "part_ml_ptr": f"*{split_out}"}
    d_pad = max(16, triton.next_power_of_2(head_dim))
    constants = dict(
        GROUP=group, HEAD_DIM=head_dim, HALF_PAD=max(16, triton.next_power_of_2(head_dim // 2)), D_PAD=d_pad,
        BLOCK_M=block_m, BLOCK_N=block_n, PAGE=16, SPLIT_KV=splits > 1, HAS_WINDOW=window,
        DOT_PRECISION="ieee" if dtype == "fp32" else None,
    )  # fmt: skip
    report = _compile(paged_attention_kernel, types, constants, arch=arch, num_warps=num_warps)
    report |= {"dtype": dtype, "group": group, "head_dim": head_dim, "block_m": block_m, "block_n": block_n}
    report |= {"splits": splits, "window": window}
    if splits > 1:
        types = {"part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "out_ptr": f"*{dtype}"}
        types |= dict.fromkeys(("tile_seq_ptr", "tile_row_ptr", "cu_q_ptr"), "*i32")
        constants = dict(GROUP=group, HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_M=block_m)
        report["combine"] = _compile(combine_splits_kernel, types, constants, arch=arch, num_warps=4)
    return report


def compile_store(*, arch: int, dtype: str, width: int) -> dict:
    types = {"k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", "k_rows_ptr": f"*{dtype}", "v_rows_ptr": f"*{dtype}"}
    types["rows_ptr"] = "*i64"
    constants = dict(WIDTH=width, BLOCK=min(1024, triton.next_power_of_2(width)))
    return _compile(store_kv_kernel, types, constants, arch=arch, num_warps=4)


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") != "1", "compiling needs Triton's compiler, not its interpreter"
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (80: A100, 90: H100)")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-m", type=int, default=64)
    parser.add_argument("--block-n", type=int, default=64)
    parser.add_argument("--splits", type=int, default=1)
    parser.add_argument("--window", action="store_true")
    parser.add_argument("--num-warps", type=int, default=8)
    parser.add_argument("--defaults", action="store_true", help="the engine's launches for a Mistral-7B shape")
    args = parser.parse_args()
    if args.defaults:
        for report in engine_defaults(arch=args.arch, dtype=args.dtype):
            print(json.dumps(report))
        return
    print(json.dumps(compile_attention(**{k: v for k, v in vars(args).items() if k != "defaults"})))


def engine_defaults(*, arch: int, dtype: str) -> list[dict]:
    """What the engine launches for 32 query / 8 KV heads of 128 (Mistral-7B): prefill tiles (with and
    without a window), decode tiles with and without splits, and the store."""
    shape = dict(arch=arch, dtype=dtype, group=4, head_dim=128, num_warps=8)
    return [
        compile_attention(**shape, block_m=64, block_n=64, splits=1, window=False),
        compile_attention(**shape, block_m=64, block_n=64, splits=1, window=True),
        compile_attention(**shape, block_m=16, block_n=64, splits=1, window=False),
        compile_attention(**shape, block_m=16, block_n=64, splits=8, window=False),
        compile_store(arch=arch, dtype=dtype, width=8 * 128),
    ]


if __name__ == "__main__":
    main()
