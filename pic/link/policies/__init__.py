"""Recompute policies: which tokens of a linked prompt to run fresh.

Use a spec string (``"naive"``, ``"full"``) or an object; add your own by subclassing ``Policy`` and
decorating it with ``register``.
"""

from pic.link.policies.base import Policy
from pic.link.policies.builtin import FullRecompute, Naive
from pic.link.policies.registry import available, register, resolve

__all__ = ["FullRecompute", "Naive", "Policy", "available", "register", "resolve"]
