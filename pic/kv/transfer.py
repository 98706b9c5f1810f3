"""Host data to the device without a host sync.

``torch.tensor(values, device="cuda")`` and ``tensor.to("cuda")`` copy with ``non_blocking=False``: CUDA
copies, then the host waits until the stream is idle, i.e. until every kernel queued before the copy has
run. In a decode loop that stalls the CPU once per small tensor, so the next step's kernels are queued
late. A non-blocking copy from pageable memory does not wait for the stream: CUDA stages the bytes before
it returns (so the CPU tensor may be freed or changed at once), and the copy is ordered on the stream
before every kernel queued after it. On the CPU both are plain tensors, no copy. ``sync_sites`` finds the
syncs that remain (the tests and ``benchmarks/profile_link.py`` list them).
"""

from __future__ import annotations

import warnings
from array import array
from collections.abc import Callable, Sequence

import torch


def long_tensor(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """``[len(values)]`` int64 on ``device``, without a host sync (through an ``array`` of C ints: a quarter of
    ``torch.tensor``'s time on a block table of thousands)."""
    if len(values) == 0:
        return to_device(torch.empty(0, dtype=torch.long), device)
    return to_device(torch.frombuffer(array("q", values), dtype=torch.long), device)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU ``tensor`` (pageable or pinned) on ``device``, without a host sync; itself when already there.

    A pinned source is copied asynchronously: it must not be written until the copy has run. Freeing it
    is safe: torch's pinned-memory allocator records the copy and reuses the memory only after it.
    """
    return tensor.to(device, non_blocking=True)


def sync_sites(fn: Callable[[], object]) -> list[tuple[str, int]]:
    """``(file, line)`` of every synchronizing CUDA call ``fn()`` makes, by torch's sync debug mode (a prototype: it
    may miss some). The mode is process-wide, so calls from other threads are caught too."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return [(w.filename, w.lineno) for w in caught if "synchroniz" in str(w.message)]
