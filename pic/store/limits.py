"""Limits a store config is checked against on the machine that loads it (a ``StoreConfig`` itself is portable: it
may be written on one machine for another)."""

from __future__ import annotations

from pic.errors import InvalidInputError
from pic.kv.memory import format_bytes, physical_memory_bytes


def check_cpu_tier(cpu_bytes: int | None) -> None:
    """Refuse a CPU tier larger than this machine's physical memory when the store is built (at load): it could
    never hold what it promises, and would fill the machine's memory, swap and all, before evicting. A config is
    checked on the machine that loads it, not where it was written (``StoreConfig`` itself is portable).

    Raises:
        InvalidInputError: naming ``StoreConfig.cpu_bytes``, its value and the machine's memory.
    """
    total = physical_memory_bytes()
    if cpu_bytes is not None and total is not None and cpu_bytes > total:
        raise InvalidInputError(
            f"StoreConfig.cpu_bytes={cpu_bytes} ({format_bytes(cpu_bytes)}) is more than this machine's "
            f"{format_bytes(total)} of physical memory: give the CPU tier at most that ({total} bytes), less what the "
            "model and the KV pool need, or 0 for no CPU tier"
        )
