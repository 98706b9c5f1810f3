"""RMSNorm as one operation: ``pic::rms_norm``, transformers' arithmetic on the CPU, one Triton kernel on CUDA.

transformers' ``LlamaRMSNorm`` (and Mistral's, Qwen2's, Qwen3's) runs six operations (``pow``, ``mean``, ``add``,
``rsqrt`` and two ``mul``; two casts more in bfloat16): on a GPU six kernel launches, twice a layer, where a link was
host-bound (issue 56). ``pic::rms_norm`` is one operator (``torch.library``): on CUDA one kernel
(``rms_norm_kernel``: the row's squares summed in float32, rounded to the model dtype before the weight multiplies, as
transformers rounds); on the CPU the same operations as transformers' module, bit for bit, behind one dispatch (a
CPU has no launches to save; what it saves there is the Python between them).

The operator is registered on first use (``rms_norm``), not at import.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
from torch import nn

_SCHEMA = "rms_norm(Tensor x, Tensor weight, float eps) -> Tensor"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim, as transformers' ``LlamaRMSNorm`` computes it.

    Args:
        x: ``[..., hidden]`` in the model dtype.
        weight: ``[hidden]``, the model dtype.
        eps: the module's ``variance_epsilon``.

    Returns:
        ``x``'s shape and dtype.
    """
    return _registered()[1](x, weight, eps)


def norm_eps(module: nn.Module) -> float | None:
    """The epsilon of ``module`` when it is transformers' Llama-form RMSNorm (``weight * normed``, a
    ``variance_epsilon``), which ``rms_norm`` computes; ``None`` for any other (the caller runs the module)."""
    eps = getattr(module, "variance_epsilon", None)
    weight = getattr(module, "weight", None)
    if eps is None or not isinstance(weight, torch.Tensor) or not type(module).__name__.endswith("RMSNorm"):
        return None
    if type(module).__name__.startswith("Gemma"):  # (1 + weight): another form
        return None
    return float(eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm.forward``, operation for operation (the CPU implementation)."""
    dtype = x.dtype
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(dtype)


def rms_norm_cuda(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """One ``rms_norm_kernel`` launch (any device Triton runs on: the tests run it under ``TRITON_INTERPRET=1``)."""
    from pic.model.norm_kernel import launch_rms_norm

    return launch_rms_norm(x, weight, eps)


@functools.cache
def _registered() -> tuple[torch.library.Library, object]:
    """The library defining ``pic::rms_norm`` (kept alive with it: the cache holds both) and the operator. On CUDA
    the kernel, or transformers' operations where Triton is not installed (decided here, once, not per call)."""
    library = torch.library.Library("pic", "FRAGMENT")
    library.define(_SCHEMA)
    library.impl("rms_norm", rms_norm_reference, "CPU")
    library.impl("rms_norm", rms_norm_cuda if importlib.util.find_spec("triton") else rms_norm_reference, "CUDA")
    library.impl("rms_norm", rms_norm_reference, "Meta")
    return library, torch.ops.pic.rms_norm.default
