"""The composition root of the core, and the one entry the caller's side (``pic.engine.caller``) takes from it:
``start_core`` turns a model, a tokenizer and the configs into a running core thread, and returns the command
channel to it (``Started.channel``) with what the callers need to know of the model and the store."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pic.compile import SharedTokenizer, tokenizer_adds_bos
from pic.config import AttentionBackendName, PICConfig, StoreConfig
from pic.engine.commands import Channel
from pic.engine.core.core import CoreThread, EngineCore
from pic.engine.core.kv_manager import KVManager
from pic.ids import model_fingerprint
from pic.kv.memory import build_kv_pool
from pic.link.linker import Linker
from pic.model import ModelRunner, ModelSpec
from pic.model.loading import model_eos_ids
from pic.store import TieredStore
from pic.store.serde import Expected

# A step's token budget by default: on a GPU a step's time barely grows with its tokens up to thousands; on a
# CPU it grows with every token, and the running streams wait for the whole step.
_STEP_TOKENS_CUDA, _STEP_TOKENS_CPU = 8192, 256


@dataclass(frozen=True)
class Started:
    """A core running on its thread, as its callers see it: the way in (``channel``), the engine's options with their
    ``None`` defaults resolved for this model, the tokenizer (safe from any thread), the runner's shapes and attention
    backend, the chunk store (its device tier is read on the core thread only: ``StoreView``), the model's identity
    in cache ids, its BOS and the tokens that end a generation."""

    channel: Channel
    config: PICConfig
    tokenizer: SharedTokenizer
    spec: ModelSpec
    attention_backend: AttentionBackendName
    store: TieredStore
    fingerprint: str
    bos_token_id: int | None
    eos_token_ids: frozenset[int]


def resolve_config(config: PICConfig, model: torch.nn.Module, tokenizer: object) -> PICConfig:
    """``config`` with its model-dependent ``None`` defaults resolved: a BOS exactly when the tokenizer writes one,
    the step budget of the model's device."""
    if config.add_bos is None:
        config = config.model_copy(update={"add_bos": tokenizer_adds_bos(tokenizer)})
    if config.max_num_batched_tokens is None:
        cuda = next(model.parameters()).device.type == "cuda"
        config = config.model_copy(update={"max_num_batched_tokens": _STEP_TOKENS_CUDA if cuda else _STEP_TOKENS_CPU})
    return config


def start_core(model: torch.nn.Module, tokenizer: object, *, config: PICConfig, store: StoreConfig) -> Started:
    """Build the core over ``model`` (raising as ``build_core``) and start its thread."""
    if not isinstance(tokenizer, SharedTokenizer):  # used by callers' threads and the engine's at once
        tokenizer = SharedTokenizer(tokenizer)
    config = resolve_config(config, model, tokenizer)
    eos = config.eos_token_ids
    eos_ids = frozenset(model_eos_ids(model, tokenizer) if eos is None else eos)
    bos: int | None = getattr(tokenizer, "bos_token_id", None)
    fingerprint = model_fingerprint(model)
    core = build_core(
        model, tokenizer, config=config, store=store, fingerprint=fingerprint, bos_token_id=bos, eos_token_ids=eos_ids
    )
    return Started(
        channel=CoreThread(core), config=config, tokenizer=tokenizer, spec=core.runner.spec,
        attention_backend=core.runner.attention_backend.name, store=core.store, fingerprint=fingerprint,
        bos_token_id=bos, eos_token_ids=eos_ids,
    )  # fmt: skip


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
    if config.cuda_graphs or (config.cuda_graphs is None and runner.graphs_refused() is None):
        runner.use_graphs(capture=True)
    spec = runner.spec
    expected = Expected(
        fingerprint=fingerprint, num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
        dtype=spec.dtype, max_tokens=spec.max_context, vocab_size=spec.vocab_size, bos_token_id=bos_token_id,
    )  # fmt: skip
    pool, cache = build_kv_pool(
        num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, dtype=spec.dtype,
        device=spec.device, block_size=config.block_size, kv_pool_tokens=config.kv_pool_tokens,
        memory_fraction=config.kv_memory_fraction, kv_shares={n: q.kv_share for n, q in config.quotas.items()},
    )  # fmt: skip
    runner.attention_backend.precompile(cache.k[0], cache.v[0])  # every kernel variant, before any request
    quotas = config.quotas
    kv = KVManager(
        pool, cache, block_size=config.block_size, kv_bytes_per_token=spec.kv_bytes_per_token,
        store_over=lambda device: TieredStore.from_config(store, device=device, expected=expected, quotas=quotas),
    )  # fmt: skip
    linker = Linker(
        spec, is_resident=kv.is_resident, block_size=config.block_size, share_chunk_blocks=config.share_chunk_blocks,
        attention_backend=runner.attention_backend.name,
    )  # fmt: skip
    return EngineCore(
        runner=runner, tokenizer=tokenizer, kv=kv, linker=linker, config=config,
        bos_token_id=bos_token_id, eos_token_ids=eos_token_ids,
    )  # fmt: skip
