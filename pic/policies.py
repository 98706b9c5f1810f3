"""``pic.policies``: recompute policies (re-exported from ``pic.link.policies``)."""

from pic.link.policies import FullRecompute, Naive, Policy, available, register, resolve

__all__ = ["FullRecompute", "Naive", "Policy", "available", "register", "resolve"]
