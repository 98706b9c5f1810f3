"""Fused-RoPE attention over the paged NoPE KV: a plan per forward, backends that run it per layer."""

from pic.attention.plan import BatchPlan, make_plan
from pic.attention.reference import paged_attention
from pic.attention.rope import RopeTable, apply_rope

__all__ = ["BatchPlan", "RopeTable", "apply_rope", "make_plan", "paged_attention"]
