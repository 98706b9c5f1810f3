"""The recompute-policy protocol.

A policy decides which tokens of a linked prompt are recomputed (run fresh through the layers,
attending to the whole request) and which keep their cached KV. Prefix and query tokens have no
cached KV and are always recomputed; a policy only chooses among chunk tokens.

*Static* policies choose once, from the layout (``select``). *Dynamic* ones (CacheBlend, A³) also
implement ``after_layer``: after each layer of the recompute pass they may drop tokens, which then
keep their cached KV in every later layer. *Query-aware* ones (ProphetKV, pic's ``regions``) implement
``after_probe``: ``select``'s tokens run first as a *probe* that records the query's attention over the
linked KV at every layer (``pic.link.probe.Probe``); the policy then names the chunk tokens to recompute,
and a second pass recomputes them with the query. A policy may ask for compile options (LegoLink-0
compiles chunks with extra leading BOS tokens); chunks compiled otherwise are refused at link time
instead of silently giving other results.

Policies are frozen pydantic models: their parameters are validated fields, and the spec string
``"name:first_field,other_field=value"`` builds them (``"legolink:16"``, ``"cacheblend:0.3,check_layer=2"``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from pic.attention.ape import ContextScaling
from pic.config import CompileOptions, describe_validation_error
from pic.errors import PolicyError
from pic.link.layout import Layout
from pic.link.order import Order

if TYPE_CHECKING:
    from pic.link.probe import Probe
    from pic.link.step import LayerStep


class Policy(BaseModel, ABC):
    """Subclass, implement ``select`` (and ``after_layer`` for a dynamic policy), declare parameters
    as pydantic fields, and ``pic.policies.register`` it under ``name`` (used in spec strings)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)
    name: ClassVar[str] = ""
    # Links only chunks compiled in context (``compile(docs, context=...)``); others are refused at link time.
    needs_context: ClassVar[bool] = False
    # The chunk order of a link that leaves it to its policy (``order="policy"``, the default): every built-in
    # policy but ``auto`` keeps the caller's, so Full Recompute stays the model's own prefill of the caller's prompt.
    order: ClassVar[Order] = Order.GIVEN

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Raises: PolicyError: a subclass that overrides ``order_for``, the hook ``order`` replaced (it would be
        ignored: the chunks would run in the caller's order without a word)."""
        super().__init_subclass__(**kwargs)
        if "order_for" in vars(cls):
            raise PolicyError(
                f"policy class {cls.__name__} defines order_for(layout), which pic no longer calls; "
                "set the class attribute order = Order.RELEVANCE (or Order.GIVEN) instead"
            )

    def __init__(self, **data: Any) -> None:
        """Raises: PolicyError: a value a field rejects (strictly: ``LegoLink(k="16")`` too), or an unknown field."""
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise PolicyError(f"policy {self.name!r}: {describe_validation_error(type(self), exc)}") from None
        if self.is_dynamic and self.is_query_aware:
            raise PolicyError(f"policy {self.name!r} implements both after_layer and after_probe; choose one")

    @abstractmethod
    def select(self, layout: Layout) -> torch.Tensor:
        """Tokens to recompute from the first layer on: ``[layout.num_tokens]`` bool (True = recompute).
        Entries of prefix and query tokens are ignored: those are always recomputed."""

    def for_layout(self, layout: Layout) -> Policy:
        """The policy that runs this layout: ``self``, or one a policy that reads the layout chooses (``auto``).
        The linker asks once, before planning; the choice must lay chunks out as this one does
        (``parallel_positions``), and ``Linked.policy`` reports it."""
        return self

    def after_layer(self, step: LayerStep) -> torch.Tensor | None:
        """Dynamic policies: which of the tokens that just ran ``step.layer`` keep running: ``[step.num_tokens]``
        bool, or ``None`` for all. Dropped chunk tokens use their cached KV from the next layer on."""
        return None

    def after_probe(self, probe: Probe) -> torch.Tensor:
        """Query-aware policies: ``[T]`` bool, the chunk tokens to recompute, chosen from what the query saw
        (``probe.mass`` / ``probe.attention``: ``[num_layers, T]``). The query is always recomputed, and the
        prefix keeps the exact KV the probe gave it."""
        raise NotImplementedError

    def probe_layers(self, num_layers: int) -> range:
        """Query-aware policies: the layers ``after_probe`` reads (``Probe.layers``). The probe scores only
        those, and the query leaves it after the last."""
        return range(num_layers)

    @property
    def is_dynamic(self) -> bool:
        return type(self).after_layer is not Policy.after_layer

    @property
    def is_query_aware(self) -> bool:
        return type(self).after_probe is not Policy.after_probe

    def context_scaling(self) -> ContextScaling | None:
        """APE-style attention for the query and generated tokens over the chunks (``pic.attention.ape``)."""
        return None

    @property
    def parallel_positions(self) -> bool:
        """Lay chunks out in parallel, each right after the prefix, the query after the longest (APE)."""
        return False

    def compile_options(self, base: CompileOptions) -> CompileOptions:
        """The compile options chunks need for this policy, given the engine's ``base``."""
        return base

    def check_model(self, *, num_layers: int) -> None:
        """Raise ``PolicyError`` if the policy cannot run on a model with ``num_layers`` layers."""

    def recompute_mask(self, layout: Layout) -> torch.Tensor:
        """``select``, checked, with every uncached token added: ``[layout.num_tokens]`` bool on CPU."""
        return self._checked(self.select(layout), layout.num_tokens, "select()").cpu() | ~layout.cached

    def probe_mask(self, probe: Probe) -> torch.Tensor:
        """``after_probe``, checked: ``[T]`` bool on CPU, its chunk tokens and every query token."""
        layout = probe.layout
        chosen = self._checked(self.after_probe(probe), layout.num_tokens, "after_probe()").cpu() & layout.cached
        chosen[layout.query.tokens] = True
        return chosen

    def keep_mask(self, step: LayerStep) -> torch.Tensor | None:
        """``after_layer``, checked, with the step's uncached tokens kept (on the step's device)."""
        chosen = self.after_layer(step)
        if chosen is None:
            return None
        return self._checked(chosen, step.num_tokens, "after_layer()").to(step.tokens.device) | ~step.cached

    def _checked(self, chosen: object, num_tokens: int, method: str) -> torch.Tensor:
        """Raises: PolicyError: ``chosen`` is not a bool tensor of shape ``(num_tokens,)``."""
        if isinstance(chosen, torch.Tensor) and chosen.dtype == torch.bool and chosen.shape == (num_tokens,):
            return chosen
        got = repr(chosen)
        if isinstance(chosen, torch.Tensor):
            got = f"{chosen.dtype} tensor of shape {tuple(chosen.shape)}"
        raise PolicyError(
            f"policy {self.spec!r}: {method} must return a bool tensor of shape ({num_tokens},), got {got}"
        )

    @classmethod
    def from_spec(cls, arg: str | None) -> Policy:
        """Build from the part of a spec string after ``:`` (``None`` when absent): the value of the
        first field, then ``field=value`` pairs, comma-separated.

        Raises:
            PolicyError: an argument the policy does not take, or a value its fields reject.
        """
        fields = list(cls.model_fields)
        values: dict[str, object] = {}
        for i, part in enumerate(arg.split(",") if arg else []):
            key, eq, value = part.partition("=")
            if not eq:
                if i > 0 or not fields:
                    raise PolicyError(f"policy {cls.name!r} does not take the argument {part!r} (fields: {fields})")
                key, value = fields[0], key
            key = key.strip()
            if key not in cls.model_fields:
                raise PolicyError(f"policy {cls.name!r} has no field {key!r} (fields: {fields})")
            if key in values:
                raise PolicyError(f"policy {cls.name!r}: {key} given twice in {arg!r}")
            try:  # spec values are text: parse them as the field's type, then validate strictly
                values[key] = TypeAdapter(cls.model_fields[key].annotation).validate_python(value.strip(), strict=False)
            except ValidationError as exc:
                raise PolicyError(
                    f"policy {cls.name!r}: bad argument {arg!r} ({key}={value.strip()!r}: {exc.errors()[0]['msg']})"
                ) from None
        try:
            return cls(**values)
        except PolicyError as exc:
            raise PolicyError(f"{exc} (in the spec argument {arg!r})") from None

    @property
    def spec(self) -> str:
        """The spec string that builds this policy: the first field always, others when not default."""
        parts = []
        for i, (key, field) in enumerate(type(self).model_fields.items()):
            value = getattr(self, key)
            if i == 0:
                parts.append(str(value))
            elif value != field.default:
                parts.append(f"{key}={value}")
        return self.name + (":" + ",".join(parts) if parts else "")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"

    def __str__(self) -> str:
        return self.spec
