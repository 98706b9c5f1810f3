"""Loading a Hugging Face model and tokenizer by name or path."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from pic.errors import InvalidInputError, ModelLoadError, first_line
from pic.model.dtypes import choose_dtype
from pic.model.gguf import KNOWN_GGUF_MODELS, converted, gguf_cache_dir, gguf_path
from pic.model.hub import HubAccess, close_model_name, hub_access

EMBEDDED_MODEL = Path(__file__).resolve().parent.parent / "models" / "stories260K"


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
        raise InvalidInputError(f"device {str(device)!r} is not available on this machine: {first_line(exc)}") from None
    return resolved


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``choose_dtype(dtype, device).dtype`` (``pic.model.dtypes``: ``None`` -> bfloat16 on CUDA, float32 on the CPU;
    ``"auto"`` -> bfloat16 on a CPU with a bfloat16 unit)."""
    return choose_dtype(dtype, device).dtype


def load_pretrained(
    name_or_path: str | os.PathLike,
    *,
    device: torch.device,
    dtype: torch.dtype,
    gguf_file: str | None = None,
    progress: bool = False,
):
    """``(model, tokenizer)`` from the Hub cache, a local directory, or a GGUF file.

    A GGUF model (``"smollm2"``, a path ending in ``.gguf``, or ``gguf_file`` inside the folder or Hub
    repository ``name_or_path``) is dequantized once into a cache folder and loaded from there
    (``pic.model.gguf``).

    Args:
        progress: show transformers' "Loading weights" bar (and the GGUF conversion's).

    Raises:
        ModelLoadError: no such folder or file, not on the Hub or not in the cache while offline
            (``HF_HUB_OFFLINE=1``, or the Hub out of reach: then it fails at once, ``pic.model.hub``), not a
            causal LM transformers knows, or a GGUF model whose packages are missing (the message says what
            to install); a name close to a known one says ``did you mean 'smollm2'``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = str(name_or_path)
    source = gguf_path(name_or_path, gguf_file)
    if source is not None:
        with progress_bars(progress):
            name = str(converted(source))
    elif isinstance(name_or_path, os.PathLike) or name.startswith(("/", "./", "../", "~")):
        if not os.path.isdir(os.path.expanduser(name)):
            raise ModelLoadError(f"cannot load model {name!r}: no such folder")
    access = HubAccess(online=True) if os.path.isdir(os.path.expanduser(name)) else hub_access()
    try:
        with progress_bars(progress):
            model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, local_files_only=not access.online)
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=not access.online)
    except (OSError, ValueError, KeyError) as exc:  # what transformers raises for a missing or unknown model
        raise ModelLoadError(_not_loaded(name, exc, access)) from exc
    return model.to(device), tokenizer


def _not_loaded(name: str, exc: BaseException, access: HubAccess) -> str:
    """Why ``name`` did not load: the name the user probably meant first, then transformers' reason, and
    whether the Hub was asked."""
    meant = close_model_name(name, KNOWN_GGUF_MODELS)
    guess = f" (did you mean {meant!r}, {KNOWN_GGUF_MODELS[meant]}?)" if meant else ""
    asked = "" if access.online else f" (only the Hugging Face cache was read: {access.reason})"
    return (
        f"cannot load model {name!r}{guess}: {first_line(exc)}{asked} (give a local folder with config.json and "
        f"weights, a GGUF file, or a Hub name that is in the Hugging Face cache or reachable)"
    )


@contextlib.contextmanager
def progress_bars(enabled: bool) -> Iterator[None]:
    """transformers' progress bars on or off for the block, restored afterwards."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


def model_name(model: torch.nn.Module) -> str:
    """A short name for reports: the Hub name, the folder name of a local model (``stories260K`` for the
    embedded one), or the GGUF file's stem for a converted GGUF model."""
    name = str(getattr(model, "name_or_path", "") or type(model).__name__)
    if not os.path.isdir(name):
        return name
    folder = Path(name).resolve()
    if folder.parent == gguf_cache_dir().resolve():
        return folder.name.rsplit("-", 1)[0]  # "<file stem>-<hash>"
    return folder.name


def model_eos_ids(model: torch.nn.Module, tokenizer: object) -> set[int]:
    """The token ids that end a generation: the generation config's EOS, else the tokenizer's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else set(eos)
