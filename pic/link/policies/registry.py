"""Policy names and spec strings (``"naive"``, ``"full"``, ``"legolink:16"``, ...)."""

from __future__ import annotations

from pic.errors import PolicyError, unknown_policy_hint
from pic.link.policies.a3 import A3
from pic.link.policies.ape import APE
from pic.link.policies.base import Policy
from pic.link.policies.builtin import Auto, FullRecompute, Naive, Suffix
from pic.link.policies.cacheblend import CacheBlend
from pic.link.policies.heads import MEPIC, LegoLink, LegoLinkZero
from pic.link.policies.query import FusionRAG, InfoFlow, ProphetKV
from pic.link.policies.regions import Regions

_POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        Naive,
        FullRecompute,
        LegoLink,
        LegoLinkZero,
        CacheBlend,
        MEPIC,
        ProphetKV,
        InfoFlow,
        FusionRAG,
        A3,
        APE,
        Regions,
        Auto,
        Suffix,
    )
}


def register(cls: type[Policy]) -> type[Policy]:
    """Register a policy class under ``cls.name`` (usable as a class decorator).

    Raises:
        PolicyError: the class has no name, or the name belongs to another class.
    """
    if not cls.name or ":" in cls.name:
        raise PolicyError(f"policy class {cls.__name__} needs a `name` without ':', got {cls.name!r}")
    existing = _POLICIES.get(cls.name)
    if existing is not None and existing is not cls:
        raise PolicyError(f"policy name {cls.name!r} is already taken by {existing.__name__}")
    _POLICIES[cls.name] = cls
    return cls


def available() -> list[str]:
    """Registered policy names."""
    return sorted(_POLICIES)


def resolve(policy: str | Policy) -> Policy:
    """A policy object from a ``Policy`` or a spec string ``"name"`` / ``"name:arg"``.

    Raises:
        PolicyError: the name is not registered, or the policy rejects the argument.
    """
    if isinstance(policy, Policy):
        return policy
    if not isinstance(policy, str):
        raise PolicyError(f"policy must be a spec string or a pic.policies.Policy, got {policy!r}")
    name, sep, arg = policy.partition(":")
    cls = _POLICIES.get(name.strip().lower())
    if cls is None or "@" in policy or "/" in policy:
        hint = unknown_policy_hint(policy, available())
        raise PolicyError(f"unknown policy {policy!r}{hint}; registered: {', '.join(available())}")
    return cls.from_spec(arg.strip() if sep else None)
