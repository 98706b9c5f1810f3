"""What both sides of the connector derive from vLLM's config: the model's identity in pic and pic's store.

Configured through ``kv_connector_extra_config`` (every key optional)::

    {"store": {"disk_path": "/srv/pic", "redis_url": "redis://cache:6379", ...},   # pic.StoreConfig's fields
     "fingerprint": "...",   # pic's fingerprint of the model (default: read from the checkpoint folder)
     "add_bos": false}       # compile options (default: whether the tokenizer writes a BOS, as pic.load decides)
"""

from __future__ import annotations

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


def build_setup(vllm_config: object) -> Setup:
    """The connector's setup from vLLM's config (``kv_transfer_config.kv_connector_extra_config``).

    Raises:
        InvalidInputError: a malformed extra config (naming the key); no store tier configured.
        ModelLoadError: no local checkpoint folder to fingerprint and no ``fingerprint`` given.
    """
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    unknown = set(extra) - {"store", "fingerprint", "add_bos"}
    if unknown:
        raise InvalidInputError(
            f"kv_connector_extra_config has unknown keys {sorted(unknown)}; pic reads store, fingerprint, add_bos"
        )
    store = StoreConfig.model_validate(extra.get("store", {}))
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
