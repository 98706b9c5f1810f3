"""Tiny random-weight models of each supported family, plus the real stories260K, for the tests.

Every tiny model uses the stories260K tokenizer (vocab 512), grouped-query attention and a
different rope type, so one test matrix covers the families' differences: Qwen2's q/k/v biases,
Qwen3's q/k norms and explicit head_dim, Mistral's sliding window, Qwen2's per-layer windows.
"""

from __future__ import annotations

import copy
import functools

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import pic
from tests.device import target

# A prompt used across the oracle and policy tests: chunks of different lengths, a prefix, a query.
DOCS = (
    "Tom had a big red ball. He liked to kick it in the park.",
    "Lily loved to sing. Every morning she sang a happy song for her mom and dad, and they smiled.",
    "The cat sat on the mat.",
)
QUERY = "One day, Tom and Lily went to"
PREFIX = "Here are three short stories."

_COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)

TINY_FAMILIES = {
    "llama": (
        LlamaForCausalLM,
        LlamaConfig(
            **_COMMON,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        ),
    ),
    "mistral": (
        MistralForCausalLM,
        MistralConfig(
            **_COMMON, sliding_window=24, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
        ),
    ),
    "qwen2": (
        Qwen2ForCausalLM,
        # Sliding window on layers >= 1 only: per-layer windows.
        Qwen2Config(
            **_COMMON,
            use_sliding_window=True,
            sliding_window=20,
            max_window_layers=1,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
    ),
    "qwen3": (
        Qwen3ForCausalLM,
        Qwen3Config(
            **_COMMON,
            head_dim=32,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        ),
    ),
}
FAMILIES = (*TINY_FAMILIES, "stories260K")


@functools.cache
def tokenizer():
    return AutoTokenizer.from_pretrained(str(pic.EMBEDDED_MODEL))


def tiny_model(family: str, *, seed: int = 0) -> torch.nn.Module:
    """A float32 random model of ``family``; weights scaled up so that greedy choices are decisive."""
    cls, config = TINY_FAMILIES[family]
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.25 if "embed" in name or "lm_head" in name else 1.0 / param.shape[1] ** 0.5)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
    return model


@functools.cache
def _stories() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(pic.EMBEDDED_MODEL), dtype=torch.float32).eval()


def model(family: str) -> torch.nn.Module:
    """The CPU float32 model (stories260K: one shared instance; do not move it, see ``target_model``)."""
    return _stories() if family == "stories260K" else tiny_model(family)


def target_model(family: str, *, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """``model(family)`` on the test device in the test dtype (``tests/device.py``), or in ``dtype``.

    The same weights whatever the target (built in float32 on the CPU, then cast and moved); on the CPU
    in float32 exactly ``model(family)``."""
    t = target()
    dtype = dtype or t.dtype
    if t.device.type == "cpu" and dtype == torch.float32:
        return model(family)
    if family == "stories260K":
        return _stories_on(t.device, dtype)
    return tiny_model(family).to(device=t.device, dtype=dtype)


@functools.cache
def _stories_on(device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    return copy.deepcopy(_stories()).to(device=device, dtype=dtype)  # a copy: the CPU float32 one stays
