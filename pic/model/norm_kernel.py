"""``rms_norm_kernel``: one program per row, the row in registers (``pic.model.norm``'s CUDA operator)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, out_ptr, x_stride, out_stride, num_cols, eps, BLOCK: tl.constexpr):
    """``out[r] = w * (x[r] * rsqrt(mean(x[r]^2) + eps))``: squares summed in float32, the normed row rounded to
    the output dtype before the weight multiplies (transformers' order)."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < num_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0).to(tl.float32)
    variance = tl.sum(x * x, axis=0) / num_cols
    normed = (x * (1.0 / tl.sqrt(variance + eps))).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    tl.store(out_ptr + row * out_stride + cols, w * normed, mask=ok)


def launch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x`` ``[..., hidden]``, ``weight`` ``[hidden]`` -> ``x``'s shape and dtype; one launch."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty_like(rows)
    num_cols = rows.shape[1]
    if rows.shape[0]:
        rms_norm_kernel[(rows.shape[0],)](
            rows, weight, out, rows.stride(0), out.stride(0), num_cols, eps, BLOCK=triton.next_power_of_2(num_cols)
        )
    return out.view(x.shape)
