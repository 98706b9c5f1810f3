"""Attention backends over one ``BatchPlan`` contract, and the choice between them.

``TORCH`` is the reference (``reference.py``): plain torch, any device, the oracle the tests hold the
others to. ``TRITON`` is the fused-RoPE paged kernel (``triton_kernels.py``), chosen by default on CUDA.
Both read NoPE K by block table and rotate it at each slot's logical position; both write fresh K/V
with one store per layer.

flash-attn is not a backend: its kernels take K already rotated (or rotate at one contiguous offset
per sequence), so they cannot read a linked request's NoPE K, whose slots carry arbitrary positions.
"""

from __future__ import annotations

import enum
import importlib.util
import os
from collections.abc import Callable

import torch

from pic.attention import reference
from pic.attention.rope import RopeTable
from pic.errors import InvalidInputError


class AttentionBackend(enum.Enum):
    TORCH = "torch"
    TRITON = "triton"


def triton_unavailable(device: torch.device) -> str | None:
    """Why the Triton backend cannot run on ``device`` (``None``: it can)."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (pip install 'pic[triton]')"
    if device.type == "cuda":
        return None
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return f"the Triton kernels run on CUDA, not on {device} (on the CPU in Triton's interpreter: TRITON_INTERPRET=1)"


def select_backend(requested: str, device: torch.device, *, head_dim: int, rope: RopeTable) -> AttentionBackend:
    """The backend for ``PICConfig.attention_backend``: ``"auto"`` takes Triton on CUDA when it is
    installed, else the torch reference; ``"torch"`` and ``"triton"`` force one.

    Raises:
        InvalidInputError: ``"triton"`` where it cannot run (the message says why).
    """
    if requested == "torch":
        return AttentionBackend.TORCH
    reason = triton_unavailable(device)
    if reason is None and (head_dim % 2 or rope.head_dim != head_dim):
        reason = f"head_dim={head_dim} with a rotary table {rope.head_dim} wide (the kernel rotates whole heads)"
    if reason is None and not rope.halves_equal:
        reason = "the rotary table's halves are not equal (the kernel reads the rotate-half layout)"
    if requested == "auto":
        return AttentionBackend.TRITON if reason is None and device.type == "cuda" else AttentionBackend.TORCH
    if reason is not None:
        raise InvalidInputError(f"attention_backend={requested!r} cannot run: {reason}")
    return AttentionBackend.TRITON


# (q, k_cache, v_cache, plan, *, scaling, sliding_window) -> out
AttendFn = Callable[..., torch.Tensor]
# (k_rows, v_rows, rows, k, v) -> None
StoreFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def _torch_store(k_rows: torch.Tensor, v_rows: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    k_rows[rows] = k
    v_rows[rows] = v


def kernels(backend: AttentionBackend) -> tuple[AttendFn, StoreFn]:
    """The backend's attention and store functions (Triton is imported here, on first use)."""
    if backend is AttentionBackend.TRITON:
        from pic.attention import triton_backend

        return triton_backend.paged_attention, triton_backend.store_kv
    return reference.paged_attention, _torch_store
