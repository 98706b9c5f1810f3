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
import logging
from collections.abc import Sequence

from pic.config import CompileOptions
from pic.errors import InvalidInputError
from pic.ids import chunk_id
from pic.kv import ChunkKV
from pic.namespaces import DEFAULT, Namespace

log = logging.getLogger("pic.vllm")
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


def owns(
    namespace: Namespace, cache_id: str, *, fingerprint: str, token_ids: Sequence[int], options: CompileOptions
) -> bool:
    """Whether ``cache_id`` is the id, in ``namespace``, of the chunk of ``token_ids`` (every token a tier's metadata
    lists, the BOS too) compiled by the model ``fingerprint`` with ``options``.

    The connector's own check of whose a chunk it read is, whatever the tier checked: an entry is a namespace's
    when that namespace's salt reproduces its id (``pic.ids.chunk_id``), so nobody without the salt can make one.
    """
    content = list(token_ids)[int(options.add_bos) :]  # the id hashes the tokens after the chunk's BOS (serde's rule)
    labelled = options.model_copy(update={"namespace": namespace.name})
    return chunk_id(fingerprint, content, labelled, namespace.salt) == cache_id


def read_tokens(
    tier: object, cache_id: str, namespace: Namespace, *, fingerprint: str, options: CompileOptions
) -> tuple[int, ...] | None:
    """The tokens ``tier``'s metadata holds for ``cache_id`` (the scheduler side's read) if the chunk is
    ``namespace``'s; ``None``: the tier holds none, or another namespace's.

    A tenant's chunk is checked here whatever the tier checked, against ``options`` (those of the chunks the
    connector compiles: the metadata read tells no options); the default namespace's is the tier's own check of the
    id, as before tenants (so chunks of any options, a context's too, link there)."""
    extent = _read(tier, "extent", cache_id, namespace)
    if extent is None:
        return None
    if namespace.is_default or owns(namespace, cache_id, fingerprint=fingerprint, token_ids=extent.token_ids,
                                    options=options):  # fmt: skip
        return extent.token_ids
    log.info("pic: chunk %s in the %s tier is not %s's: an unknown id to it", cache_id, tier.name, namespace.name)
    return None


def read_chunk(tier: object, cache_id: str, namespace: Namespace, *, fingerprint: str) -> ChunkKV | None:
    """``tier``'s chunk ``cache_id`` (the worker side's read) if it is ``namespace``'s, checked by the options it was
    stored with; ``None``: the tier holds none, or another namespace's."""
    chunk = _read(tier, "get", cache_id, namespace)
    if chunk is None or namespace.is_default:
        return chunk
    if owns(namespace, cache_id, fingerprint=fingerprint, token_ids=chunk.token_ids.tolist(), options=chunk.options):
        return chunk
    log.warning("pic: chunk %s in the %s tier is not %s's: a miss", cache_id, tier.name, namespace.name)
    return None


def _read(tier: object, method: str, cache_id: str, namespace: Namespace) -> object:
    """``tier.extent(cache_id)`` or ``tier.get(cache_id)`` as ``namespace`` reads it: pic's store checks there whose
    an entry is, and answers another namespace's as a plain miss."""
    return getattr(tier, method)(cache_id, readable={namespace.name: namespace.salt})
