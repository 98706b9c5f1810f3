"""Which dtype a model runs in: the names ``pic.load(dtype=...)`` takes, and ``"auto"``'s choice per device and CPU.

Why the CPU's flags decide: oneDNN runs bfloat16 products on AMX-BF16 or AVX512-BF16 units, where products of many
rows, and with ``pic.attention.gemm`` a link, run several times faster in bfloat16 than in float32 (the figures:
docs/cpu.md#float32-or-bfloat16). Without those units torch computes bfloat16
through float32 conversions, slower than float32 itself. On CUDA, bfloat16.

``"auto"`` is what ``PIC.from_pretrained`` runs when no dtype is given on a GPU. On the CPU the default is chosen by
evidence, not by speed alone: bfloat16 would become it only where its answers stay within ``CPU_BF16_MAX_LOSS`` of
float32's on every cell of the default's grid (paired, ``benchmarks/dtype_answers.py``), and they do not (one cell
loses more: docs/cpu.md, and ``tests/test_dtypes.py`` holds this choice to that file). So float32 stays (exact against
transformers), and ``dtype="auto"`` asks for the CPU's fast one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from pic.errors import InvalidInputError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
AUTO = "auto"
# The most a grid cell's answers may lose in bfloat16 against float32 (a fraction of its cases) for bfloat16 to be
# the CPU's default: the bar issue 66 set, against the grid's paired differences.
CPU_BF16_MAX_LOSS = 0.02
CPU_DEFAULT = torch.float32
CPU_DEFAULT_REASON = (
    f"the CPU's default: bfloat16's answers are not within {100 * CPU_BF16_MAX_LOSS:g} points of float32's on every "
    "grid cell"
)


class Bf16Unit(str, enum.Enum):
    """The CPU's bfloat16 product unit, as torch reports it (``torch.cpu._is_*_supported``)."""

    AMX = "AMX-BF16"
    AVX512 = "AVX512-BF16"
    NONE = "none"


def cpu_bf16_unit() -> Bf16Unit:
    """This CPU's bfloat16 unit (AMX tiles come with AMX-BF16 on every CPU that has them)."""
    if getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        return Bf16Unit.AMX
    if getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)():
        return Bf16Unit.AVX512
    return Bf16Unit.NONE


@dataclass(frozen=True)
class DtypeChoice:
    """A resolved dtype and why (``pic check``, ``pic demo`` and ``pic serve`` print ``reason``).

    Attributes:
        dtype: what the model runs in.
        reason: one line: asked for, or chosen for the device (and the CPU's bfloat16 unit).
    """

    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def choose_dtype(dtype: str | torch.dtype | None, device: torch.device, *, unit: Bf16Unit | None = None) -> DtypeChoice:
    """The dtype for ``dtype`` on ``device``.

    Args:
        dtype: a name of ``DTYPES`` (``"torch.bfloat16"`` too), a torch dtype, ``"auto"`` (CUDA: bfloat16; CPU:
            bfloat16 where the CPU has a bfloat16 unit, else float32) or ``None`` (CUDA: bfloat16; CPU: float32).
        unit: the CPU's bfloat16 unit (default: ``cpu_bf16_unit()``; tests give each answer).

    Raises:
        InvalidInputError: not one of those.
    """
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return DtypeChoice(dtype, "asked for")
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        return DtypeChoice(DTYPES[dtype.removeprefix("torch.")], "asked for")
    if dtype is not None and dtype != AUTO:
        raise InvalidInputError(f"dtype {dtype!r} is not one of {', '.join([*DTYPES, AUTO])}")
    if device.type == "cuda":
        return DtypeChoice(torch.bfloat16, "the GPU's default")
    unit = cpu_bf16_unit() if unit is None else unit
    if dtype is None:
        faster = "" if unit is Bf16Unit.NONE else f"; dtype='auto' would run bfloat16 ({unit.value})"
        return DtypeChoice(CPU_DEFAULT, f"{CPU_DEFAULT_REASON}{faster}")
    if unit is Bf16Unit.NONE:
        return DtypeChoice(torch.float32, "auto: this CPU has neither AMX-BF16 nor AVX512-BF16")
    return DtypeChoice(torch.bfloat16, f"auto: this CPU has {unit.value}")
