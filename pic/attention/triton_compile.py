"""What a compiled Triton kernel costs an SM: registers, stack (spills), shared memory, async-copy stages.

Read from the kernel's own cubin and PTX with the ``cuobjdump`` Triton bundles, so the numbers are the
same whether the kernel was compiled on a GPU (``TritonBackend.precompile`` at engine start) or for
one on a machine without it (``tests/compile_kernels.py``).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import triton

# Per SM, sm_80 and sm_90: 64K 32-bit registers, allocated per warp in units of 256; at most 64 warps
# and 32 programs; 1 KB of shared memory reserved per program.
REGISTERS_PER_SM = 65536
REGISTER_UNIT = 256
MAX_WARPS_PER_SM = 64
MAX_PROGRAMS_PER_SM = 32
SHARED_PER_SM = {80: 164 * 1024, 86: 100 * 1024, 89: 100 * 1024, 90: 228 * 1024}
RESERVED_SHARED = 1024


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
