"""Loading a Hugging Face model and tokenizer by name or path."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from pic.errors import InvalidInputError

EMBEDDED_MODEL = Path(__file__).resolve().parent.parent / "models" / "stories260K"
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` -> CUDA when available, else CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise InvalidInputError(f"device {device!r} is not a torch device") from None


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``None`` -> bfloat16 on CUDA, float32 elsewhere; names as in ``torch`` (``"bfloat16"``)."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.removeprefix("torch.")]
    raise InvalidInputError(f"dtype {dtype!r} is not one of {', '.join(_DTYPES)}")


def load_pretrained(name_or_path: str | os.PathLike, *, device: torch.device, dtype: torch.dtype):
    """``(model, tokenizer)`` from the Hub cache or a local directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(name_or_path), dtype=dtype).to(device)
    tokenizer = AutoTokenizer.from_pretrained(str(name_or_path))
    return model, tokenizer
