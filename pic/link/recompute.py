"""The recompute pass: cached chunk KV in, selected tokens run fresh, first-token logits out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pic.kv import ChunkKV, KVPool, RequestKV
from pic.link.layout import Layout
from pic.link.policies import Policy
from pic.link.step import LayerStep
from pic.model import ModelRunner


@dataclass
class Recomputed:
    """A linked request ready to decode.

    Attributes:
        req: the request's KV (caller releases it).
        logits: ``[num_query_tokens, vocab_size]`` float32, next-token logits at each query position.
        recomputed: ``[T]`` bool (CPU), the tokens that ran the last layer fresh (for a static
            policy: every layer).
        recomputed_by_layer: tokens run fresh in each layer, first layer first.
    """

    req: RequestKV
    logits: torch.Tensor
    recomputed: torch.Tensor
    recomputed_by_layer: tuple[int, ...]


def recompute(
    runner: ModelRunner, pool: KVPool, layout: Layout, chunks: Sequence[ChunkKV], policy: Policy
) -> Recomputed:
    """Lay cached KV into a new request and run the tokens ``policy`` selects through the layers.

    Args:
        layout: the linked prompt's layout.
        chunks: the chunks of ``layout.chunks``, in order.
        policy: chooses the tokens (``recompute_mask``), and for a dynamic policy drops some of
            them after a layer (``keep_mask``).

    Raises:
        PolicyError: the policy returned a malformed selection or cannot run on this model.
        KVPoolExhaustedError: the pool cannot hold the request (nothing is allocated then).
    """
    policy.check_model(num_layers=runner.spec.num_layers)
    selected = policy.recompute_mask(layout)  # [T] bool, CPU
    device = runner.spec.device
    req = RequestKV(pool, layout.num_slots)
    try:
        slots, positions = layout.slots.to(device), layout.positions.to(device)
        req.kv_positions[slots] = positions
        # a dynamic policy may drop any chunk token mid-pass, which then needs its cached KV there
        _copy_cached(req, layout, chunks, skip=None if policy.is_dynamic else selected)
        index = selected.nonzero().squeeze(1).to(device)  # [N] prompt indices of the tokens run
        num_layers = runner.spec.num_layers
        tracker = _PassTracker(req.pool, num_layers, layout, chunks, policy, index) if policy.is_dynamic else None
        num_query = layout.query.num_tokens
        logits = runner.forward(
            req,
            token_ids=layout.token_ids.to(device)[index],
            positions=positions[index],
            slots=slots[index],
            logits_rows=torch.arange(index.shape[0] - num_query, index.shape[0], device=device),
            after_layer=tracker,
        )
    except BaseException:
        req.release()
        raise
    tokens, counts = (tracker.tokens, tracker.counts) if tracker else (index, [index.shape[0]] * num_layers)
    recomputed = torch.zeros(layout.num_tokens, dtype=torch.bool)
    recomputed[tokens.cpu()] = True
    return Recomputed(req=req, logits=logits, recomputed=recomputed, recomputed_by_layer=tuple(counts))


def _copy_cached(req: RequestKV, layout: Layout, chunks: Sequence[ChunkKV], *, skip: torch.Tensor | None) -> None:
    """Copy the chunks' KV (all layers) into the request's slots, except tokens marked in ``skip`` ``[T]``."""
    pool, device = req.pool, req.block_table.device
    for seg, chunk in zip(layout.chunks, chunks, strict=True):
        keep = torch.ones(seg.num_tokens, dtype=torch.bool) if skip is None else ~skip[seg.tokens]
        keep = keep.to(device)
        rows = req.physical(layout.slots[seg.tokens].to(device)[keep])
        pool.k_rows[:, rows] = chunk.k[:, keep]
        pool.v_rows[:, rows] = chunk.v[:, keep]


class _PassTracker:
    """The runner's ``after_layer`` hook for a dynamic policy: counts the tokens run per layer, asks the
    policy which keep running, and remembers the tokens that ran the last layer."""

    def __init__(
        self,
        pool: KVPool,
        num_layers: int,
        layout: Layout,
        chunks: Sequence[ChunkKV],
        policy: Policy,
        index: torch.Tensor,
    ) -> None:
        self._pool, self._num_layers, self._layout = pool, num_layers, layout
        self._chunks, self._policy = chunks, policy
        self._index = index  # [N] prompt indices of the tokens the pass started with
        self._cached = layout.cached.to(index.device)  # [T], moved to the device once per pass
        self.tokens = index  # prompt indices of the tokens that ran the latest layer
        self.counts: list[int] = []

    def __call__(self, layer: int, alive: torch.Tensor, rows: torch.Tensor) -> torch.Tensor | None:
        self.tokens = self._index[alive]
        self.counts.append(self.tokens.shape[0])
        step = LayerStep(
            layer=layer,
            num_layers=self._num_layers,
            layout=self._layout,
            tokens=self.tokens,
            cached=self._cached[self.tokens],
            rows=rows,
            pool=self._pool,
            chunks=self._chunks,
        )
        return self._policy.keep_mask(step)
