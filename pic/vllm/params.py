"""What a vLLM request asks of pic: the ``"pic"`` entry of its ``kv_transfer_params``.

vLLM's OpenAI server passes a request's ``kv_transfer_params`` through to the connector unchanged (and
``LLM.generate`` takes them as ``SamplingParams(extra_args={"kv_transfer_params": ...})``), so pic's fields
live under one key there::

    {"pic": {"ids": ["3f2a...", "9c1e..."], "policy": "suffix:0.2", "order": "relevance"}}  # link these, in this order
    {"pic": {"compile": true}}                                          # store this prompt as a chunk

A linked request must also carry ``cache_salt = link_salt(ids, policy)`` (``pic.vllm.client`` sets it):
vLLM's prefix cache keys blocks by the salt and the tokens, so the approximate KV of a link never serves
a plain prompt with the same tokens, nor a link under another policy (LMCache #3229).

A request's ``cache_salt`` is also its tenant (``pic.vllm.tenants``): a compile's salt ``S`` is the tenant itself, a
link's is ``f"{S}:{link_salt(ids, policy)}"`` (``link_salt(..., tenant_salt=S)``), and no salt is the default
namespace. vLLM hashes the whole salt, so two tenants' links of the same ids never share a block; the link's part
is a tail the connector recomputes from the request's ids and policy, so it splits off any ``S`` (one holding ``:``
too) and reads the tenant from what is left.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from pic.errors import InvalidInputError, PicError
from pic.link.policies import Auto, resolve
from pic.link.policies import Suffix as SuffixPolicy
from pic.link.policies.builtin import AutoChoice, suffix_length

PARAMS_KEY = "pic"
DEFAULT_POLICY = "auto"  # pic's default, as vLLM can run it: the most relevant chunks last, recomputed whole
_MAX_IDS = 4096


@dataclass(frozen=True)
class VllmSuffix:
    """The recompute policy inside vLLM: vLLM's own forward computes the last ``ratio`` of the linked chunks'
    tokens (and everything after them); the rest is loaded from pic's store at its positions (naive).
    ``whole``: the suffix reaches back to the start of the chunk it would cut, so no chunk is part loaded, part
    recomputed (a chunk cut so answers worse than one left whole on Qwen2.5-Coder-0.5B: docs/vllm.md).

    ``auto``: pic's ``auto`` (the default), whose rule (``Auto.plan``) decides: whole chunks, at most ``max_share``
    of the chunk tokens; over it, the suffix is cut at the share (pic's engine takes the best regions there, which
    vLLM cannot run); a prompt less than ``min_gain`` times that is a plain prefill (every chunk token recomputed),
    as pic's engine runs Full Recompute there.

    ``ratio=0`` is ``"naive"`` (every chunk token from the store), ``ratio=1`` is ``"full"`` (none: a plain
    prefill that only checks the chunks). vLLM computes a suffix of the prompt and nothing else, so the
    tokens a policy recomputes must end the chunks: put the documents that matter most last
    (``client.link_prompt(order="relevance")``). Spelled as pic's own ``suffix`` (or ``auto``) policy, which runs
    the same choice in pic's engine (``pic.link.policies.Suffix``, ``Auto``).
    """

    ratio: float
    whole: bool = False
    auto: Auto | None = None

    @property
    def name(self) -> str:
        if self.auto is not None:
            return self.auto.spec
        named = {0.0: "naive", 1.0: "full"}.get(self.ratio)
        return named or f"suffix:{self.ratio:g}" + (",whole=true" if self.whole else "")

    def num_recomputed(self, chunk_lengths: Sequence[int], num_other_tokens: int = 0) -> int:
        """Chunk tokens left to vLLM, for chunks of ``chunk_lengths`` tokens in prompt order and ``num_other_tokens``
        more in the prompt (its prefix and query): pic's engine's rule (``pic.link.policies.builtin``'s
        ``suffix_length``, ``auto_plan``); where ``auto`` would take regions, the suffix cut at ``max_share`` (vLLM
        computes a suffix only)."""
        if self.auto is None:
            return suffix_length(chunk_lengths, self.ratio, whole=self.whole)
        return self.auto.plan(chunk_lengths, num_other_tokens).num_recomputed

    def keeps_given_order(self, chunk_lengths: Sequence[int], num_other_tokens: int) -> bool:
        """Whether the link runs the chunks in the caller's order: ``naive``, ``full``, and ``auto`` where its rule
        chose a plain prefill (Full Recompute, which pic's engine runs in the caller's order)."""
        if self.auto is None:
            return not 0.0 < self.ratio < 1.0
        return self.auto.plan(chunk_lengths, num_other_tokens).choice is AutoChoice.FULL


def parse_policy(value: object) -> VllmSuffix:
    """``"naive"``, ``"full"``, pic's ``auto`` spec (``"auto"``, ``"auto:<budget>[,max_share=<share>]"``), or its
    ``suffix`` spec: ``"suffix:<ratio in [0, 1]>"``, with ``",whole=true"``.

    Raises:
        InvalidInputError: anything else, naming it.
    """
    if value in ("naive", "full"):
        return VllmSuffix({"naive": 0.0, "full": 1.0}[value])
    try:
        policy = resolve(value) if isinstance(value, str) and value.startswith(("suffix:", "auto")) else None
    except PicError:
        policy = None
    if isinstance(policy, SuffixPolicy):
        return VllmSuffix(policy.ratio, whole=policy.whole)
    if isinstance(policy, Auto):
        return VllmSuffix(policy.budget, whole=True, auto=policy)
    raise InvalidInputError(
        f"pic policy {value!r:.80} is not one the vLLM connector runs; expected 'naive', 'full', 'auto[:<budget>]' "
        f"or 'suffix:<ratio in [0, 1]>[,whole=true]' (vLLM recomputes a suffix of the prompt only)"
    )


@dataclass(frozen=True)
class LinkRequest:
    """A request that links ``ids`` (in prompt order) under ``policy``."""

    ids: tuple[str, ...]
    policy: VllmSuffix
    order: str = "given"  # what the client ordered the ids by (reported back; the ids are in prompt order)

    @property
    def salt(self) -> str:
        """The link's part of its ``cache_salt`` (all of it in the default namespace)."""
        return link_salt(self.ids, self.policy.name)

    def tenant_of(self, cache_salt: str | None) -> str | None:
        """The tenant salt of a request that links these ids and carries ``cache_salt`` (``None``: the default
        namespace): ``cache_salt`` is ``self.salt``, or ``"<tenant salt>:" + self.salt``.

        Raises:
            InvalidInputError: any other ``cache_salt`` (none, or another link's); not echoed: it may hold a tenant's
                secret.
        """
        link = self.salt
        if cache_salt == link:
            return None
        if isinstance(cache_salt, str) and len(cache_salt) > len(link) + 1 and cache_salt.endswith(":" + link):
            return cache_salt[: -len(link) - 1]
        has = "none" if not cache_salt else "another (not shown: it may hold a tenant's secret)"
        raise InvalidInputError(
            f"a linked request must carry cache_salt {link!r} (pic.vllm.params.link_salt), or '<tenant salt>:{link}' "
            f"for a tenant, so vLLM's prefix cache never serves its KV to other prompts or tenants; it has {has}"
        )


