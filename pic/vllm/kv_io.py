"""Moving one layer's KV between pic's chunks (NoPE K, V) and vLLM's paged cache.

Writes go through the attention backend's own ``impl.do_kv_cache_update`` (the call vLLM makes for fresh
tokens), so every backend's block layout, ISA-specific or not, is written as it expects. Reads (compile
through vLLM) gather from the cache by a layout learnt once per process from the backend itself
(``probe_layout``: coded KV written into a scratch block, then checked with random KV): a layout pic cannot
read (a vLLM upgrade, a quantized cache) is a clear error, not silently wrong chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pic.attention.rope import RopeTable
from pic.errors import UnsupportedModelError


def model_rope(hf_config: object, *, max_positions: int, dtype: torch.dtype, device: torch.device) -> RopeTable:
    """The rotary table of the Hugging Face model ``hf_config`` describes (its own rotary module's type and
    scaling: every rope type transformers supports), built without the model's weights."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    rotary = getattr(getattr(skeleton, "model", skeleton), "rotary_emb", None)
    if rotary is None:
        raise UnsupportedModelError(f"{type(skeleton).__name__} has no model.rotary_emb; pic links rotary models only")
    with torch.device(device):
        rotary = type(rotary)(config=hf_config)
    return RopeTable(rotary, max_positions=max_positions, dtype=dtype, device=device)


def write_cache(layer: nn.Module, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor):
    """Write ``k``, ``v`` ``[T, H_local, D]`` (K rotated, cache dtype) into ``kv_cache`` (``layer``'s, or a scratch
    one of its shape) at ``slots`` ``[T]`` int64, through ``layer``'s backend.

    Raises:
        UnsupportedModelError: a backend that writes its cache inside its attention call only (no separate
            ``do_kv_cache_update``: vLLM's CPU and flash-attention backends have one).
    """
    if not hasattr(layer.impl, "do_kv_cache_update"):
        raise UnsupportedModelError(
            f"vLLM's attention backend {type(layer.impl).__name__} has no do_kv_cache_update; pic's connector writes "
            f"KV through it (vLLM's CPU_ATTN and FLASH_ATTN backends have it)"
        )
    layer.impl.do_kv_cache_update(layer, k, v, kv_cache, slots)


@dataclass(frozen=True)
class BlockLayout:
    """Where a backend keeps each token's K and V inside one cache block.

    Attributes:
        k_index, v_index: ``[block_size, H, D]`` int64, the flat offset in a block (``kv_cache[b].flatten()``)
            of element ``d`` of head ``h`` of the block's token ``t``.
    """

    k_index: torch.Tensor
    v_index: torch.Tensor


def probe_layout(layer: nn.Module, *, block_size: int, num_kv_heads: int, head_dim: int) -> BlockLayout:
    """Learn the block layout of ``layer``'s backend by writing coded KV through it into a one-block scratch cache.

    Three writes code each element with its token, head and dim number (+1; each below 257, so exact in
    bfloat16), first in K with V zero, then in V: any in-block layout (vLLM's CPU kernels keep K transposed
    per head, ``[D, block_size]``; flash layouts keep ``[block_size, H, D]``) is read back from what they write.
    The layout is then checked with random KV, bit for bit.

    Raises:
        UnsupportedModelError: the backend does not keep blocks at dim 0, quantizes, or mixes elements
            (naming the backend and the cache's shape).
    """
    cache = layer.kv_cache
    scratch = torch.zeros((1, *cache.shape[1:]), dtype=cache.dtype, device=cache.device)
    slots = torch.arange(block_size, device=cache.device)
    shape = (block_size, num_kv_heads, head_dim)
    grids = torch.meshgrid(*(torch.arange(n) for n in shape), indexing="ij")
    indexes = []
    for which in range(2):  # K, then V
        codes = []
        for grid in grids:
            kv = [torch.zeros(shape), torch.zeros(shape)]
            kv[which] = (grid + 1).float()
            scratch.zero_()
            write_cache(layer, *(t.to(cache.device, cache.dtype) for t in kv), scratch, slots)
            codes.append(scratch.flatten().float().cpu().round().long())
        where = codes[0].nonzero().flatten()
        index = torch.full(shape, -1, dtype=torch.long)
        if where.numel() == index.numel() and all(c.max() <= n for c, n in zip(codes, shape, strict=True)):
            index[codes[0][where] - 1, codes[1][where] - 1, codes[2][where] - 1] = where
        indexes.append(index)
    layout = BlockLayout(*indexes)
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(shape, generator=gen).to(cache.device, cache.dtype) for _ in "kv")
    ok = all((i >= 0).all() for i in indexes)
    if ok:
        scratch.zero_()
        write_cache(layer, k, v, scratch, slots)
        k_back, v_back = read_layer(scratch, slots, layout, block_size=block_size)
        ok = torch.equal(k_back, k) and torch.equal(v_back, v)
    if not ok:
        raise UnsupportedModelError(
            f"vLLM's attention backend {type(layer.impl).__name__} stores KV as {tuple(cache.shape)} {cache.dtype} "
            f"in a layout pic's connector cannot read back (quantized, or blocks not at dim 0): compile through "
            f"vLLM is not supported with it (links still are)"
        )
    return layout


def read_layer(kv_cache: torch.Tensor, slots: torch.Tensor, layout: BlockLayout, *, block_size: int):
    """K (rotated) and V ``[T, H, D]`` at ``slots`` ``[T]`` int64 of one layer's cache."""
    blocks = kv_cache.view(kv_cache.shape[0], -1)
    rows = blocks[slots // block_size]  # [T, block elements]
    offsets = (slots % block_size).cpu()
    flat_k = layout.k_index[offsets].flatten(1).to(rows.device)  # [T, H * D]
    flat_v = layout.v_index[offsets].flatten(1).to(rows.device)
    shape = (len(slots), *layout.k_index.shape[1:])
    return rows.gather(1, flat_k).view(shape), rows.gather(1, flat_v).view(shape)
