"""What pic needs to know about a Hugging Face model, read once, and the check that it can run it.

pic runs the model's own modules layer by layer (see ``runner.py``), so it supports the families
whose decoder layer has the Llama shape: ``input_layernorm -> self_attn(q/k/v/o_proj[, q_norm,
k_norm]) -> residual -> post_attention_layernorm -> mlp -> residual``, with one rotary module at
``model.model.rotary_emb``. Anything else is refused with a clear error instead of a wrong answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pic.errors import UnsupportedModelError

# Families whose layers pic runs exactly as transformers does (checked against HF by the tests).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelSpec:
    """Shapes and per-layer options of a supported model."""

    model_type: str
    architecture: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int
    has_qk_norm: bool
    # Per layer: attend only to keys with position > query position - window (None: full causal).
    sliding_windows: tuple[int | None, ...]
    dtype: torch.dtype
    device: torch.device

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V of one token over all layers (what a cached token costs)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize


def _architecture(model: nn.Module) -> str:
    archs = getattr(model.config, "architectures", None) or [type(model).__name__]
    return archs[0]


def _layer_window(config, attn: nn.Module) -> int | None:
    # Qwen2/Qwen3 set `sliding_window` per layer (None on full-attention layers); Mistral reads the
    # config for every layer.
    if hasattr(attn, "sliding_window"):
        return attn.sliding_window
    return getattr(config, "sliding_window", None)


# Config fields through which transformers' model families declare rotary embeddings.
_ROPE_CONFIG_FIELDS = ("rope_parameters", "rope_theta", "rope_scaling", "rotary_dim", "rotary_pct", "rotary_emb_base")


def _has_rope(model: nn.Module) -> bool:
    """Whether the model uses rotary position embeddings, whatever its layer layout (GPT-NeoX and GPT-J
    keep them elsewhere than Llama does)."""
    if getattr(model.config, "alibi", False):  # Falcon with ALiBi keeps rope fields it does not use
        return False
    if any(getattr(model.config, name, None) is not None for name in _ROPE_CONFIG_FIELDS):
        return True
    return any("rotary" in type(m).__name__.lower() for m in model.modules())


def inspect_model(model: nn.Module) -> ModelSpec:
    """Check that pic can run ``model`` and read its shapes.

    Raises:
        UnsupportedModelError: the model has no rotary embeddings, or its family's layer layout is
            not one pic runs (the message names the architecture and the supported families).
    """
    config = model.config
    model_type = getattr(config, "model_type", type(model).__name__)
    arch = _architecture(model)
    supported = ", ".join(SUPPORTED_MODEL_TYPES)
    if not _has_rope(model):
        raise UnsupportedModelError(
            f"{arch} (model_type {model_type!r}) has no rotary position embeddings; pic needs a RoPE "
            f"decoder (supported families: {supported})"
        )
    inner = getattr(model, "model", None)
    if model_type not in SUPPORTED_MODEL_TYPES or getattr(inner, "rotary_emb", None) is None:
        raise UnsupportedModelError(
            f"{arch} (model_type {model_type!r}) is a RoPE model whose layer layout pic does not run yet; "
            f"supported families: {supported}"
        )
    layers = inner.layers
    attn = layers[0].self_attn
    param = next(model.parameters())
    return ModelSpec(
        model_type=model_type,
        architecture=arch,
        num_layers=len(layers),
        num_q_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=attn.head_dim,
        vocab_size=config.vocab_size,
        max_context=config.max_position_embeddings,
        has_qk_norm=hasattr(attn, "q_norm"),
        sliding_windows=tuple(_layer_window(config, layer.self_attn) for layer in layers),
        dtype=param.dtype,
        device=param.device,
    )