@dataclass(frozen=True)
class CompileRequest:
    """A request whose prompt (the model's lead tokens, then the document's) is to be stored as a chunk."""


def parse_params(kv_transfer_params: object) -> LinkRequest | CompileRequest | None:
    """pic's part of a request's ``kv_transfer_params`` (``None``: the request does not involve pic).

    Raises:
        InvalidInputError: a malformed ``"pic"`` entry, naming the field.
    """
    if not isinstance(kv_transfer_params, dict) or PARAMS_KEY not in kv_transfer_params:
        return None
    entry = kv_transfer_params[PARAMS_KEY]
    if not isinstance(entry, dict) or set(entry) - {"ids", "policy", "order", "compile"}:
        raise InvalidInputError(
            f"kv_transfer_params['pic'] is {entry!r:.120}; expected {{'ids': [...], 'policy': ...}} or "
            f"{{'compile': true}}"
        )
    if entry.get("compile") is True and "ids" not in entry:
        return CompileRequest()
    ids = entry.get("ids")
    if not isinstance(ids, list) or not ids or len(ids) > _MAX_IDS or not all(isinstance(i, str) for i in ids):
        raise InvalidInputError(
            f"kv_transfer_params['pic']['ids'] is {ids!r:.120}; expected a list of 1 to {_MAX_IDS} cache ids"
        )
    order = entry.get("order", "given")
    if order not in ("given", "relevance"):
        raise InvalidInputError(f"kv_transfer_params['pic']['order'] is {order!r:.80}; expected 'given' or 'relevance'")
    return LinkRequest(ids=tuple(ids), policy=parse_policy(entry.get("policy", DEFAULT_POLICY)), order=order)


def link_salt(ids: tuple[str, ...] | list[str], policy: str, *, tenant_salt: str | None = None) -> str:
    """The ``cache_salt`` a link of ``ids`` under ``policy`` carries: its blocks are shared with that link only, asked
    by the same tenant. ``tenant_salt``: the ``cache_salt`` of the tenant's other requests (its compiles: the
    namespace its chunks' ids hash); ``None`` or ``""``: the default namespace, as vLLM treats an empty salt.

    vLLM's server takes salts of at most 128 characters: a tenant salt of at most 91 leaves room for the link's 37.
    """
    key = "\0".join([policy, *ids]).encode()
    link = "pic-" + hashlib.sha256(key).hexdigest()[:32]
    return f"{tenant_salt}:{link}" if tenant_salt else link
