"""Where the oracle and engine tests run, and how close they must come there.

``PIC_TEST_DEVICE``: ``cpu`` (default) or ``cuda``; ``PIC_TEST_DTYPE``: ``float32`` (default) or ``bfloat16``.
A GPU session re-verifies with::

    PIC_TEST_DEVICE=cuda python -m pytest -q tests/test_oracle.py tests/test_engine.py tests/test_cuda_paths.py
    PIC_TEST_DEVICE=cuda PIC_TEST_DTYPE=bfloat16 python -m pytest -q tests/test_oracle.py tests/test_engine.py \
        tests/test_cuda_paths.py

Any other value, or ``cuda`` where torch sees no GPU, stops the run with a usage error (no test is
skipped for it). The other test files build their models with ``model(family)`` and stay on the CPU in
float32 whatever these say. On CUDA the engine takes its default attention backend (``"auto"``: the
Triton kernel); conftest.py leaves ``TRITON_INTERPRET`` unset there.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import pytest
import torch

DEVICES = ("cpu", "cuda")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Target:
    device: torch.device
    dtype: torch.dtype

    @property
    def exact_dtype(self) -> torch.dtype:
        """The dtype of tests that compare pic with itself token for token across batches (batched against
        one at a time, preempted against not): float32 in place of bfloat16. Batching changes matrix shapes,
        so kernels round differently; in bfloat16 (8 bits of mantissa, logits quantized to 1/32 near 5)
        that flips greedy near-ties and exact ties alike, in float32 it does not on these models (on the
        CPU the float64 soak, test_engine_soak.py, rules even that out)."""
        return torch.float32 if self.dtype == torch.bfloat16 else self.dtype


@functools.cache
def target() -> Target:
    """The device and dtype the environment asks for.

    Raises:
        pytest.UsageError: an unknown device or dtype, or CUDA asked for where there is none.
    """
    device = os.environ.get("PIC_TEST_DEVICE", "cpu")
    dtype = os.environ.get("PIC_TEST_DTYPE", "float32")
    if device not in DEVICES:
        raise pytest.UsageError(f"PIC_TEST_DEVICE={device!r}: expected one of {', '.join(DEVICES)}")
    if dtype not in DTYPES:
        raise pytest.UsageError(f"PIC_TEST_DTYPE={dtype!r}: expected one of {', '.join(DTYPES)}")
    if device == "cuda" and not torch.cuda.is_available():
        build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", a build without CUDA")
        raise pytest.UsageError(f"PIC_TEST_DEVICE=cuda but torch sees no CUDA device ({build})")
    return Target(device=torch.device(device), dtype=DTYPES[dtype])


@dataclass(frozen=True)
class Tolerances:
    """How close pic must come to transformers (tests/test_oracle.py) and to itself across batches.

    Attributes:
        logits: float32: the largest ``|pic - transformers|`` of Full Recompute's logits, both in float32
            on the device. bfloat16: the slack added to the relative bound below.
        hf_error_factor: bfloat16 only (``None`` in float32). Both sides round differently there (pic
            rotates K in float32 inside its kernel, transformers rotates in bfloat16; other shapes, other
            GEMM kernels), so pic is held to transformers' own bfloat16 error instead: its distance to
            transformers' float32 logits may be ``hf_error_factor`` times transformers' bfloat16 distance
            to them, plus ``logits``. Measured on the CPU (torch reference backend): transformers' bfloat16
            error is 0.09-0.17 on the tiny models and 0.19-0.34 on stories260K, pic's 0.09-0.31; a real
            fault (stale KV, Naive instead of Full) is off by 1.7-6.4.
        exact_greedy: greedy tokens must equal transformers' ``generate`` token for token (the CPU in
            float32, as ever). Elsewhere a greedy choice may flip where the two best logits are closer than
            twice the error: the tiny models' top-2 margins go down to 4e-5 in float32 (qwen3) and tie
            exactly in bfloat16 (logits quantized to 1/32 near 5). There tokens must equal up to the first
            such near-tie and, all along, be near-argmax choices of transformers' float32 logits on pic's
            own continuation (test_oracle.py, ``assert_near_hf``).
        batch_logits: the largest ``|batched - one at a time|`` of a linked request's logits
            (tests/test_engine.py). 0 on the CPU, measured; rounding noise of other shapes on CUDA; in
            bfloat16 that noise is of the size of pic's distance to transformers there (0.1-0.3), while a
            request reading another's KV or positions is off by more than 1.7.
    """

    logits: float
    hf_error_factor: float | None = None
    batch_logits: float = 1e-4
    exact_greedy: bool = False

    def bound(self, hf_error: float = 0.0) -> float:
        """The logits bound of a case whose transformers run in the test dtype is ``hf_error`` off its
        float32 run (0 in float32)."""
        return self.logits + (self.hf_error_factor or 0.0) * hf_error


def tolerances() -> Tolerances:
    """The target's tolerances: CPU float32 as ever (1e-4: the same kernels up to summation order, measured
    1.4e-5 at most); CUDA float32 1e-3 (cuBLAS picks other GEMM kernels for pic's [tokens, hidden] rows than
    for transformers' [1, tokens, hidden], and the Triton kernel sums in another order than SDPA; both in
    true float32, no TF32); bfloat16 relative to transformers' own bfloat16 error (see ``Tolerances``)."""
    t = target()
    if t.dtype == torch.bfloat16:
        return Tolerances(logits=0.05, hf_error_factor=2.0, batch_logits=0.75)
    if t.device.type == "cpu":
        return Tolerances(logits=1e-4, batch_logits=1e-4, exact_greedy=True)
    return Tolerances(logits=1e-3, batch_logits=1e-3)
