"""The recompute-policy protocol.

A policy decides which tokens of a linked prompt are recomputed (run fresh through every layer,
attending to the whole request) and which keep their cached KV. Prefix and query tokens have no
cached KV and are always recomputed; a policy only chooses among chunk tokens. A policy may also
ask for compile options (LegoLink-0 compiles chunks with extra leading BOS tokens); chunks compiled
otherwise are refused at link time instead of silently giving other results.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from pic.config import CompileOptions
from pic.errors import PolicyError
from pic.link.layout import Layout


class Policy(ABC):
    """Subclass, implement ``select``, and ``pic.policies.register`` it under a name.

    Attributes:
        name: the registered name, used in spec strings (``"name"`` or ``"name:arg"``).
    """

    name: ClassVar[str] = ""

    @abstractmethod
    def select(self, layout: Layout) -> torch.Tensor:
        """Chunk tokens to recompute: ``[layout.num_tokens]`` bool (True = recompute). Entries of
        prefix and query tokens are ignored: those are always recomputed."""

    def compile_options(self, base: CompileOptions) -> CompileOptions:
        """The compile options chunks need for this policy, given the engine's ``base``."""
        return base

    def recompute_mask(self, layout: Layout) -> torch.Tensor:
        """``select``, checked, with every uncached token added: ``[layout.num_tokens]`` bool on CPU.

        Raises:
            PolicyError: ``select`` returned something else than a bool tensor of that shape.
        """
        chosen = self.select(layout)
        if not (
            isinstance(chosen, torch.Tensor) and chosen.dtype == torch.bool and chosen.shape == (layout.num_tokens,)
        ):
            got = (
                f"{chosen.dtype} tensor of shape {tuple(chosen.shape)}"
                if isinstance(chosen, torch.Tensor)
                else repr(chosen)
            )
            raise PolicyError(
                f"policy {self.spec!r}: select() must return a bool tensor of shape ({layout.num_tokens},), got {got}"
            )
        return chosen.cpu() | ~layout.cached

    @classmethod
    def from_spec(cls, arg: str | None) -> Policy:
        """Build from the part of a spec string after ``:`` (``None`` when absent)."""
        if arg is not None:
            raise PolicyError(f"policy {cls.name!r} takes no argument, got {arg!r}")
        return cls()

    @property
    def spec(self) -> str:
        """The spec string that builds this policy."""
        return self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"
