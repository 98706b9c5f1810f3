"""Content addresses: a model fingerprint and the cache id of a chunk (below compile and store: both name
chunks by it).

A cache id is a hash of (model fingerprint, token ids, compile options, the namespace's secret salt), so the
same text compiled by the same model in the same namespace on two machines gets the same id, a chunk can never
be linked by a model, or with options, other than the ones that produced its KV, and an id of another
namespace cannot be computed without its salt (``pic.namespaces``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence

import msgpack
import torch
from torch import nn

from pic.config import CompileOptions
from pic.errors import InvalidInputError
from pic.text import refuse_text_for_list

# Bump when the meaning of cached KV changes, so old ids stop matching.
KV_FORMAT_VERSION = 1
# Elements sampled from each end of every parameter; enough to tell checkpoints apart without
# hashing gigabytes of weights.
_SAMPLE = 64
_CONFIG_NOISE = {"_name_or_path", "transformers_version", "architectures", "dtype", "torch_dtype", "use_cache"}


def _tensor_bytes(t: torch.Tensor) -> bytes:
    flat = t.detach().flatten()
    sample = torch.cat((flat[:_SAMPLE], flat[-_SAMPLE:])) if flat.numel() > 2 * _SAMPLE else flat
    return sample.cpu().contiguous().view(torch.uint8).numpy().tobytes()


def model_fingerprint(model: nn.Module) -> str:
    """A stable hex digest of a model's config, dtype and (a sample of) its weights."""
    config = {k: v for k, v in model.config.to_dict().items() if k not in _CONFIG_NOISE}
    h = hashlib.sha256()
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    for name, param in sorted(model.state_dict().items()):
        h.update(f"{name}:{param.dtype}:{tuple(param.shape)}".encode())
        h.update(_tensor_bytes(param))
    return h.hexdigest()[:32]


def chunk_id(fingerprint: str, token_ids: Sequence[int], options: CompileOptions, salt: bytes = b"") -> str:
    """Cache id (32 hex chars) of ``token_ids`` compiled by the model ``fingerprint`` with ``options``, in a
    namespace (``pic.namespaces``) whose secret is ``salt``: without the salt nobody can compute it.

    The namespace's identity is its salt when it has one, else its name (``options.namespace``): a label alone
    separates chunks (two names, two ids) but anyone can compute its ids; a salt makes them secret, and two
    programs that name the namespace differently but share its salt (``pic serve``'s tenant and vLLM's
    ``cache_salt``) agree on every id. Neither a salt nor a name (the default namespace): the ids of the
    versions before namespaces existed.
    """
    fields: list[object] = [KV_FORMAT_VERSION, fingerprint, options.id_fields(), list(token_ids)]
    if salt:
        fields.append(["salt", salt])
    elif options.namespace:
        fields.append(["name", options.namespace])
    return hashlib.sha256(msgpack.packb(fields)).hexdigest()[:32]


def cache_id_list(cache_ids: object, name: str = "cache_ids") -> list[str]:
    """``cache_ids`` as a list of strings: an iterable of ids (as ``compile`` returns them).

    One id as a bare string is refused, not taken as a list of one: ``link_chat``'s ``documents`` is a list
    where a string was iterated character by character, and one rule for every list argument leaves nothing
    to remember.

    Raises:
        InvalidInputError: anything else (a string, ``None``, a number, a list holding a non-string), naming
            ``name``.
    """
    refuse_text_for_list(cache_ids, name, "cache ids")
    ids = list(cache_ids) if isinstance(cache_ids, Iterable) else None
    if ids is None or not all(isinstance(cid, str) for cid in ids):
        raise InvalidInputError(f"{name} is {cache_ids!r:.80}; expected a list of cache ids from compile()")
    return ids
