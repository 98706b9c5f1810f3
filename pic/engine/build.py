"""The composition root: a model and tokenizer, plus the configs, become a ready ``EngineCore``."""

from __future__ import annotations

import torch

from pic.config import PICConfig, StoreConfig
from pic.engine.core import EngineCore
from pic.engine.kv_manager import KVManager
from pic.kv.memory import build_kv_pool
from pic.link.linker import Linker
from pic.model import ModelRunner
from pic.store import TieredStore
from pic.store.device import DeviceTier
from pic.store.serde import Expected

# A step's token budget by default: on a GPU a step's time barely grows with its tokens up to thousands; on a
# CPU it grows with every token, and the running streams wait for the whole step.
_STEP_TOKENS_CUDA, _STEP_TOKENS_CPU = 8192, 256


def default_step_tokens(model: torch.nn.Module) -> int:
    """``PICConfig.max_num_batched_tokens`` when it is ``None``: by the device the model is on."""
    device = next(model.parameters()).device
    return _STEP_TOKENS_CUDA if device.type == "cuda" else _STEP_TOKENS_CPU


def build_core(
    model: torch.nn.Module,
    tokenizer: object,
    *,
    config: PICConfig,
    store: StoreConfig,
    fingerprint: str,
    bos_token_id: int | None,
    eos_token_ids: frozenset[int],
) -> EngineCore:
    """Runner, KV pool and tensors, store tiers and KV manager, wired into one core.

    Raises:
        UnsupportedModelError: the model has no rotary embeddings or an unsupported layer layout.
        InvalidInputError: a KV pool larger than the device's free memory; a bad attention backend.
        StoreUnavailableError: an unreachable Redis (``on_redis_error="raise"``).
    """
    runner = ModelRunner(model, attention_backend=config.attention_backend, decode_weights=config.decode_weights)
    spec = runner.spec
    expected = Expected(
        fingerprint=fingerprint,
        num_layers=spec.num_layers,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        dtype=spec.dtype,
        max_tokens=spec.max_context,
        vocab_size=spec.vocab_size,
    )
    pool, cache = build_kv_pool(
        num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, dtype=spec.dtype,
        device=spec.device, block_size=config.block_size, kv_pool_tokens=config.kv_pool_tokens,
        memory_fraction=config.kv_memory_fraction,
    )  # fmt: skip
    runner.attention_backend.precompile(cache.k[0], cache.v[0])  # every kernel variant, before any request
    tiers = TieredStore.from_config(store, device=DeviceTier(pool, cache), expected=expected)
    kv = KVManager(pool, cache, tiers, block_size=config.block_size)
    linker = Linker(
        spec, pool, block_size=config.block_size, share_chunk_blocks=config.share_chunk_blocks,
        attention_backend=runner.attention_backend.name,
    )  # fmt: skip
    return EngineCore(
        runner=runner, tokenizer=tokenizer, pool=pool, cache=cache, store=tiers, kv=kv, linker=linker, config=config,
        bos_token_id=bos_token_id, eos_token_ids=eos_token_ids,
    )  # fmt: skip
