"""Helpers shared by the GPU benchmarks (``attention.py``, ``ttft.py``, ``memory.py --model mistral-7b-random``).

What a results file records about the machine, a Mistral-7B-shaped model with random weights (no download), wall
times with the device synchronised, alternatives timed in turn round after round, and the optional matplotlib.
Nothing here imports transformers at module level: ``attention.py`` must set ``TRITON_INTERPRET`` before Triton is
first imported (transformers imports it), and imports this module after that.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# Mistral-7B's shapes (v0.1's, without its 4,096-token sliding window), and a tiny model of the same family for the
# CPU smoke runs. KV per token of the 7B: 32 layers x K and V x 8 heads x 128 x 2 bytes = 128 KiB in bfloat16.
MISTRAL_7B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 32000,
}
TINY_MISTRAL = MISTRAL_7B | {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "initializer_range": 0.2,  # weights large enough that greedy choices are decisive: pic's and HF's tokens agree
}


def command() -> str:
    """The command line that ran this benchmark."""
    return " ".join(["python", Path(sys.argv[0]).as_posix(), *sys.argv[1:]])


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device: torch.device) -> dict[str, Any]:
    """The machine: GPU name, memory and SMs (on CUDA), CPU, and the versions of torch, CUDA, transformers, Triton."""
    env = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "triton": _version("triton"),
        "device": str(device),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env |= {
            "gpu": torch.cuda.get_device_name(device),
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "multiprocessors": props.multi_processor_count,
            "capability": f"{props.major}.{props.minor}",
            "cuda": torch.version.cuda,
        }
    else:
        env |= {"gpu": None, "note": "CPU smoke run: its timings say nothing about a GPU"}
    return env


def random_mistral(
    shape: dict[str, int], *, max_positions: int, device: torch.device, dtype: torch.dtype, seed: int = 0
) -> torch.nn.Module:
    """A ``MistralForCausalLM`` of ``shape`` with transformers' random init (seeded), built on ``device`` in ``dtype``,
    SDPA attention, no sliding window, no EOS token (generations run to their length), in eval mode."""
    from transformers import AutoModelForCausalLM, MistralConfig

    config = MistralConfig(
        **shape,
        max_position_embeddings=max_positions,
        sliding_window=None,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    with torch.device(device):  # weights are created (and initialised) on the device: no 28 GB float32 CPU copy
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


def embedded_tokenizer() -> object:
    """The embedded stories260K tokenizer (BOS 1): the benchmarks feed token ids, so only its BOS matters."""
    from transformers import AutoTokenizer

    import pic

    return AutoTokenizer.from_pretrained(str(pic.EMBEDDED_MODEL))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """Seconds ``fn()`` took, the device synchronised before and after, and what it returned."""
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - start, result


def interleaved(fns: dict[str, Callable[[], float]], *, rounds: int) -> dict[str, list[float]]:
    """Each round calls every function once, in order (A B C, A B C, ...); each returns the time it measured.
    Machines drift: alternatives measured side by side see the same drift."""
    raw: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            raw[name].append(fn())
    return raw


def medians(raw: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(values) for name, values in raw.items()}


def write_json(path: Path, report: dict, *, quiet: bool = False) -> None:
    """Write ``report`` to ``path`` (``quiet``: without saying so, for the partial writes a long run makes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    if not quiet:
        print(f"wrote {path}")


def pyplot(path: Path) -> Any:
    """matplotlib's pyplot on the Agg backend, or ``None`` (with a message naming ``path``) when not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot ({path}); pip install 'pic-kv[eval]'")
        return None
    return plt
