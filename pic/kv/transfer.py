"""Host data to the device without a host sync.

``torch.tensor(values, device="cuda")`` and ``tensor.to("cuda")`` copy with ``non_blocking=False``: CUDA
copies, then the host waits until the stream is idle, i.e. until every kernel queued before the copy has
run. In a decode loop that stalls the CPU once per small tensor, so the next step's kernels are queued
late. A non-blocking copy from pageable memory does not wait for the stream: CUDA stages the bytes before
it returns (so the CPU tensor may be freed or changed at once), and the copy is ordered on the stream
before every kernel queued after it. On the CPU both are plain tensors, no copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def long_tensor(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """``[len(values)]`` int64 on ``device``, without a host sync."""
    return to_device(torch.tensor(values, dtype=torch.long), device)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU ``tensor`` (pageable or pinned) on ``device``, without a host sync; itself when already there.

    A pinned source is copied asynchronously: it must not be written until the copy has run. Freeing it
    is safe: torch's pinned-memory allocator records the copy and reuses the memory only after it.
    """
    return tensor.to(device, non_blocking=True)
