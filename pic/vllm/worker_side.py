"""The connector's worker side: load linked chunks into vLLM's paged cache layer by layer, and store
compiled prompts as pic chunks.

Loads: ``start`` fetches each job's chunk from pic's tiers (once per chunk per step); ``wait_for_layer``, which
vLLM calls inside each attention layer before it reads the cache, rotates that layer's NoPE K to the
tokens' positions in this prompt and writes K and V through the backend (``kv_io.write_layer``). On a GPU the
writes queue on the stream ahead of the layer's attention; no layer waits for another's load.
Saves: after each layer's forward, the prompt's K (rotated) and V are read back, K un-rotated to NoPE;
after the step the chunk goes to every tier.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pic.attention.rope import apply_rope
from pic.errors import UnsupportedModelError
from pic.kv import ChunkKV
from pic.namespaces import Namespace
from pic.vllm import kv_io, tenants
from pic.vllm.jobs import PicConnectorMetadata, SaveJob
from pic.vllm.setup import Setup

log = logging.getLogger("pic.vllm")
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def layer_index(layer_name: str) -> int:
    """``"model.layers.7.self_attn.attn"`` -> 7."""
    found = _LAYER_INDEX.findall(f".{layer_name}.")
    if not found:
        raise UnsupportedModelError(f"cannot tell the layer number of vLLM's attention layer {layer_name!r}")
    return int(found[0])


@dataclass(frozen=True)
class _Load:
    """One load of a step, planned once for every layer: the chunk's tokens ``part`` go to ``slots`` ``[T]`` int64,
    K rotated by ``cos``, ``sin`` ``[T, head_dim]`` (model dtype, the tokens' positions in this prompt)."""

    chunk: ChunkKV
    part: slice
    slots: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


@dataclass(frozen=True)
class _Save:
    """One prompt to store, planned once for every layer: its ``slots`` ``[T]`` int64, the angles that un-rotate
    its K (``cos``, ``sin`` ``[T, head_dim]``), and each layer's NoPE K and V as they are read."""

    job: SaveJob
    slots: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    ks: list[torch.Tensor | None]
    vs: list[torch.Tensor | None]


@dataclass(frozen=True)
class Ranks:
    """This worker's place among vLLM's tensor-parallel ranks.

    Attributes:
        heads: the chunk's KV heads this rank holds in vLLM's cache (all of them without tensor parallelism; a
            copy of one where there are fewer KV heads than ranks, as vLLM gives it).
        gather: every rank's heads from this rank's ``[num_layers, T, len(heads), head_dim]``:
            ``[num_layers, T, num_kv_heads, head_dim]``, in the chunk's head order. A collective, called by every
            rank in the same order (each rank runs the same saves in the same step); ``None`` with one rank.
        stores: whether this rank writes the chunks it saves (rank 0: one writer per chunk; the others read it from
            the shared tier the setup always has, disk or Redis, when they link it).
    """

    heads: slice
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None
    stores: bool = True


class WorkerSide:
    """One per vLLM worker (per tensor-parallel rank): a step's loads and saves.

    Args:
        setup: the connector's setup.
        rope: the model's rotary table (``kv_io.model_rope``), on the cache's device.
        ranks: this rank's KV heads, and how its saves gather the other ranks' heads.
    """

    def __init__(self, setup: Setup, rope: object, ranks: Ranks) -> None:
        self.setup, self.rope, self.ranks = setup, rope, ranks
        self._layers: dict[str, object] = {}
        self._loads: list[_Load] = []
        self._saves: list[_Save] = []
        self._failed_blocks: set[int] = set()
        self._layout: kv_io.BlockLayout | None = None
        self._save_failed: str | None = None  # why this process cannot read KV back (saves are skipped)

    def start(self, meta: PicConnectorMetadata, layers: dict[str, object]) -> None:
        """Fetch this step's chunks; remember the attention layers to write into. (vLLM calls this before the
        forward when the step loads, after it otherwise: saves do not wait for it.)"""
        self._layers = layers
        fetched: dict[tuple[Namespace, str], ChunkKV | None] = {}
        self._loads = []
        for job in meta.loads:
            key = (job.namespace, job.segment.cache_id)
            if key not in fetched:
                fetched[key] = self._fetch(*key)
            chunk = fetched[key]
            if chunk is None:  # gone since the scheduler looked: vLLM recomputes these blocks
                self._failed_blocks.update(slot // self.setup.block_size for slot in job.slots)
                continue
            seg = job.segment
            positions = torch.arange(seg.start, seg.start + seg.num_tokens, device=self.rope.device)
            cos, sin = self.rope(positions)  # once per step: every layer rotates by the same angles
            slots = torch.tensor(job.slots, dtype=torch.long, device=self.rope.device)
            self._loads.append(_Load(chunk, slice(seg.offset, seg.offset + seg.num_tokens), slots, cos, sin))

    def wait_for_layer(self, layer_name: str) -> None:
        """Write this layer's part of every load of the step (K rotated to its positions)."""
        if not self._loads:
            return
        layer, index = self._layers[layer_name], layer_index(layer_name)
        device, dtype = layer.kv_cache.device, self.setup.expected.dtype
        for load in self._loads:
            heads = self.ranks.heads
            k = load.chunk.k[index, load.part, heads].to(device=device, dtype=dtype)
            v = load.chunk.v[index, load.part, heads].to(device=device, dtype=dtype)
            k = apply_rope(k, load.cos, load.sin)
            kv_io.write_cache(layer, k.contiguous(), v.contiguous(), layer.kv_cache, load.slots)

    def save_layer(self, layer_name: str, kv_layer: torch.Tensor, meta: PicConnectorMetadata, layer: object) -> None:
        """Read this layer's K and V of every prompt to store (after the layer's forward wrote them)."""
        if not meta.saves:
            return
        if self._layout is None and self._save_failed is None:
            try:
                self._layout = kv_io.probe_layout(layer, block_size=self.setup.block_size,
                                                  num_kv_heads=kv_layer_heads(kv_layer, layer),
                                                  head_dim=self.setup.expected.head_dim)  # fmt: skip
            except UnsupportedModelError as error:  # never fail vLLM's step for a save: the chunk is not stored
                self._save_failed = str(error)
                log.error("pic: %s", error)
        if self._layout is None:
            return
        if not self._saves:  # the step's first layer: plan each save once for every layer
            self._saves = [self._plan_save(job) for job in meta.saves]
        index, dtype = layer_index(layer_name), self.setup.expected.dtype
        for save in self._saves:
            k, v = kv_io.read_layer(kv_layer, save.slots, self._layout, block_size=self.setup.block_size)
            save.ks[index] = apply_rope(k.to(dtype), save.cos, -save.sin).cpu()  # the inverse rotation: NoPE K
            save.vs[index] = v.to(dtype).cpu()

    def _plan_save(self, job: SaveJob) -> _Save:
        positions = torch.arange(len(job.slots), device=self.rope.device)
        cos, sin = self.rope(positions)
        slots = torch.tensor(job.slots, dtype=torch.long, device=self.rope.device)
        num_layers = self.setup.expected.num_layers
        return _Save(job, slots, cos, sin, [None] * num_layers, [None] * num_layers)

    def finish_saves(self) -> None:
        """Store every prompt read this step as a chunk, in every tier (a tier that refuses it is logged), and end
        the step's loads."""
        self._loads = []
        for save in self._saves:
            job = save.job
            if any(k is None for k in save.ks):
                log.warning(
                    "pic: chunk %s not stored: %d of its layers were not read", job.cache_id, save.ks.count(None)
                )
                continue
            k, v = torch.stack(save.ks), torch.stack(save.vs)
            if self.ranks.gather is not None:  # tensor parallel: this rank read its heads; the chunk holds them all
                k, v = self.ranks.gather(k), self.ranks.gather(v)
            if not self.ranks.stores:
                continue
            chunk = ChunkKV(
                cache_id=job.cache_id, token_ids=torch.tensor(job.token_ids, dtype=torch.long), k=k, v=v,
                options=job.options,
            )  # fmt: skip
            _put(self.setup.tiers, chunk)
        self._saves = []

    def take_failed_blocks(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def _fetch(self, namespace: Namespace, cache_id: str) -> ChunkKV | None:
        """The chunk of ``namespace`` from the first tier that has it, copied into the tiers above that one (a CPU
        tier keeps it in this process for the next link; a disk tier keeps what Redis gave), as
        ``TieredStore.load`` does. The store checks that it is the namespace's (its salt reproduces the id):
        another's is a miss."""
        for level, tier in enumerate(self.setup.tiers):
            try:
                chunk = tenants.read_chunk(tier, cache_id, namespace)
            except Exception as error:  # an unreachable tier is a miss here; the scheduler saw the chunk
                log.warning("pic: the %s tier failed to give chunk %s: %s", tier.name, cache_id, error)
                continue
            if chunk is not None:
                _put(self.setup.tiers[:level], chunk)
                return chunk
        log.warning("pic: chunk %s is in no tier any more; vLLM recomputes its blocks", cache_id)
        return None


def _put(tiers: list, chunk: ChunkKV) -> None:
    """Store ``chunk`` in each of ``tiers``; a tier that refuses or fails is logged (it loses this copy, not the
    request: the next link reads it from a lower tier, or a compile stores it again)."""
    for tier in tiers:
        try:
            if not tier.put(chunk):
                log.warning("pic: the %s tier has no room for chunk %s", tier.name, chunk.cache_id)
        except Exception as error:
            log.warning("pic: the %s tier failed to store chunk %s: %s", tier.name, chunk.cache_id, error)


def kv_layer_heads(kv_layer: torch.Tensor, layer: object) -> int:
    return getattr(layer, "num_kv_heads", None) or kv_layer.shape[1]
