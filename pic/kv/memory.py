"""How much memory a device has free, so that an oversized KV pool is refused before it is allocated."""

from __future__ import annotations

import os

import torch

from pic.errors import InvalidInputError


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
    where it cannot be told (then no check is made)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
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


def format_bytes(num_bytes: int) -> str:
    """``"1.5 GiB"``."""
    value, unit = float(num_bytes), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            break
        value /= 1024
    return f"{value:.1f} {unit}"
