"""One matrix for the products that read the same input: q, k and v; gate and up.

A layer's q, k and v projections read the same normed hidden states, so one product over their weights stacked by
output gives all three in one operation instead of three (one kernel launch on a GPU, where a link was host-bound at
~42 launches a layer: issue 56); gate and up likewise. The stacked weight is not a copy: the model's own
``q_proj.weight`` (and k's, v's; gate's, up's) is re-pointed at a view of it (``Parameter.data``, values unchanged),
so the model takes no more memory and its own forward (transformers' ``generate``, ``pic check``) reads the same
numbers. Each output column is the same dot product as before; only the matrix library's blocking over the wider
matrix may differ, within float rounding (the oracle tests hold Full Recompute to transformers' logits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Stacked:
    """Linears that read one input, as one matrix.

    Attributes:
        weight: ``[sum(out_i), in_features]``; each linear's weight is a view of its rows.
        bias: ``[sum(out_i)]`` or ``None`` (no linear has one); a linear without one reads zeros there.
        sizes: each linear's ``out_features``, in order.
        members: ``id`` of each linear (its weight is a view of ``weight``).
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    sizes: tuple[int, ...]
    members: tuple[int, ...]

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``x`` ``[N, in_features]`` -> per linear ``[N, out_i]`` (views of one product's output)."""
        return F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)


def stack_linears(linears: list[nn.Linear]) -> Stacked | None:
    """Stack ``linears`` (one input) into one matrix whose row blocks their weights (and biases) become; ``None``
    when they cannot share one (different devices, dtypes or input sizes, or weights that are not plain tensors)."""
    weights = [linear.weight for linear in linears]
    first = weights[0]
    alike = all(
        type(w) is nn.Parameter and (w.device, w.dtype, w.shape[1]) == (first.device, first.dtype, first.shape[1])
        for w in weights
    )
    if not alike or first.device.type == "meta":
        return None
    weight = torch.cat([w.detach() for w in weights])  # [sum(out), in]
    bias = None
    if any(linear.bias is not None for linear in linears):
        bias = torch.cat([linear.weight.new_zeros(linear.out_features) if linear.bias is None else linear.bias.detach()
                          for linear in linears])  # fmt: skip
    start = 0
    for linear in linears:
        end = start + linear.out_features
        linear.weight.data = weight[start:end]
        if linear.bias is not None:
            linear.bias.data = bias[start:end]
        start = end
    sizes = tuple(linear.out_features for linear in linears)
    return Stacked(weight=weight, bias=bias, sizes=sizes, members=tuple(id(linear) for linear in linears))


def is_gated(mlp: nn.Module) -> bool:
    """Whether ``mlp`` is gated, ``down(act(gate(x)) * up(x))`` (Llama's form)."""
    return all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn"))


def stack_layers(layers: nn.ModuleList) -> dict[int, Stacked]:
    """Every layer's q/k/v (keyed by ``id(self_attn)``) and gate/up (keyed by ``id(mlp)``, for gated MLPs) stacked."""
    stacks: dict[int, Stacked] = {}
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        groups = [(attn, [attn.q_proj, attn.k_proj, attn.v_proj])]
        if is_gated(mlp):
            groups.append((mlp, [mlp.gate_proj, mlp.up_proj]))
        for owner, linears in groups:
            if all(isinstance(linear, nn.Linear) for linear in linears):
                stacked = stack_linears(linears)
                if stacked is not None:
                    stacks[id(owner)] = stacked
    return stacks
