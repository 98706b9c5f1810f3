"""pic's model fingerprint of a checkpoint folder, read without loading the model.

A chunk's cache id hashes the fingerprint of the model that compiled it (``pic.ids.model_fingerprint``:
the config and the first and last 64 elements of every tensor of the loaded model's ``state_dict``). vLLM
loads the same checkpoint into its own modules (fused ``qkv_proj``, other names), so the connector cannot
ask vLLM's model; it builds the Hugging Face module tree on the meta device (names, shapes, tied weights;
no memory) and reads each tensor's two ends from the safetensors files (``get_slice``: a few hundred bytes
each). The result equals ``pic.load(folder, dtype=...).fingerprint`` (tested on SmolLM2), so ids compiled by
pic's engine and by vLLM through the connector name the same chunks.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from pic.errors import ModelLoadError
from pic.ids import _CONFIG_NOISE, _SAMPLE


def folder_fingerprint(folder: str | Path, dtype: torch.dtype) -> str:
    """``model_fingerprint`` of the model in ``folder`` loaded in ``dtype``.

    Raises:
        ModelLoadError: no safetensors files, or a parameter the files do not hold (neither itself nor
            a weight it is tied to).
    """
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{str(folder)!r} holds no *.safetensors file; the connector reads weights from them")
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    ties = _tied_names(model)
    handles = {}
    for path in files:
        handle = safe_open(str(path), framework="pt")
        handles.update({name: handle for name in handle.keys()})
    h = hashlib.sha256()
    kept = {k: v for k, v in model.config.to_dict().items() if k not in _CONFIG_NOISE}
    h.update(json.dumps(kept, sort_keys=True, default=str).encode())
    for name, param in sorted(model.state_dict().items()):
        h.update(f"{name}:{param.dtype}:{tuple(param.shape)}".encode())
        source = next((n for n in (name, *ties.get(name, ())) if n in handles), None)
        if source is None:
            raise ModelLoadError(f"{str(folder)!r}: no tensor {name!r} in its safetensors files")
        h.update(_ends(handles[source].get_slice(source), param.dtype))
    return h.hexdigest()[:32]


def _tied_names(model: torch.nn.Module) -> dict[str, tuple[str, ...]]:
    """state_dict name -> the other names of the same tensor (tied embeddings)."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return {n: tuple(o for o in names if o != n) for names in groups.values() for n in names}


def _ends(tensor_slice: object, dtype: torch.dtype) -> bytes:
    """The first and last ``_SAMPLE`` elements (flattened) in ``dtype``, as ``pic.ids._tensor_bytes`` hashes them."""
    shape = tensor_slice.get_shape()
    numel = int(torch.tensor(shape).prod()) if shape else 1
    if numel <= 2 * _SAMPLE:
        flat = tensor_slice[:].flatten() if shape else tensor_slice[()].reshape(1)
    elif len(shape) == 1:
        flat = torch.cat((tensor_slice[:_SAMPLE], tensor_slice[numel - _SAMPLE : numel]))
    else:
        last = shape[-1]
        rows = -(-_SAMPLE // last)  # enough leading rows (over the last dim) to hold the sample
        head = _rows(tensor_slice, shape, 0, rows).flatten()[:_SAMPLE]
        tail = _rows(tensor_slice, shape, -rows, None).flatten()[-_SAMPLE:]
        flat = torch.cat((head, tail))
    return flat.to(dtype).contiguous().view(torch.uint8).numpy().tobytes()


def _rows(tensor_slice: object, shape: list[int], start: int, stop: int | None) -> torch.Tensor:
    """Rows ``start:stop`` of the tensor flattened to 2-D ``[numel // last, last]``, read from the file."""
    # Index the leading dims one at a time: safetensors slices a prefix of dims, not a flat range.
    outer = shape[:-1]
    num_rows = int(torch.tensor(outer).prod())
    first = num_rows + start if start < 0 else start
    last = num_rows if stop is None else stop
    parts = []
    for row in range(first, last):
        index = []
        for size in reversed(outer):
            index.append(row % size)
            row //= size
        parts.append(tensor_slice[tuple(reversed(index))])
    return torch.stack(parts)
