"""Loading a Hugging Face model and tokenizer by name or path."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from pic.errors import InvalidInputError, ModelLoadError

EMBEDDED_MODEL = Path(__file__).resolve().parent.parent / "models" / "stories260K"
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` -> CUDA when available, else CPU.

    Raises:
        InvalidInputError: not a torch device, or one this machine does not have (``"cuda"`` without
            a GPU or a CUDA build of torch, ``"cuda:3"`` on a one-GPU machine).
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise InvalidInputError(f"device {device!r} is not a torch device") from None
    try:
        torch.empty(0, device=resolved)
    except (AssertionError, RuntimeError) as exc:  # torch asserts when it was built without CUDA
        raise InvalidInputError(
            f"device {str(device)!r} is not available on this machine: {_first_line(exc)}"
        ) from None
    return resolved


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``None`` -> bfloat16 on CUDA, float32 elsewhere; names as in ``torch`` (``"bfloat16"``)."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.removeprefix("torch.")]
    raise InvalidInputError(f"dtype {dtype!r} is not one of {', '.join(_DTYPES)}")


def load_pretrained(
    name_or_path: str | os.PathLike, *, device: torch.device, dtype: torch.dtype, progress: bool = False
):
    """``(model, tokenizer)`` from the Hub cache or a local directory.

    Args:
        progress: show transformers' "Loading weights" bar.

    Raises:
        ModelLoadError: no such folder, not on the Hub or not in the cache while offline
            (``HF_HUB_OFFLINE=1``), or not a causal LM transformers knows.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = str(name_or_path)
    looks_like_path = isinstance(name_or_path, os.PathLike) or name.startswith(("/", "./", "../", "~"))
    if looks_like_path and not os.path.isdir(os.path.expanduser(name)):
        raise ModelLoadError(f"cannot load model {name!r}: no such folder")
    try:
        with _progress_bars(progress):
            model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError, KeyError) as exc:  # what transformers raises for a missing or unknown model
        raise ModelLoadError(
            f"cannot load model {name!r}: {_first_line(exc)} (give a local folder with config.json and weights, or a "
            f"Hub name that is downloaded or reachable; offline, HF_HUB_OFFLINE=1 reads the Hugging Face cache)"
        ) from exc
    return model.to(device), tokenizer


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


@contextlib.contextmanager
def _progress_bars(enabled: bool) -> Iterator[None]:
    """transformers' progress bars on or off for the block, restored afterwards."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


def model_eos_ids(model: torch.nn.Module, tokenizer: object) -> set[int]:
    """The token ids that end a generation: the generation config's EOS, else the tokenizer's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else set(eos)
