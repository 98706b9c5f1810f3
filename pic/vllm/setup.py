"""What both sides of the connector derive from vLLM's config: the model's identity in pic and pic's store.

Configured through ``kv_connector_extra_config`` (every key optional)::

    {"store": {"disk_path": "/srv/pic", "redis_url": "redis://cache:6379", ...},   # pic.StoreConfig's fields
     "fingerprint": "...",   # pic's fingerprint of the model (default: read from the checkpoint folder)
     "add_bos": false,       # compile options (default: whether the tokenizer writes a BOS, as pic.load decides)
     "store_key_file": "/etc/pic/store.key"}  # the fleet's store key (hex, mode 600), or PIC_STORE_KEY
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from pic.config import CompileOptions, StoreConfig
from pic.errors import InvalidInputError, ModelLoadError
from pic.store.serde import Expected
from pic.store.tier import LowerTier
from pic.store.tiered import lower_tiers


@dataclass(frozen=True)
class Setup:
    """The model as pic names it, and the tiers its chunks live in.

    Attributes:
        expected: what this model's chunks look like (fingerprint, layers, heads, dtype ...).
        options: the compile options of chunks compiled through vLLM (and expected of linked ones' prefixes).
        block_size: vLLM's KV block size.
        tiers: pic's lower tiers (CPU, disk, Redis), fastest first; this process's own connections.
    """

    expected: Expected
    options: CompileOptions
    bos_token_id: int | None
    block_size: int
    tiers: list[LowerTier]


def fleet_store_key(path: object, environ: Mapping[str, str] = os.environ) -> bytes | None:
    """The fleet's store key (``StoreConfig.store_key``) as ``pic serve`` takes it: from ``store_key_file`` (hex, mode
    600) or ``PIC_STORE_KEY`` (hex), one of them; ``None``: neither (the shared tiers trusted as they are).

    Raises:
        InvalidInputError: both given, an unreadable or open file, not hex, too short (never echoing the key).
    """
    from pic.secrets import read_secret_file, store_key

    given = environ.get("PIC_STORE_KEY")
    if path is not None and given is not None:
        raise InvalidInputError("the store key is given twice: by store_key_file and by PIC_STORE_KEY; keep one")
    if path is not None:
        if not isinstance(path, str):
            raise InvalidInputError(f"kv_connector_extra_config['store_key_file'] is {path!r:.80}; expected a path")
        return store_key(read_secret_file(path), f"store_key_file {path!r}")
    return None if given is None else store_key(given, "PIC_STORE_KEY")


def build_setup(vllm_config: object) -> Setup:
    """The connector's setup from vLLM's config (``kv_transfer_config.kv_connector_extra_config``).

    Raises:
        InvalidInputError: a malformed extra config (naming the key); no store tier configured.
        ModelLoadError: no local checkpoint folder to fingerprint and no ``fingerprint`` given.
    """
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    unknown = set(extra) - {"store", "fingerprint", "add_bos", "store_key_file"}
    if unknown:
        raise InvalidInputError(
            f"kv_connector_extra_config has unknown keys {sorted(unknown)}; pic reads store, fingerprint, add_bos, "
            "store_key_file"
        )
    store_fields = dict(extra.get("store", {}))
    if "store_key" in store_fields:  # (vLLM prints its config, and JSON holds no bytes)
        raise InvalidInputError(
            "kv_connector_extra_config['store'] holds store_key: give the fleet's store key by PIC_STORE_KEY or "
            "kv_connector_extra_config['store_key_file'] (hex, a file of mode 600), never in the config vLLM prints"
        )
    store = StoreConfig.model_validate(store_fields)
    key = fleet_store_key(extra.get("store_key_file"))
    if key is not None:
        store = store.model_copy(update={"store_key": key})
    if store.cpu_bytes == 0 and store.disk_path is None and store.redis_url is None:
        raise InvalidInputError(
            "kv_connector_extra_config['store'] names no tier; give disk_path and/or redis_url (the tiers pic's "
            "engines compile into), so vLLM's processes and pic's share chunks"
        )
    model_config = vllm_config.model_config
    hf_config = model_config.hf_config
    dtype = model_config.dtype
    fingerprint = extra.get("fingerprint") or _fingerprint(model_config.model, dtype)
    tokenizer = _tokenizer(model_config)
    add_bos = extra.get("add_bos")
    if add_bos is None:
        from pic.compile.tokens import tokenizer_adds_bos

        add_bos = tokenizer_adds_bos(tokenizer)
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    expected = Expected(
        fingerprint=fingerprint,
        num_layers=hf_config.num_hidden_layers,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", hf_config.num_attention_heads),
        head_dim=head_dim,
        dtype=dtype,
        max_tokens=model_config.max_model_len,
        vocab_size=hf_config.vocab_size,
        bos_token_id=getattr(tokenizer, "bos_token_id", None),  # what a chunk compiled with add_bos starts with
    )
    pin = torch.cuda.is_available()
    return Setup(
        expected=expected,
        options=CompileOptions(add_bos=bool(add_bos)),
        bos_token_id=getattr(tokenizer, "bos_token_id", None) if add_bos else None,
        block_size=vllm_config.cache_config.block_size,
        tiers=lower_tiers(store, expected=expected, pin=pin),
    )


def _fingerprint(model: str, dtype: torch.dtype) -> str:
    from pic.vllm.fingerprint import folder_fingerprint

    if not Path(model).is_dir():
        raise ModelLoadError(
            f"vLLM's model {model!r} is not a local folder, which pic's connector fingerprints; pass the folder, or "
            f"kv_connector_extra_config['fingerprint'] (pic.load(model).fingerprint)"
        )
    return folder_fingerprint(model, dtype)


def _tokenizer(model_config: object) -> object:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_config.tokenizer)
