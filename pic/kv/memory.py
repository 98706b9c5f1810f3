"""Sizing the KV pool from the device's free memory, and refusing one that does not fit before it is allocated."""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from pic.errors import InvalidInputError
from pic.kv.block_pool import BlockPool
from pic.kv.cache import KVCache, blocks_for

# The CPU pool's default capacity in tokens, lowered to a quarter of the memory available.
DEFAULT_CPU_POOL_TOKENS = 65536


def pool_num_tokens(
    *, kv_pool_tokens: int | None, bytes_per_token: int, device: torch.device, memory_fraction: float
) -> tuple[int, str]:
    """The KV pool's capacity in tokens, and how it was sized (for messages).

    ``kv_pool_tokens`` when given; else, on CUDA, ``memory_fraction`` of the device's free memory (the
    model's weights are loaded by then, as vLLM's ``gpu_memory_utilization`` budgets them); elsewhere
    ``DEFAULT_CPU_POOL_TOKENS``, at most a quarter of the available memory.
    """
    if kv_pool_tokens is not None:
        return kv_pool_tokens, f"PICConfig.kv_pool_tokens={kv_pool_tokens}"
    free = available_bytes(device)
    if device.type == "cuda" and free is not None:
        tokens = int(free * memory_fraction) // bytes_per_token
        return max(1, tokens), f"the default KV pool ({memory_fraction:g} of {format_bytes(free)} free on {device})"
    tokens = DEFAULT_CPU_POOL_TOKENS if free is None else min(DEFAULT_CPU_POOL_TOKENS, free // 4 // bytes_per_token)
    return max(1, tokens), "the default KV pool"


def check_fits(num_bytes: int, device: torch.device, *, what: str) -> None:
    """Refuse an allocation larger than the device's free memory before torch tries it (a typo such as
    ``kv_pool_tokens=10**12`` would otherwise ask for hundreds of TiB).

    Raises:
        InvalidInputError: naming ``what``, the bytes it needs and the bytes free.
    """
    free = available_bytes(device)
    if free is not None and num_bytes > free:
        raise InvalidInputError(f"{what} needs {format_bytes(num_bytes)} but {device} has {format_bytes(free)} free")


def available_bytes(device: torch.device) -> int | None:
    """Free memory on ``device`` in bytes: CUDA's free memory, the CPU's ``MemAvailable``; ``None``
    where it cannot be told (then no check is made).

    On CUDA, memory that torch's caching allocator holds but no tensor uses (left by loading the model, say)
    counts as free: ``mem_get_info`` reports it used, yet an allocation that does not fit returns it to
    the driver and retries before it fails.
    """
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type == "cpu":
        return _cpu_available_bytes()
    return None


def _cpu_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:  # other POSIX systems: free pages (an underestimate: caches are not counted)
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def physical_memory_bytes() -> int | None:
    """This machine's physical memory in bytes, free or not (``None`` where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no such sysconf name on this system
        return None


def format_bytes(num_bytes: int) -> str:
    """``"1.5 GiB"``."""
    value, unit = float(num_bytes), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            break
        value /= 1024
    return f"{value:.1f} {unit}"


def build_kv_pool(
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    block_size: int,
    kv_pool_tokens: int | None,
    memory_fraction: float,
    kv_shares: Mapping[str, float] | None = None,
) -> tuple[BlockPool, KVCache]:
    """The block pool and its KV tensors, refused before allocation when they exceed the device's free memory.

    Plain numbers in, so the pool knows nothing of models or configs (the engine's builder reads them
    from ``ModelSpec`` and ``PICConfig``).

    Args:
        num_layers, num_kv_heads, head_dim, dtype, device: the model's KV shape, dtype and device.
        block_size: tokens per block.
        kv_pool_tokens: the pool's capacity in tokens; ``None`` sizes it from free memory (``pool_num_tokens``).
        memory_fraction: the share of free CUDA memory a pool sized from free memory takes.
        kv_shares: namespace -> the share of the pool's blocks its chunks keep against other namespaces.

    Raises:
        InvalidInputError: the pool does not fit, naming its size and the memory free.
    """
    bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize
    num_tokens, sized = pool_num_tokens(
        kv_pool_tokens=kv_pool_tokens, bytes_per_token=bytes_per_token, device=device, memory_fraction=memory_fraction
    )
    # A share of the free CUDA memory rounds down to whole blocks (up, it could pass what is free, and
    # kv_memory_fraction=1 would be refused); a given size rounds up, to hold the tokens asked for.
    from_free = kv_pool_tokens is None and device.type == "cuda"
    num_blocks = max(1, num_tokens // block_size) if from_free else blocks_for(num_tokens, block_size)
    what = f"{sized} ({num_blocks} blocks of {block_size} tokens, {bytes_per_token} bytes per token)"
    check_fits(num_blocks * block_size * bytes_per_token, device, what=what)
    try:
        cache = KVCache(
            num_layers=num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            device=device,
        )
    except RuntimeError as exc:  # torch.OutOfMemoryError on CUDA, an allocator error on the CPU
        raise InvalidInputError(f"allocating {what} on {device} failed: {exc}") from None
    return BlockPool(num_blocks, block_size=block_size, kv_shares=kv_shares), cache
