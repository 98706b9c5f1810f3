"""The matrix products of a decode step: the model's own float weights, or int8 copies of the large ones.

One token's decode step on a CPU is bound by streaming the weights through matrix-vector products (SmolLM2-135M: 540 MB
of float32 per token, much of a step on one thread). fbgemm's int8 products with dynamic activation quantization
(``torch.ops.quantized.linear_dynamic``) read a quarter of the bytes and ran one token's products several times faster
on this machine's CPU, on every matrix but the smallest (576x192 alone lost); packed with q (one 960x576 product) k and
v gain too (``benchmarks/cpu_matmul.py``; the figures:
docs/cpu.md#decode-on-smollm2-what-a-step-spends-and-what-made-it-faster). A packed matrix with fewer than
``INT8_MIN_WEIGHTS`` weights keeps its float products.

``DecodeWeights.INT8`` is an optional mode, not exact: weights are quantized per output channel (symmetric), and
each product quantizes its input per tensor, over the step's rows, at run time; so a sequence's tokens depend a
little on which others decode beside it. Only decode steps of at most ``INT8_MAX_ROWS`` sequences use it (forwards in
which every sequence decodes its next token, ``SeqInput.decode``, and the LM head over their rows; larger decode
batches read the model's weights, where int8 lost): compiles, recompute passes and every prompt's first
token stay in float, so the compiled KV and the cache ids are the same as without it. The int8 copies are made once,
when the engine is built, and add about a quarter of the float32 weights' bytes; the model's own modules are not
changed.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from pic.config import DecodeWeights
from pic.errors import InvalidInputError, UnsupportedModelError
from pic.model.stacked import Stacked, is_gated

# Packed matrices with fewer weights keep their float products in int8 mode (576x192 alone: int8 was slower).
INT8_MIN_WEIGHTS = 1 << 18
# Decode steps of more sequences read the model's own weights in int8 mode: fbgemm's dynamic int8 products lost there
# to float32 and bfloat16 (SmolLM2 at 2K tokens, one thread, benchmarks/cpu_dtype.py: docs/cpu.md#float32-or-bfloat16).
INT8_MAX_ROWS = 4


class FloatProducts:
    """The model's own weights: what every forward but an int8 decode step runs.

    Args:
        stacks: q/k/v (by ``id(self_attn)``) and gate/up (by ``id(mlp)``) stacked as one matrix each
            (``pic.model.stacked``): one product each; a module without one runs its linears apart.
    """

    def __init__(self, stacks: dict[int, Stacked] | None = None) -> None:
        self._stacks = stacks or {}

    def qkv(self, attn: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The attention's q, k and v projections of ``x`` ``[N, hidden_size]``: ``[N, out_features]`` each."""
        parts = self._stacked(attn, x)
        if parts is None:
            return self.linear(attn.q_proj, x), self.linear(attn.k_proj, x), self.linear(attn.v_proj, x)
        q, k, v = parts
        return q, k, v

    def linear(self, module: nn.Linear, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``[N, in_features]`` -> ``[N, out_features]``, plus ``residual`` ``[N, out_features]`` if given
        (added by the product itself, ``addmm``: one operation, not two)."""
        if residual is None:
            return self._one(module, x)
        if module.bias is not None or x.dim() != 2:
            return residual + self._one(module, x)
        return torch.addmm(residual, x, module.weight.t())

    def mlp(self, mlp: nn.Module, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's MLP over ``x`` ``[N, hidden_size]``, plus ``residual`` if given. A gated MLP whose gate and up
        are stacked runs them as one product; any other runs its module."""
        parts = self._stacked(mlp, x)
        if parts is None:
            return mlp(x) if residual is None else residual + mlp(x)
        gate, up = parts
        return self.linear(mlp.down_proj, mlp.act_fn(gate) * up, residual)

    def _stacked(self, owner: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """``owner``'s stacked linears over ``x`` (``[N, out_i]`` each), or ``None`` when they are not stacked."""
        stacked = self._stacks.get(id(owner))
        return None if stacked is None else stacked(x)

    def _one(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """One linear over ``x``."""
        return module(x)


class Int8Products(FloatProducts):
    """int8 copies of a model's large linear layers (every decoder layer's, and the LM head), made once.

    Products that read the same input are packed as one matrix: q, k and v (one product instead of three, and one
    quantization of the input), gate and up; o, down and the LM head on their own. Per output channel, that is the
    same arithmetic as separate products (the input's scale is per tensor either way).

    Args:
        layers: the model's decoder layers; each MLP must be gated (``down(act(gate(x)) * up(x))``).
        lm_head: the output projection.

    Raises:
        InvalidInputError: the model is not float32 or bfloat16 on the CPU, or torch has no fbgemm/x86 quantized
            engine.
        UnsupportedModelError: an MLP of another form.
    """

    def __init__(self, layers: nn.ModuleList, lm_head: nn.Linear, stacks: dict[int, Stacked] | None = None) -> None:
        super().__init__(stacks)
        weight = lm_head.weight
        if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
            raise InvalidInputError(
                f"decode_weights='int8' needs a float32 or bfloat16 model on the CPU (fbgemm's int8 products); this "
                f"one is {weight.dtype} on {weight.device}"
            )
        engines = torch.backends.quantized.supported_engines
        if not {"x86", "fbgemm"} & set(engines):
            raise InvalidInputError(f"decode_weights='int8' needs torch's x86 or fbgemm quantized engine: {engines}")
        # id(module) -> (fbgemm's packed weight, output sizes of the linears packed in it)
        self._packed: dict[int, tuple[torch.ScriptObject, list[int]]] = {}
        self.num_bytes = 0  # of int8 weights (a byte each)
        self._add(lm_head, [lm_head])
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            _check_gated(mlp)
            self._add(attn, [attn.q_proj, attn.k_proj, attn.v_proj])
            self._add(attn.o_proj, [attn.o_proj])
            self._add(mlp, [mlp.gate_proj, mlp.up_proj])
            self._add(mlp.down_proj, [mlp.down_proj])

    def linear(self, module: nn.Linear, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if id(module) not in self._packed:
            return super().linear(module, x, residual)
        out = self._run(module, x)[0]
        return out if residual is None else residual + out

    def _stacked(self, owner: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        return tuple(self._run(owner, x)) if id(owner) in self._packed else super()._stacked(owner, x)

    def _add(self, owner: nn.Module, linears: list[nn.Linear]) -> None:
        """Pack ``linears`` (one input) as one int8 matrix under ``owner``, if it has ``INT8_MIN_WEIGHTS`` weights."""
        num_weights = sum(linear.weight.numel() for linear in linears)
        if num_weights >= INT8_MIN_WEIGHTS:
            self._packed[id(owner)] = (_pack(linears), [linear.out_features for linear in linears])
            self.num_bytes += num_weights

    def _run(self, owner: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
        """``x`` ``[N, in_features]`` through ``owner``'s packed matrix, split per linear: ``[N, out_i]`` views."""
        packed, sizes = self._packed[id(owner)]
        # reduce_range: 7-bit activations, torch's default for these engines (no overflow without VNNI either).
        # fbgemm reads and writes float32: a bfloat16 model's rows are widened and the products narrowed back.
        out = torch.ops.quantized.linear_dynamic(x.float(), packed, True).to(x.dtype)
        return list(out.split(sizes, dim=-1))


class PackedProducts(FloatProducts):
    """A bfloat16 CPU model's linear layers through oneDNN with weights packed once (``mkldnn._reorder_linear_weight``).

    ``F.linear`` on a bfloat16 CPU tensor reorders the weight into oneDNN's blocked layout on every call; packed once,
    the same products (bit for bit: the same kernel, measured equal at 1 to 2,048 rows) ran faster, most for one row
    (a decode step), on this AVX512-BF16 CPU, one thread (docs/cpu.md#float32-or-bfloat16). float32 gained nothing,
    so float32 models keep ``FloatProducts``. The packed copies add the
    bfloat16 weights' bytes once more (the model's own stay: transformers' forward, ``pic check``, reads them).

    Args:
        layers, lm_head: as ``Int8Products``; an MLP of another form than gated keeps its module.
    """

    def __init__(self, layers: nn.ModuleList, lm_head: nn.Linear, stacks: dict[int, Stacked] | None = None) -> None:
        super().__init__(stacks)
        # id(linear), or id(owner) of a stack (``pic.model.stacked``) -> (packed weight, bias, output sizes)
        self._packed: dict[int, tuple[torch.Tensor, torch.Tensor | None, tuple[int, ...]]] = {}
        self.num_bytes = 0
        in_stacks = set()
        for key, stacked in self._stacks.items():
            self._pack(key, stacked.weight, stacked.bias, stacked.sizes)
            in_stacks.update(stacked.members)
        for linear in [lm_head, *(m for m in layers.modules() if isinstance(m, nn.Linear))]:
            if id(linear) not in in_stacks:
                self._pack(id(linear), linear.weight, linear.bias, (linear.out_features,))

    def linear(self, module: nn.Linear, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        out = self._one(module, x)
        return out if residual is None else residual + out  # (oneDNN's fused add rounds once: not transformers')

    def _stacked(self, owner: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        return self._run(id(owner), x) if id(owner) in self._packed else None

    def _one(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return self._run(id(module), x)[0] if id(module) in self._packed else module(x)

    def _pack(self, key: int, weight: torch.Tensor, bias: torch.Tensor | None, sizes: tuple[int, ...]) -> None:
        weight = weight.detach()
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        self._packed[key] = (packed, None if bias is None else bias.detach(), sizes)
        self.num_bytes += weight.numel() * weight.element_size()

    def _run(self, key: int, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        packed, bias, sizes = self._packed[key]
        out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        return out.split(sizes, dim=-1) if len(sizes) > 1 else (out,)


def model_products(
    layers: nn.ModuleList, lm_head: nn.Linear, stacks: dict[int, Stacked] | None = None
) -> FloatProducts:
    """The products of every forward but an int8 decode step: packed for a bfloat16 model on a CPU where oneDNN runs
    bfloat16 (``_is_mkldnn_bf16_supported``: AVX512 or newer), the model's own weights otherwise; ``stacks``: the
    layers' stacked q/k/v and gate/up (``pic.model.stacked``)."""
    weight = lm_head.weight
    if weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and _mkldnn_bf16():
        return PackedProducts(layers, lm_head, stacks)
    return FloatProducts(stacks)


def _mkldnn_bf16() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def products_for(
    mode: DecodeWeights, layers: nn.ModuleList, lm_head: nn.Linear, *, model: FloatProducts
) -> FloatProducts:
    """The decode step's products for ``mode`` (``model``: the other forwards', which ``"model"`` shares, and whose
    stacks int8's unpacked linears run)."""
    return Int8Products(layers, lm_head, model._stacks) if mode == DecodeWeights.INT8 else model


def _check_gated(mlp: nn.Module) -> None:
    if not is_gated(mlp):
        raise UnsupportedModelError(
            f"decode_weights='int8' runs gated MLPs (gate_proj, up_proj, down_proj, act_fn), not {type(mlp).__name__}"
        )


def _pack(linears: list[nn.Linear]) -> torch.ScriptObject:
    """fbgemm's prepacked int8 weight of ``linears`` stacked by output (per output channel, symmetric) and their float
    biases (zeros for a linear without one, when another has one)."""
    weight = torch.cat([linear.weight.detach().float() for linear in linears])  # [sum(out), in]
    scales = (weight.abs().amax(1) / 127).clamp(min=1e-12).double()  # [sum(out)]
    zeros = torch.zeros(weight.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # torch deprecates quantized tensors (pytorch#184982); the op is what runs
        warnings.simplefilter("ignore", UserWarning)
        qweight = torch.quantize_per_channel(weight, scales, zeros, 0, torch.qint8)
    bias = None
    if any(linear.bias is not None for linear in linears):
        bias = torch.cat([weight.new_zeros(linear.out_features) if linear.bias is None else linear.bias.detach().float()
                          for linear in linears])  # fmt: skip
    return torch.ops.quantized.linear_prepack(qweight, bias)
