"""Fused-RoPE attention over the paged NoPE KV: a batch description per forward, backends that plan it
once and attend per layer."""

from pic.attention.backend import AttentionBackend, AttentionShape
from pic.attention.batch import AttentionBatch, make_batch
from pic.attention.rope import RopeTable, apply_rope
from pic.attention.select import select_backend
from pic.attention.torch_backend import TorchBackend, TorchPlan

__all__ = [
    "AttentionBackend",
    "AttentionBatch",
    "AttentionShape",
    "RopeTable",
    "TorchBackend",
    "TorchPlan",
    "apply_rope",
    "make_batch",
    "select_backend",
]
