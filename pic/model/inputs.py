"""What a forward takes: each sequence's part (``SeqInput``), and what its per-layer hooks and attention observers
see (``LayerView``, ``LayerHook``, ``AttentionObserver``; ``ForwardObserver``: what observes whole forwards). The
engine's passes and the compile build them; the runner reads them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch

from pic.attention import AttentionBatch, RopeTable
from pic.kv import RequestKV


@dataclass(frozen=True)
class LayerView:
    """What a sequence's ``after_layer`` hook sees of the layer that just ran.

    Attributes:
        layer: the layer (0-based).
        alive: ``[n']`` int64 indices (into the sequence's ``n`` tokens) of the tokens that ran it.
        rows: ``[n']`` int64, their cache rows (their K and V of this layer are written there).
        q: ``[n', num_q_heads, head_dim]``, their queries at this layer, before RoPE.
        k_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, this layer's NoPE K.
        scaling: the layer's softmax scale.
        sliding_window: the layer's window (``None``: none).
        rope: the engine's rotary table (``pic.attention.scores.query_scores`` rotates with it).
    """

    layer: int
    alive: torch.Tensor
    rows: torch.Tensor
    q: torch.Tensor
    k_cache: torch.Tensor
    scaling: float
    sliding_window: int | None
    rope: RopeTable


# LayerView -> None or keep [n'] bool; see ``SeqInput.after_layer``.
LayerHook = Callable[[LayerView], "torch.Tensor | None"]
# (layer, q [N, Hq, D] NoPE, k_cache [num_blocks, block_size, Hkv, D] NoPE, batch, scaling, sliding_window or None)
AttentionObserver = Callable[[int, torch.Tensor, torch.Tensor, AttentionBatch, float, "int | None"], None]


@dataclass
class SeqInput:
    """One sequence's part of a forward.

    Attributes:
        kv: the sequence's KV; its other written slots are the context its tokens attend to.
        token_ids: ``[n]`` int64 (model device).
        positions: ``[n]`` int64 logical positions.
        slots: ``[n]`` int64 request slots the tokens' KV is written to.
        output_rows: ``[m]`` int64 indices into the ``n`` tokens whose final hidden states to return.
        after_layer: called after each layer with a ``LayerView`` of the sequence's tokens that ran it.
            It returns ``None`` or ``[n']`` bool: the tokens that go on to the next layer.
            Dropped tokens keep whatever KV their slots hold in later layers; ``output_rows`` tokens
            must not be dropped.
        decode: the sequence's next token after its last (a decode step): a forward in which every sequence
            decodes runs ``ModelRunner``'s decode products.
    """

    kv: RequestKV
    token_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    output_rows: torch.Tensor | None = None
    after_layer: LayerHook | None = None
    decode: bool = False


class ForwardObserver(Protocol):
    """What ``ModelRunner.observe_forwards`` calls: counters and profilers observe the runner through it (as
    ``pic.model.op_count`` does), never by patching the runner's methods."""

    def forward(self, seqs: Sequence[SeqInput]) -> AbstractContextManager[None]:
        """Entered around each forward over ``seqs``, on the thread that runs it."""

    def layer(self, index: int) -> AbstractContextManager[None]:
        """Entered around each layer of the forward (``index``: the layer's)."""
