"""Random paged-attention cases shared by the backend tests (and runnable on any device)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from pic.attention import AttentionBatch, AttentionShape, RopeTable, make_batch


@dataclass
class Case:
    q: torch.Tensor  # [N, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, page, Hkv, D]
    v_cache: torch.Tensor
    batch: AttentionBatch
    scaling: float

    def cast(self, dtype: torch.dtype) -> Case:
        return Case(self.q.to(dtype), self.k_cache.to(dtype), self.v_cache.to(dtype), self.batch, self.scaling)

    def shape(self, window: int | None = None) -> AttentionShape:
        """The attention shape a backend plans this case for: its heads and dtype, one layer with ``window``."""
        num_q_heads, head_dim = self.q.shape[1:]
        return AttentionShape(num_q_heads, self.k_cache.shape[2], head_dim, self.q.dtype, (window,))


def rope_table(head_dim: int, max_positions: int, rope_type: str, device) -> RopeTable:
    params = {"rope_type": rope_type, "rope_theta": 10000.0}
    if rope_type != "default":
        params |= {"factor": 4.0, "original_max_position_embeddings": 16}
    config = LlamaConfig(
        hidden_size=head_dim * 2, num_attention_heads=2, max_position_embeddings=max_positions, rope_parameters=params
    )
    return RopeTable(
        LlamaRotaryEmbedding(config).to(device), max_positions=max_positions, dtype=torch.float32, device=device
    )


def make_case(
    *,
    seqs: list[tuple[int, str | int]],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page: int,
    rope_type: str = "default",
    shuffled: bool = False,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> Case:
    """``seqs``: per sequence ``(context_len, kind)`` with kind ``"all"`` (every token queries),
    ``"subset"`` (a random few, always the last), ``"decode"`` (the last token) or an int ``n`` (``n`` tokens, the
    last and ``n - 1`` at random earlier positions: a link's recompute pass). Each sequence gets
    random blocks, front padding and a trailing unwritten block; every other block holds NaN (stale KV
    that must never be read). ``shuffled`` permutes the positions over the slots (a linked request's
    slots need not be in position order). Float64 tensors: cast for the dtype under test."""
    gen = torch.Generator().manual_seed(seed)
    max_len = max(n for n, _ in seqs)
    needed = sum(-(-(n + page) // page) + 1 for n, _ in seqs)
    num_blocks = needed + 3
    shape = (num_blocks, page, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=torch.float64)
    v_cache = torch.full(shape, float("nan"), dtype=torch.float64)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables, kv_positions, q_positions, lens = [], [], [], []
    for length, kind in seqs:
        pad = int(torch.randint(0, page, (1,), generator=gen))
        num_table_blocks = -(-(pad + length) // page) + 1  # one more, never written
        table = torch.tensor([free.pop() for _ in range(num_table_blocks)])
        positions = torch.full((num_table_blocks * page,), -1)
        order = torch.randperm(length, generator=gen) if shuffled else torch.arange(length)
        positions[pad : pad + length] = order
        slots = table[torch.arange(pad, pad + length) // page] * page + torch.arange(pad, pad + length) % page
        for cache in (k_cache, v_cache):
            values = torch.randn(length, num_kv_heads, head_dim, generator=gen, dtype=torch.float64)
            cache.view(-1, num_kv_heads, head_dim)[slots] = values
        if kind == "all":
            q_pos = torch.arange(length)
        elif isinstance(kind, int):
            earlier = torch.randperm(length - 1, generator=gen)[: kind - 1].sort().values
            q_pos = torch.cat((earlier, torch.tensor([length - 1])))
        elif kind == "subset":
            q_pos = torch.cat((torch.randperm(length - 1, generator=gen)[: max(1, length // 4)].sort().values,
                               torch.tensor([length - 1])))  # fmt: skip
        else:
            q_pos = torch.tensor([length - 1])
        tables.append(table)
        kv_positions.append(positions)
        q_positions.append(q_pos)
        lens.append(q_pos.shape[0])
    device = torch.device(device)
    rope = rope_table(head_dim, max_len + 1, rope_type, device)
    batch = make_batch(
        block_tables=[t.to(device) for t in tables],
        kv_positions=[p.to(device) for p in kv_positions],
        q_positions=torch.cat(q_positions).to(device),
        seq_lens=lens,
        rope=rope,
    )
    q = torch.randn(sum(lens), num_q_heads, head_dim, generator=gen).double()
    return Case(q.to(device), k_cache.to(device), v_cache.to(device), batch, head_dim**-0.5)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64."""
    diff = (out.double() - ref.double()).norm()
    return float(diff / ref.double().norm())
