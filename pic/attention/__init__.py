"""Fused-RoPE attention over the paged NoPE KV."""

from pic.attention.plan import AttentionPlan, make_plan
from pic.attention.reference import paged_attention
from pic.attention.rope import apply_rope

__all__ = ["AttentionPlan", "apply_rope", "make_plan", "paged_attention"]
