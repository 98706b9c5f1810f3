"""What a vLLM request asks of pic: the ``"pic"`` entry of its ``kv_transfer_params``.

vLLM's OpenAI server passes a request's ``kv_transfer_params`` through to the connector unchanged (and
``LLM.generate`` takes them as ``SamplingParams(extra_args={"kv_transfer_params": ...})``), so pic's fields
live under one key there::

    {"pic": {"ids": ["3f2a...", "9c1e..."], "policy": "suffix:0.2"}}   # link these chunks, in prompt order
    {"pic": {"compile": true}}                                          # store this prompt as a chunk

A linked request must also carry ``cache_salt = link_salt(ids, policy)`` (``pic.vllm.client`` sets it):
vLLM's prefix cache keys blocks by the salt and the tokens, so the approximate KV of a link never serves
a plain prompt with the same tokens, nor a link under another policy (LMCache #3229).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from pic.errors import InvalidInputError

PARAMS_KEY = "pic"
DEFAULT_POLICY = "suffix:0.2"
_MAX_IDS = 4096


@dataclass(frozen=True)
class Suffix:
    """The recompute policy inside vLLM: vLLM's own forward computes the last ``ratio`` of the linked chunks'
    tokens (and everything after them); the rest is loaded from pic's store at its positions (naive).

    ``ratio=0`` is ``"naive"`` (every chunk token from the store), ``ratio=1`` is ``"full"`` (none: a plain
    prefill that only checks the chunks). vLLM computes a suffix of the prompt and nothing else, so the
    tokens a policy recomputes must end the chunks: put the documents that matter most last
    (``client.link_prompt(order="relevance")``).
    """

    ratio: float

    @property
    def name(self) -> str:
        return {0.0: "naive", 1.0: "full"}.get(self.ratio, f"suffix:{self.ratio:g}")

    def num_recomputed(self, num_chunk_tokens: int) -> int:
        return round(self.ratio * num_chunk_tokens)


def parse_policy(value: object) -> Suffix:
    """``"naive"``, ``"full"`` or ``"suffix:<ratio in [0, 1]>"``.

    Raises:
        InvalidInputError: anything else, naming it.
    """
    if value == "naive":
        return Suffix(0.0)
    if value == "full":
        return Suffix(1.0)
    if isinstance(value, str) and value.startswith("suffix:"):
        try:
            ratio = float(value.removeprefix("suffix:"))
        except ValueError:
            ratio = -1.0
        if 0.0 <= ratio <= 1.0:
            return Suffix(ratio)
    raise InvalidInputError(
        f"pic policy {value!r:.80} is not one the vLLM connector runs; expected 'naive', 'full' or "
        f"'suffix:<ratio in [0, 1]>' (vLLM recomputes a suffix of the prompt only)"
    )


@dataclass(frozen=True)
class LinkRequest:
    """A request that links ``ids`` (in prompt order) under ``policy``."""

    ids: tuple[str, ...]
    policy: Suffix

    @property
    def salt(self) -> str:
        return link_salt(self.ids, self.policy.name)


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
    if not isinstance(entry, dict) or set(entry) - {"ids", "policy", "compile"}:
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
    return LinkRequest(ids=tuple(ids), policy=parse_policy(entry.get("policy", DEFAULT_POLICY)))


def link_salt(ids: tuple[str, ...] | list[str], policy: str) -> str:
    """The ``cache_salt`` a link of ``ids`` under ``policy`` carries: its blocks are shared with that link only."""
    key = "\0".join([policy, *ids]).encode()
    return "pic-" + hashlib.sha256(key).hexdigest()[:32]
