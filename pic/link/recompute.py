"""The recompute pass: chunk blocks mapped (or copied where written), selected tokens run fresh,
first-token logits out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pic.kv import ChunkInfo, ChunkKV, KVCache, RequestKV
from pic.link.assemble import assemble
from pic.link.layout import Layout
from pic.link.policies import Policy
from pic.link.step import LayerStep
from pic.model import ModelRunner
from pic.store import TieredStore


@dataclass
class Recomputed:
    """A linked request ready to decode.

    Attributes:
        req: the request's KV (caller releases it).
        logits: ``[num_query_tokens, vocab_size]`` float32, next-token logits at each query position.
        recomputed: ``[T]`` bool (CPU), the tokens that ran the last layer fresh (for a static
            policy: every layer).
        recomputed_by_layer: tokens run fresh in each layer, first layer first.
        num_shared_blocks: block-table entries aliasing a chunk's canonical block (no copy).
        num_private_blocks: blocks the request owns (prefix, query, copy-on-write chunk blocks).
    """

    req: RequestKV
    logits: torch.Tensor
    recomputed: torch.Tensor
    recomputed_by_layer: tuple[int, ...]
    num_shared_blocks: int
    num_private_blocks: int


def recompute(
    runner: ModelRunner,
    store: TieredStore,
    layout: Layout,
    chunks: Sequence[ChunkInfo | ChunkKV],
    policy: Policy,
    *,
    share: bool = True,
) -> Recomputed:
    """Map the chunks' cached KV into a new request and run the tokens ``policy`` selects through the layers.

    Args:
        layout: the linked prompt's layout.
        chunks: what ``TieredStore.resolve`` returned for each chunk of ``layout.chunks``, in order.
        policy: chooses the tokens (``recompute_mask``), and for a dynamic policy drops some of
            them after a layer (``keep_mask``).
        share: map clean chunk blocks without copying them (``PICConfig.share_chunk_blocks``).
            A dynamic policy writes every chunk token in its early layers, so it always gets copies.

    Raises:
        PolicyError: the policy returned a malformed selection or cannot run on this model.
        KVPoolExhaustedError: the pool cannot hold the request (nothing is taken then).
    """
    policy.check_model(num_layers=runner.spec.num_layers)
    selected = policy.recompute_mask(layout)  # [T] bool, CPU
    dirty = selected if share and not policy.is_dynamic else torch.ones_like(selected)
    assembly = assemble(store, layout, chunks, dirty)
    req, device = assembly.req, runner.spec.device
    try:
        slots, positions = layout.slots.to(device), layout.positions.to(device)
        req.kv_positions[slots] = positions
        index = selected.nonzero().squeeze(1).to(device)  # [N] prompt indices of the tokens run
        num_layers = runner.spec.num_layers
        tracker = (
            _PassTracker(req.cache, num_layers, layout, assembly.source_rows, policy, index)
            if policy.is_dynamic
            else None
        )
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
    req.release_held()  # the pass is over: canonical blocks the request copied are no longer read
    tokens, counts = (tracker.tokens, tracker.counts) if tracker else (index, [index.shape[0]] * num_layers)
    recomputed = torch.zeros(layout.num_tokens, dtype=torch.bool)
    recomputed[tokens.cpu()] = True
    return Recomputed(
        req=req,
        logits=logits,
        recomputed=recomputed,
        recomputed_by_layer=tuple(counts),
        num_shared_blocks=assembly.num_shared_blocks,
        num_private_blocks=assembly.num_private_blocks,
    )


class _PassTracker:
    """The runner's ``after_layer`` hook for a dynamic policy: counts the tokens run per layer, asks the
    policy which keep running, and remembers the tokens that ran the last layer."""

    def __init__(
        self,
        cache: KVCache,
        num_layers: int,
        layout: Layout,
        source_rows: torch.Tensor,
        policy: Policy,
        index: torch.Tensor,
    ) -> None:
        self._cache, self._num_layers, self._layout = cache, num_layers, layout
        self._source_rows, self._policy = source_rows, policy
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
            source_rows=self._source_rows[self.tokens],
            cache=self._cache,
        )
        return self._policy.keep_mask(step)
