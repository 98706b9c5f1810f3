"""Compiling the Triton backend's launches ahead of serving, and what a compiled kernel costs an SM: registers,
stack (spills), shared memory, async-copy stages.

The costs are read from the kernel's own cubin and PTX with the ``cuobjdump`` Triton bundles, so the numbers
are the same whether the kernel was compiled on a GPU (``TritonBackend.precompile`` at engine start) or for
one on a machine without it (``tests/compile_kernels.py``).
"""

from __future__ import annotations

import math
import re
import subprocess
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import torch
import triton

from pic.attention.backend import AttentionShape
from pic.attention.batch import AttentionBatch
from pic.attention.triton_config import launch_config
from pic.attention.triton_launch import launch_attention, launch_store, pow2
from pic.attention.triton_plan import Launch, RotatedK, TritonPlan, warmup_batch
from pic.attention.triton_split import SplitScratch

# Per SM, sm_80 and sm_90: 64K 32-bit registers, allocated per warp in units of 256; at most 64 warps
# and 32 programs; 1 KB of shared memory reserved per program.
REGISTERS_PER_SM = 65536
REGISTER_UNIT = 256
MAX_WARPS_PER_SM = 64
MAX_PROGRAMS_PER_SM = 32
SHARED_PER_SM = {80: 164 * 1024, 86: 100 * 1024, 89: 100 * 1024, 90: 228 * 1024}
RESERVED_SHARED = 1024


class Launches(Protocol):
    """What ``compile_launches`` reads of a backend (``TritonBackend``, which imports this module: a protocol, not
    an import back)."""

    shape: AttentionShape

    def plan(self, batch: AttentionBatch) -> TritonPlan: ...

    def launches(self, device: torch.device) -> dict[str, Launch]: ...


@dataclass(frozen=True)
class CompiledLaunch:
    """A kernel variant ``TritonBackend.precompile`` compiled.

    Attributes:
        name: which launch (``"decode"``, ``"decode split"``, ``"prefill 64"``, ``"prefill 128 once split"``, ...,
            ``"store"``).
        window: compiled for a sliding window.
        kernels: the ``triton.compiler.CompiledKernel`` of each kernel the launch runs: the attention kernel first,
            then ``combine_splits_kernel`` (split launches), then ``rotate_k_kernel`` (``once`` launches).
    """

    name: str
    window: bool
    kernels: list


def compile_launches(backend: Launches, k_cache: torch.Tensor, v_cache: torch.Tensor) -> list[CompiledLaunch]:
    """Every launch of ``backend`` (each window kind) and the KV store, compiled through the JIT's own launch path
    over this cache's layout (``k_cache, v_cache``: ``[num_blocks, block_size, Hkv, D]``, one layer's), so each
    variant compiles exactly as it runs. Nothing is launched; split scratch is allocated, never written."""
    device, shape = k_cache.device, backend.shape
    page, num_kv_heads, head_dim = k_cache.shape[1:]
    plan = backend.plan(warmup_batch(page=page, head_dim=head_dim, device=device))
    q = torch.empty(plan.q_pos.shape[0], shape.num_q_heads, head_dim, dtype=shape.dtype, device=device)
    compiled = []
    for name, launch in backend.launches(device).items():
        scratch = SplitScratch.empty(
            num_programs=plan.decode.num_tiles * num_kv_heads * 2, block_m=launch.block_m, d_pad=pow2(head_dim),
            device=device,
        )  # fmt: skip
        rotated = None
        if launch.rotated_once:  # rows for the warm-up batch's first sequence, as a plan makes them
            config = launch_config(head_dim, "rotate")
            num_slots = plan.kv_pos.shape[1]
            rotated = RotatedK.empty(
                [0], plan.cos.float(), plan.sin.float(), num_seqs=plan.kv_pos.shape[0], num_slots=num_slots,
                num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=shape.dtype, device=device,
                block=math.gcd(config.block_n, num_slots), num_warps=config.num_warps,
            )  # fmt: skip
        tiles = replace(plan.decode, launch=launch, scratch=scratch if launch.split else None, rotated=rotated)
        for window in sorted(set(shape.sliding_windows), key=lambda w: w is not None):
            out = torch.empty_like(q)
            kernels = launch_attention(q, k_cache, v_cache, out, plan, tiles, scaling=1.0, window=window, warmup=True)
            compiled.append(CompiledLaunch(name=name, window=window is not None, kernels=kernels))
    store_rows = torch.zeros(1, dtype=torch.long, device=device)
    k = torch.empty(1, num_kv_heads, head_dim, dtype=k_cache.dtype, device=device)
    store = launch_store(k_cache.flatten(0, 1), v_cache.flatten(0, 1), store_rows, k, k.clone(), warmup=True)
    return compiled + [CompiledLaunch(name="store", window=False, kernels=[store])]


@dataclass(frozen=True)
class KernelResources:
    """One compiled kernel's resources.

    Attributes:
        registers: per thread.
        stack: bytes of local memory per thread (non-zero: registers spilled).
        shared: bytes of shared memory per program.
        num_warps: warps per program.
        async_copies: ``cp.async`` instructions in its PTX (loads issued ahead into shared memory).
        max_wait_group: the largest ``N`` of ``cp.async.wait_group N``: how many copy groups stay in
            flight while the loop computes (0: none, the loop is not pipelined).
        blocks_per_sm: programs an SM holds at once (registers, shared memory and warps permitting).
    """

    registers: int
    stack: int
    shared: int
    num_warps: int
    async_copies: int
    max_wait_group: int
    blocks_per_sm: int


def blocks_per_sm(*, registers: int, shared: int, num_warps: int, arch: int) -> int:
    """Programs of ``num_warps`` warps an SM of compute capability ``arch`` (x10) holds at once."""
    per_warp = triton.cdiv(registers * 32, REGISTER_UNIT) * REGISTER_UNIT
    by_registers = REGISTERS_PER_SM // per_warp // num_warps
    by_shared = SHARED_PER_SM.get(arch, SHARED_PER_SM[80]) // (shared + RESERVED_SHARED)
    return min(by_registers, by_shared, MAX_WARPS_PER_SM // num_warps, MAX_PROGRAMS_PER_SM)


def kernel_resources(compiled, *, arch: int) -> KernelResources:
    """Resources of ``compiled`` (a ``triton.compiler.CompiledKernel`` for CUDA compute capability ``arch``)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        Path(f.name).write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED):(\d+)", usage)}
    ptx = compiled.asm["ptx"]
    waits = [int(n) for n in re.findall(r"cp\.async\.wait_group\s+(\d+)", ptx)]
    registers, shared, num_warps = found["REG"], compiled.metadata.shared, compiled.metadata.num_warps
    return KernelResources(
        registers=registers,
        stack=found.get("STACK", 0),
        shared=shared,
        num_warps=num_warps,
        async_copies=len(re.findall(r"\bcp\.async\.c[ag]\.shared", ptx)),
        max_wait_group=max(waits, default=0),
        blocks_per_sm=blocks_per_sm(registers=registers, shared=shared, num_warps=num_warps, arch=arch),
    )
