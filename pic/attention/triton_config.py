"""The Triton kernels' launch configurations per head dim, in one table: what ``TritonBackend.launches`` (and so the
plans and ``precompile``, which compiles exactly those launches) reads.

Per head dim and kind of launch: slots per KV tile (``block_n``), warps, software-pipeline stages and the register
cap. The kinds are ``"decode"`` (one token's GQA heads per program), ``"prefill 64"`` (64 rows per program: GPUs
before sm_90 and passes of 64 rows or fewer), ``"prefill 128"`` (128 rows on sm_90 and newer; ``None``: the head dim
never gets it), the same reading K rotated once (``"prefill 64 once"``, ``"prefill 128 once"``: no rotation in the
loop, fewer registers; absent: as the in-loop launch) and ``"rotate"`` (``rotate_k_kernel``: ``block_n`` slots of
one KV head per program, see ``triton_kernels``). A head dim not in the table takes the next larger one's row (the
largest's beyond it).

Measured: head dim 128 (Mistral-7B / Llama shapes): the configuration of the H100 runs in docs/gpu.md (5cd88e0),
and ``tests/compile_kernels.py`` (no spills, the KV loop pipelined, on sm_90 and sm_80). Everything else is
**to be tuned on a GPU**: not timed, only compiled for sm_90 (``python tests/compile_kernels.py --head-dim 64``,
``--head-dim 256``) and kept where nothing spilled: registers per thread (of 255) and ``cp.async`` groups in flight
are noted beside each.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class TileConfig:
    """One launch's configuration.

    Attributes:
        block_n: slots per KV tile (a power of two, at least 16).
        num_warps: warps per program.
        num_stages: KV tiles in flight in the software pipeline (async copies issued ahead).
        max_registers: per thread (PTX ``.maxnreg``; ``None``: ptxas chooses).
    """

    block_n: int
    num_warps: int
    num_stages: int = 3
    max_registers: int | None = None


# ptxas caps some decode variants at 128 registers and spills; 168 leaves room and 3 programs per SM (head dim 128).
LAUNCH_CONFIGS: dict[int, dict[str, TileConfig | None]] = {
    64: {  # to be tuned on a GPU. sm_90: decode 128 registers, prefill 64: 130 (once: 116), prefill 128: 170 (with
        # 128-slot tiles it spilled: 255 and 16 bytes of stack); reading K rotated once it takes them in 217
        "decode": TileConfig(block_n=32, num_warps=4, max_registers=168),
        "prefill 64": TileConfig(block_n=64, num_warps=4),
        "prefill 128": TileConfig(block_n=64, num_warps=8),
        "prefill 128 once": TileConfig(block_n=128, num_warps=8),
        "rotate": TileConfig(block_n=64, num_warps=4, num_stages=1),
    },
    128: {  # measured (H100, docs/gpu.md): the largest KV tiles each compiles without spilling. sm_90: decode 141
        # registers, prefill 64: 168, prefill 128: 245; reading K rotated once 160 and 197 (to be tuned: room for more)
        "decode": TileConfig(block_n=32, num_warps=4, max_registers=168),
        "prefill 64": TileConfig(block_n=32, num_warps=4),
        "prefill 128": TileConfig(block_n=64, num_warps=8),
        "rotate": TileConfig(block_n=64, num_warps=4, num_stages=1),  # to be tuned on a GPU (a memory-bound copy)
    },
    256: {  # to be tuned on a GPU: a 128 x 256 float32 accumulator alone is 128 registers a thread on 8 warps, so no
        # 128-row tile. sm_90: decode 166 registers, prefill 64: 234 (once: 178), 2 copy groups in flight (with 2
        # stages none were: the loop did not pipeline)
        "decode": TileConfig(block_n=32, num_warps=4),
        "prefill 64": TileConfig(block_n=32, num_warps=8),
        "prefill 128": None,
        "rotate": TileConfig(block_n=32, num_warps=4, num_stages=1),
    },
}

# A recompute pass launch reads K rotated once per layer and forward (``rotate_k_kernel``) instead of rotating it
# in the KV loop when its sequences have on average at least this many query tiles each: in the loop every query
# tile rotates every KV tile it visits again; rotated once, K costs one more read and write of itself per layer.
# To be tuned on a GPU (benchmarks/attention.py times both at 512 rows, 16 tiles of 128 rows).
ROTATE_ONCE_MIN_TILES = 4
# The most bytes of rotated K one forward keeps (one layer's, rewritten by each): past it, rotation stays in the loop.
ROTATE_ONCE_MAX_BYTES = 1 << 30


def launch_config(head_dim: int, kind: str) -> TileConfig | None:
    """The ``kind`` launch's configuration for ``head_dim`` (``None``: that launch is not used at this head dim); a
    ``"... once"`` kind the row does not hold is its in-loop launch's."""
    row = _row(head_dim)
    return row[kind] if kind in row else row[kind.removesuffix(" once")]


def _row(head_dim: int) -> dict[str, TileConfig | None]:
    dims = sorted(LAUNCH_CONFIGS)
    return LAUNCH_CONFIGS[next((d for d in dims if d >= head_dim), dims[-1])]


def slot_step(head_dim: int) -> int:
    """A multiple of every ``block_n`` the table holds for ``head_dim``: plans pad their slots to it."""
    return max(c.block_n for c in _row(head_dim).values() if c is not None)


@contextmanager
def overridden(head_dim: int, kind: str, config: TileConfig | None) -> Iterator[None]:
    """``kind``'s configuration for ``head_dim``'s row set to ``config`` inside the block (backends built and plans
    made inside it read it), restored after: ``benchmarks/attention.py --tune`` sweeps the table this way."""
    row = _row(head_dim)
    had, old = kind in row, row.get(kind)
    row[kind] = config
    try:
        yield
    finally:
        if had:
            row[kind] = old
        else:
            del row[kind]
