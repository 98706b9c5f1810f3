"""The choice of attention backend for ``PICConfig.attention_backend``.

flash-attn is not a backend: its kernels take K already rotated (or rotate at one contiguous offset
per sequence), so they cannot read a linked request's NoPE K, whose slots carry arbitrary positions.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from pic.attention.backend import AttentionBackend, AttentionShape
from pic.attention.rope import RopeTable
from pic.attention.torch_backend import TorchBackend
from pic.config import AttentionBackendName
from pic.errors import InvalidInputError


def triton_unavailable(device: torch.device) -> str | None:
    """Why the Triton backend cannot run on ``device`` (``None``: it can)."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (pip install 'pic-kv[triton]')"
    if device.type == "cuda":
        return None
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return f"the Triton kernels run on CUDA, not on {device} (on the CPU in Triton's interpreter: TRITON_INTERPRET=1)"


def select_backend(
    requested: AttentionBackendName | str,
    shape: AttentionShape,
    *,
    device: torch.device,
    rope: RopeTable,
    decode_kv_dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """The backend for ``requested``: ``"auto"`` takes Triton on CUDA when it is installed and can run
    the model, else the torch backend; ``"torch"`` and ``"triton"`` force one. Triton is imported
    here, only when chosen.

    Args:
        requested: an ``AttentionBackendName`` or its value: ``"auto"``, ``"torch"`` or ``"triton"``.
        shape: the model's attention shape.
        device: where the model and its KV live.
        rope: the engine's rotary table (the kernel reads the rotate-half layout, ``head_dim`` wide).
        decode_kv_dtype: the torch backend's ``decode_kv_dtype`` (``None``: the model's; Triton ignores it).

    Raises:
        InvalidInputError: ``"triton"`` where it cannot run (the message says why).
    """
    try:
        requested = AttentionBackendName(requested)
    except ValueError:
        names = ", ".join(repr(str(n)) for n in AttentionBackendName)
        raise InvalidInputError(f"attention_backend={requested!r} is none of {names}") from None
    if requested is AttentionBackendName.TORCH:
        return TorchBackend(shape, decode_kv_dtype=decode_kv_dtype)
    head_dim = shape.head_dim
    reason = triton_unavailable(device)
    if reason is None and (head_dim % 2 or rope.head_dim != head_dim):
        reason = f"head_dim={head_dim} with a rotary table {rope.head_dim} wide (the kernel rotates whole heads)"
    if reason is None and not rope.halves_equal:
        reason = "the rotary table's halves are not equal (the kernel reads the rotate-half layout)"
    if requested is AttentionBackendName.AUTO and (reason is not None or device.type != "cuda"):
        return TorchBackend(shape, decode_kv_dtype=decode_kv_dtype)
    if reason is not None:
        raise InvalidInputError(f"attention_backend='{requested}' cannot run: {reason}")
    from pic.attention.triton_backend import TritonBackend

    return TritonBackend(shape)
