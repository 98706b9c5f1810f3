"""The attention backend contract: ``plan`` once per forward, ``attend`` and ``store`` per layer.

This is FlashInfer's plan/run split. Everything every layer of a forward shares (the reference's
per-slot cos/sin and masks, the Triton kernel's int32 tiles and split scratch) is derived from the
``AttentionBatch`` in ``plan``, once, into the backend's own typed plan object; ``attend`` only reads
it. A backend knows the model's attention shape (``AttentionShape``) from construction, so its plan
can be complete: every layer's window, the GQA group, the dtype its tables are cast to.

``TorchBackend`` (``torch_backend.py``): torch ops, any device, pic's production path on the CPU (the tests hold
it, and the Triton kernel beside it, to transformers). ``TritonBackend`` (``triton_backend.py``) is the fused-RoPE
paged kernel, chosen by default on CUDA (``select.py``). Both read NoPE K by block table and rotate it at each slot's
logical position; both write fresh K/V with one store per layer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

import torch

from pic.attention.batch import AttentionBatch
from pic.config import AttentionBackendName

PlanT = TypeVar("PlanT")

# A plan dataclass field's metadata (``field(metadata=SCRATCH_FIELD)``): scratch the kernels write before they read
# it, so a copy of the plan need not copy it (``pic.model.graphs.copy_into``).
SCRATCH = "pic.scratch"
SCRATCH_FIELD = {SCRATCH: True}


@dataclass(frozen=True)
class AttentionShape:
    """The model's attention as a backend plans for it: the same in every layer but the window.

    Attributes:
        num_q_heads, num_kv_heads, head_dim: query heads, KV heads (GQA: ``num_q_heads`` a multiple), head size.
        dtype: the dtype of queries, K and V (the model's).
        sliding_windows: per layer, attend only to keys with position > query position - window (``None``: all).
    """

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    sliding_windows: tuple[int | None, ...] = (None,)


class AttentionBackend(ABC, Generic[PlanT]):
    """Fused-RoPE paged attention over NoPE K, as one forward runs it.

    Args:
        shape: the model's attention shape.
    """

    name: ClassVar[AttentionBackendName]  # what ``PICConfig.attention_backend`` calls it: TORCH or TRITON

    def __init__(self, shape: AttentionShape) -> None:
        self.shape = shape

    @abstractmethod
    def plan(self, batch: AttentionBatch) -> PlanT:
        """Everything the forward's layers share, derived from ``batch`` once (before the first layer)."""

    @abstractmethod
    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: PlanT,
        *,
        scaling: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """Attend the batch's query tokens over each one's sequence's paged KV, rotating Q and K inside.

        Args:
            q: ``[N, num_q_heads, head_dim]`` NoPE queries (not yet rotated), ``shape.dtype``.
            k_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, NoPE K of one layer.
            v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, V of one layer.
            plan: this forward's plan (from ``plan``). Slots the batch marks ``-1`` never reach the
                output, whatever they hold (NaN included).
            scaling: softmax scale (the model's ``self_attn.scaling``, usually ``head_dim ** -0.5``).
            sliding_window: one of ``shape.sliding_windows``.

        Returns:
            ``[N, num_q_heads, head_dim]`` in ``q``'s dtype. GQA: query head ``h`` reads KV head
            ``h // (num_q_heads // num_kv_heads)``.
        """

    def precompile(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> list:
        """Compile whatever ``attend`` and ``store`` will launch over caches laid out like ``k_cache`` and
        ``v_cache`` (``[num_blocks, block_size, num_kv_heads, head_dim]``, one layer's), so that no request
        waits on a compiler. Called once, at engine start. Returns what was compiled (here: nothing)."""
        return []

    @abstractmethod
    def store(self, k_rows: torch.Tensor, v_rows: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write fresh NoPE K and V into their cache rows.

        Args:
            k_rows, v_rows: ``[num_blocks * block_size, num_kv_heads, head_dim]``, one layer's rows.
            rows: ``[N]`` int64 rows to write.
            k, v: ``[N, num_kv_heads, head_dim]``, the cache's dtype.
        """
