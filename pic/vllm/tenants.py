"""Whose a vLLM request's chunks are: its ``cache_salt`` names its pic namespace (``pic.namespaces``).

vLLM tells tenants apart by the ``cache_salt`` that a trusted server in front of it sets per tenant (PR #17045, PR
#53347): only requests with the same salt share prefix-cache blocks. The connector maps that salt to a pic namespace,
so tenants stay apart in pic's tiers as they do in vLLM's cache (the gap LMCache #2878 had: its connector left the
salt out of its keys, and tenants shared entries):

- no salt, or ``""`` (vLLM salts nothing with it): the default namespace, whose ids are those of every version before
  tenants;
- salt ``S``: ``Namespace(label, salt=S.encode())``. A compile under ``S`` stores its chunk under
  ``chunk_id(fingerprint, tokens, options, salt=S.encode())``, the id ``pic serve`` gives the same document of a
  tenant whose salt is ``S``; a link under ``S`` finds only the chunks whose id that salt reproduces, and any other
  id (another tenant's, the default namespace's) is an id nobody compiled.

The label (``salt-`` and 12 hex digits of a hash of ``S``) names the namespace in stored metadata, reports and logs;
ids hash the salt, never the label, so a pic server that names the tenant otherwise agrees on every id.
"""

from __future__ import annotations

import hashlib

from pic.errors import InvalidInputError
from pic.kv import ChunkKV
from pic.namespaces import DEFAULT, Namespace

_LABEL = b"pic vllm cache_salt label\0"  # the label is a hash of the salt, never the salt


def namespace_of(tenant_salt: str | None) -> Namespace:
    """The namespace of a vLLM request whose tenant's ``cache_salt`` is ``tenant_salt`` (``None`` or ``""``: the
    default namespace, as vLLM salts no block with an empty salt).

    Raises:
        InvalidInputError: a salt that is not a string, or longer than a namespace's salt may be (1 KiB encoded;
            vLLM's server takes 128 characters, ``LLM.generate`` any).
    """
    if tenant_salt is None or tenant_salt == "":
        return DEFAULT
    if not isinstance(tenant_salt, str):
        raise InvalidInputError(f"cache_salt is a {type(tenant_salt).__name__}; vLLM's salts are strings")
    salt = tenant_salt.encode("utf-8", "surrogatepass")  # any str, even one JSON gave a lone surrogate
    return Namespace("salt-" + hashlib.sha256(_LABEL + salt).hexdigest()[:12], salt)


def read_tokens(tier: object, cache_id: str, namespace: Namespace) -> tuple[int, ...] | None:
    """The tokens ``tier``'s metadata holds for ``cache_id`` (the scheduler side's read) if the chunk is
    ``namespace``'s (the store checks whose: its salt must reproduce the id); ``None``: the tier holds none, or
    another namespace's, alike."""
    extent = _read(tier, "extent", cache_id, namespace)
    return None if extent is None else extent.token_ids


def read_chunk(tier: object, cache_id: str, namespace: Namespace) -> ChunkKV | None:
    """``tier``'s chunk ``cache_id`` (the worker side's read) if it is ``namespace``'s (checked by the store, as
    ``read_tokens``); ``None``: the tier holds none, or another namespace's."""
    return _read(tier, "get", cache_id, namespace)


def _read(tier: object, method: str, cache_id: str, namespace: Namespace) -> object:
    """``tier.extent(cache_id)`` or ``tier.get(cache_id)`` as ``namespace`` reads it: pic's store checks there whose
    an entry is, and answers another namespace's as a plain miss."""
    return getattr(tier, method)(cache_id, readable={namespace.name: namespace.salt})
