"""The torch backend: fused-RoPE paged attention in torch ops, pic's production path on the CPU (kept K and V between
decode steps, bfloat16 tiles, thresholds tuned by A/B runs) and the fallback where Triton cannot run. It is not the
oracle: transformers is (the tests hold this backend, and every optimisation in it, to transformers' logits).

Decoding sequences (one query token each) are attended as one group: over K and V each keeps between steps
(``KeptKV``: one SDPA call per sequence), or, for a batch of short sequences, gathered and padded to the
longest; each recompute pass on its own (a loop over sequences, never a mask over the whole batch). What every
layer shares (the groups' cos/sin at their query and slot positions, cast to the model dtype as transformers
casts, their gathered block tables and their masks for every window of the model) is built in ``plan``, once per
forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from pic.attention.ape import ContextScaling, ape_attention
from pic.attention.backend import AttentionBackend, AttentionShape
from pic.attention.batch import AttentionBatch
from pic.attention.gemm import GemmTile, gemm_attention, gemm_tiles, prefers_gemm
from pic.attention.kept_kv import KeptKV, attend_kept
from pic.attention.rope import rotary_pair, rotate
from pic.attention.tiles import causal_masks, is_causal_run, query_tiles, written_slots
from pic.config import AttentionBackendName

# The key of a sequence's KeptKV in its scratch (AttentionBatch.scratch).
_KEPT_KV = "torch.kept_kv"
# Several decoding sequences read their kept K and V when the longest has this many slots: below it, a few small
# operations per sequence and layer cost more than gathering every slot (an A/B on a 2-core CPU when only K was
# kept: docs/cpu.md#what-made-it-faster).
_KEEP_MIN_SLOTS = 512


@dataclass(frozen=True)
class TorchGroup:
    """Sequences attended together: every decoding sequence (``b`` of them, ``n = 1`` query token each),
    or one recompute pass (``b = 1``, its ``n`` query tokens).

    Only the slots that hold KV are read, gathered in slot order: ``S`` is the most any of the group's
    sequences has written. A sequence with fewer reads its first written slot again in the rest, masked:
    never an unwritten slot, whose stale KV may be NaN (a masked score still multiplies its V row, and
    0 * NaN = NaN), so nothing needs zeroing.

    Attributes:
        rows: the group's query rows in the batch: ``[b]`` int64 (decode; ``None``: every row of the batch, each
            sequence decoding) or a slice (a recompute pass).
        slots: ``[b, S]`` int64, the rows of ``k_cache.flatten(0, 1)`` (and of V) that the group reads.
        table_slots: ``[b, S]`` int64, those slots' indices in their sequence's table (``batch.kv_positions``).
        q_rot: ``[b, n, 2 * head_dim]`` in the model dtype, the rotary (``rotary_pair``) at the query positions.
        k_rot: ``[b, S, 2 * head_dim]`` in the model dtype, at the slot positions.
        masks: per window of the model (``None``: none), ``[b, n, S]`` bool, True where a query may attend:
            a written slot at a position not after the query's (exact causality by position), within the window;
            ``None`` where the query attends every slot read (a lone decoding sequence without a window).
        sdpa_masks: ``masks`` as SDPA adds them (``[b, n, S]``, 0 or -inf in the model dtype), made here once
            rather than by SDPA in every layer (a bool mask costs it two operations a call); ``{}`` for groups that
            attend otherwise (APE, bfloat16 products, kept KV) or whose masks are too large to copy
            (``_ADDITIVE_MAX_ENTRIES``).
        tiles: ``(rows, num_slots)`` pairs covering the group's ``n`` query rows in order: a slice of them, and
            the slots they attend, ``[0, num_slots)``: every slot their masks allow lies before it (so the
            slots after it are skipped, exactly). The decode group has one tile of every slot.
        causal: a recompute pass whose query positions are its slots' positions, in slot order (a prompt run
            whole, as Full Recompute runs it): without a window, row ``i`` attends slots ``0..i``, which is
            SDPA's ``is_causal`` (its fused kernel, the call transformers makes), so no mask is built for it.
        kept: per decoding sequence, its rotated K and its V kept from step to step (``KeptKV``), when the batch
            carries the sequences' scratch; each sequence then attends over its own kept K and V (one SDPA call
            each, no padding, so in a batch as alone), nothing gathered or rotated but the new slots.
        context: APE's groups (``pic.attention.ape``): ``[b, S]`` bool, the chunk slots among those read, and
            each sequence's ``ContextScaling``; ``None`` for plain attention.
        gemm: a recompute pass of ``MIN_ROWS`` rows or more in bfloat16 on the CPU: per window, its tiles
            (``pic.attention.gemm``, attended through bfloat16 products); ``None``: SDPA.
    """

    rows: torch.Tensor | slice | None
    slots: torch.Tensor
    table_slots: torch.Tensor
    q_rot: torch.Tensor
    k_rot: torch.Tensor
    masks: dict[int | None, torch.Tensor | None]
    tiles: tuple[tuple[slice, int], ...]
    causal: bool = False
    kept: tuple[KeptKV, ...] = ()
    context: tuple[torch.Tensor, list[ContextScaling | None]] | None = None
    gemm: dict[int | None, tuple[GemmTile, ...]] | None = None
    sdpa_masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """The group's rows of a batch tensor ``[N, ...]`` as ``[b, n, ...]``."""
        return _take(x, self.rows)

    def put(self, out: torch.Tensor, value: torch.Tensor) -> None:
        """Write ``value`` ``[b, n, ...]`` into the group's rows of ``out`` ``[N, ...]``."""
        assert self.rows is not None, "a plan's whole group is returned by attend, not put"
        out[self.rows] = value[:, 0] if isinstance(self.rows, torch.Tensor) else value[0]

    def output(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` ``[b, n, ...]`` as the batch's ``[N, ...]``, for a group whose rows are the whole batch."""
        return value[0] if isinstance(self.rows, slice) else value[:, 0]


@dataclass(frozen=True)
class TorchPlan:
    """The torch backend's plan of one forward.

    Attributes:
        decode: the decoding sequences' group, ``None`` when no sequence decodes.
        prefill: per recompute-pass sequence (``batch.prefill_seqs``), its group.
        decode_context: the decoding sequences with APE's context scaling, ``None`` when none has it.
        whole: the group whose rows are every row of the batch, in order (``decode`` when every sequence decodes,
            or a lone recompute pass), whose output ``attend`` returns as it is; ``None`` when the batch has several.
    """

    decode: TorchGroup | None
    prefill: dict[int, TorchGroup]
    decode_context: TorchGroup | None = None
    whole: TorchGroup | None = None

    @property
    def groups(self) -> list[TorchGroup]:
        decodes = [g for g in (self.decode, self.decode_context) if g is not None]
        return decodes + list(self.prefill.values())


def _rotary(batch: AttentionBatch, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``rotary_pair`` ``[*rows.shape, 2 * D]`` in ``dtype`` at ``rows`` of the batch's rotary tables."""
    cos, sin = (
        t.index_select(0, rows.flatten()).view(*rows.shape, -1).to(dtype) for t in (batch.rope_cos, batch.rope_sin)
    )
    return rotary_pair(cos, sin)


# A group's masks are made additive once per forward when they hold at most this many entries (b * n * S: a decode
# step, a link's few query rows), where SDPA would otherwise turn a bool mask additive again in every layer's call.
# Larger groups (a long pass's rows over its slots) keep the bool mask, which SDPA converts a tile at a time: an
# additive copy of the whole would be held for the forward at 2-4 bytes an entry (512 MiB for 8K rows over 16K
# slots in float32, per window).
_ADDITIVE_MAX_ENTRIES = 1 << 20


def _additive(
    masks: dict[int | None, torch.Tensor | None], dtype: torch.dtype
) -> dict[int | None, torch.Tensor | None]:
    """Bool masks (True: attend) as SDPA adds them: 0 where True, -inf where False, in ``dtype``."""
    return {
        window: None if mask is None else mask.new_zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))
        for window, mask in masks.items()
    }


def _split_context(batch: AttentionBatch, seqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``seqs`` ``[b]`` int64 split into those with plain attention and those with APE's context scaling."""
    if not batch.context_scaling or not seqs.numel():
        return seqs, seqs[:0]
    scaled = torch.tensor([batch.context_scaling[b] is not None for b in seqs.tolist()], device=seqs.device)
    return seqs[~scaled], seqs[scaled]


def _kept_kvs(
    batch: AttentionBatch, group: TorchGroup, seqs: torch.Tensor, dtype: torch.dtype | None
) -> tuple[KeptKV, ...]:
    """The decoding sequences' (``seqs`` ``[b]``, the group's) ``KeptKV`` (in ``dtype``), each advanced to this step's
    written slots."""
    counts = (batch.kv_positions[seqs] >= 0).sum(1).tolist()  # [b] written slots (a host sync)
    states = []
    for i, (seq, count) in enumerate(zip(seqs.tolist(), counts, strict=True)):
        state = batch.scratch[seq].get(_KEPT_KV)
        if state is None or state.dtype != dtype:
            state = batch.scratch[seq][_KEPT_KV] = KeptKV(dtype)
        state.advance(group.slots[i, :count], group.k_rot[i, :count])
        states.append(state)
    return tuple(states)


def _take(x: torch.Tensor, rows: torch.Tensor | slice | None) -> torch.Tensor:
    """Rows of ``x`` ``[N, ...]`` as ``[b, n, ...]``: ``b`` decode rows of one token (``None``: every row, a view),
    or one pass of ``n``."""
    if rows is None:
        return x[:, None]
    return x[rows][:, None] if isinstance(rows, torch.Tensor) else x[rows][None]


class TorchBackend(AttentionBackend[TorchPlan]):
    """The reference: gathers each group's paged K and V, rotates them, and runs SDPA with an explicit mask.

    Args:
        shape: the model's attention shape.
        decode_kv_dtype: the dtype of decoding sequences' kept K and V (``KeptKV``), and of their attention;
            ``None``: the model's (exact). int8 decode weights use float16 (``pic.model.products``).
    """

    name = AttentionBackendName.TORCH

    def __init__(self, shape: AttentionShape, *, decode_kv_dtype: torch.dtype | None = None) -> None:
        super().__init__(shape)
        self.decode_kv_dtype = decode_kv_dtype

    def plan(self, batch: AttentionBatch) -> TorchPlan:
        device, dtype = batch.q_positions.device, self.shape.dtype
        seq_of_row = torch.repeat_interleave(torch.diff(batch.cu_seqlens_q)).to(device)
        q_rows = batch.rope_offsets[seq_of_row] + batch.q_positions  # [N] rows of the rotary tables
        q_rot = _rotary(batch, q_rows, dtype)  # [N, 2D]
        for b in batch.prefill_seqs if batch.scratch else ():
            batch.scratch[b].pop(_KEPT_KV, None)  # a recompute pass may rewrite the sequence's KV in place
        decode = decode_context = None
        plain, scaled = _split_context(batch, batch.decode_seqs)
        if plain.numel():
            rows = batch.cu_seqlens_q[:-1].to(device)[plain]  # [b] the decode tokens' rows
            decode = self._group(batch, rows, plain, q_rot)
            if batch.scratch and (len(rows) == 1 or decode.slots.shape[1] >= _KEEP_MIN_SLOTS):
                # kept K may be in another dtype than the model's: the group attends with its bool masks
                kept = _kept_kvs(batch, decode, plain, self.decode_kv_dtype)
                decode = replace(decode, kept=kept, sdpa_masks={})
        if scaled.numel():
            rows = batch.cu_seqlens_q[:-1].to(device)[scaled]
            decode_context = self._group(batch, rows, scaled, q_rot)
        prefill = {
            b: self._group(batch, batch.query_rows(b), torch.tensor([b], device=device), q_rot)
            for b in batch.prefill_seqs
        }
        whole = None  # the one group whose rows are the batch's, in order: its output is the layer's, no copy
        if decode is not None and not prefill and decode_context is None:
            decode = whole = replace(decode, rows=None)
        elif len(prefill) == 1 and decode is None and decode_context is None:
            (only,) = prefill.values()
            if only.rows.start == 0 and only.rows.stop == batch.q_positions.shape[0]:
                whole = only
        return TorchPlan(decode=decode, prefill=prefill, decode_context=decode_context, whole=whole)

    def _group(
        self, batch: AttentionBatch, rows: torch.Tensor | slice, seqs: torch.Tensor, q_rot: torch.Tensor
    ) -> TorchGroup:
        """A group's share of the batch; ``q_rot`` ``[N, 2D]``: the batch's query rotary (``_rotary``)."""
        table_slots, kv = written_slots(batch.kv_positions[seqs])  # [b, S] each; kv: -1 past a sequence's own
        tables = batch.block_tables[seqs]  # [b, max_blocks]
        block_size = batch.kv_positions.shape[1] // batch.block_tables.shape[1]
        slots = tables.gather(1, table_slots // block_size) * block_size + table_slots % block_size
        q = _take(batch.q_positions, rows)  # [b, n]
        run = isinstance(rows, slice) and is_causal_run(kv[0], q[0])
        masks = causal_masks(kv, q, set(self.shape.sliding_windows), causal=run)
        if len(seqs) == 1 and not isinstance(rows, slice) and None in masks:
            masks[None] = None  # one decoding sequence: every slot it wrote is at or before its query
        if isinstance(rows, slice) and any(mask is not None for mask in masks.values()):
            tiles = query_tiles(kv[0], q[0], self.shape.num_q_heads)
        else:  # decode, or a causal run without windows: one call over every slot read
            tiles = ((slice(0, q.shape[1]), kv.shape[1]),)
        k_rot = _rotary(batch, batch.rope_offsets[seqs, None] + kv.clamp(min=0), self.shape.dtype)
        context = None
        scalings = [batch.context_scaling[b] for b in seqs.tolist()] if batch.context_scaling else []
        if any(scaling is not None for scaling in scalings):  # APE: the chunk slots among those read
            context = (batch.kv_context[seqs].gather(1, table_slots) & (kv >= 0), scalings)
            masks = causal_masks(kv, q, set(self.shape.sliding_windows), causal=False)  # explicit, every window
        gemm = None
        if isinstance(rows, slice) and context is None and prefers_gemm(self.shape.dtype, q.device, q.shape[1]):
            heads = self.shape.num_q_heads
            gemm = {w: gemm_tiles(tiles, None if m is None else m[0], num_heads=heads) for w, m in masks.items()}
        additive = gemm is None and context is None and q.numel() * kv.shape[1] <= _ADDITIVE_MAX_ENTRIES
        return TorchGroup(
            rows=rows,
            slots=slots,
            table_slots=table_slots,
            q_rot=_take(q_rot, rows),
            k_rot=k_rot,
            masks=masks,
            sdpa_masks=_additive(masks, self.shape.dtype) if additive else {},
            tiles=tiles,
            causal=run and context is None,
            context=context,
            gemm=gemm,
        )

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: TorchPlan,
        *,
        scaling: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        if plan.whole is not None:  # one group: its output is the layer's
            group = plan.whole
            value = _attend(group, group.queries(q), k_cache, v_cache, scaling=scaling, window=sliding_window)
            return group.output(value)
        out = torch.empty_like(q)
        for group in plan.groups:
            group.put(out, _attend(group, group.queries(q), k_cache, v_cache, scaling=scaling, window=sliding_window))
        return out

    def store(self, k_rows: torch.Tensor, v_rows: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        k_rows[rows] = k
        v_rows[rows] = v


def attention_weights(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    batch: AttentionBatch,
    seq: int,
    *,
    scaling: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """The softmax weights with which prefill sequence ``seq``'s query tokens attend over its slots, as
    ``TorchBackend.attend`` computes them: for analysis (``pic.evaluation.sinks``), not for serving
    (it plans the whole batch on every call).

    Args:
        q: ``[N, num_q_heads, head_dim]``, the batch's NoPE queries (``attend``'s ``q``).
        k_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, NoPE K of one layer.
        seq: a sequence of ``batch.prefill_seqs``.

    Returns:
        ``[num_q_heads, n, S]`` float32: row ``i`` of head ``h`` is the attention of the sequence's ``i``-th
        query token over the ``S`` slots of its table (``batch.kv_positions[seq]`` gives their positions;
        unwritten and masked slots get 0).
    """
    shape = AttentionShape(q.shape[1], k_cache.shape[2], q.shape[2], q.dtype, (sliding_window,))
    group = TorchBackend(shape).plan(batch).prefill[seq]
    q, k, _ = _operands(group, group.queries(q), k_cache, None)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # [1, Hq, S, D]: query head h reads KV head h // group
    scores = (q.float() @ k.float().transpose(-1, -2)) * scaling  # [1, Hq, n, S] over the slots read
    mask = group.masks[sliding_window]
    if mask is None:  # a causal run attends without a mask: build it here
        kv = batch.kv_positions[seq][group.table_slots[0]]  # [S]
        mask = causal_masks(kv[None], group.queries(batch.q_positions), {sliding_window}, causal=False)[sliding_window]
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    weights = scores.new_zeros(*scores.shape[1:-1], batch.kv_positions.shape[1])  # [Hq, n, S_table]
    return weights.index_copy_(-1, group.table_slots[0], scores.softmax(-1)[0])


def _operands(
    group: TorchGroup, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Rotated ``q`` ``[b, Hq, n, D]`` (from the group's queries ``[b, n, Hq, D]``), the group's gathered and
    rotated K ``[b, Hkv, S, D]`` and V ``[b, Hkv, S, D]`` (``None`` without ``v_cache``)."""
    q = rotate(q, group.q_rot).transpose(1, 2)  # [b, Hq, n, D]
    k = _gather(k_cache, group.slots)  # [b, S, Hkv, D]: written slots only (see TorchGroup)
    k = rotate(k, group.k_rot).transpose(1, 2)  # [b, Hkv, S, D]
    if v_cache is None:
        return q, k, None
    return q, k, _gather(v_cache, group.slots).transpose(1, 2)


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows ``slots`` ``[b, S]`` of ``cache`` ``[num_blocks, block_size, Hkv, D]`` as ``[b, S, Hkv, D]``
    (``index_select``: several times faster on the CPU than advanced indexing, which builds index tensors)."""
    return cache.flatten(0, 1).index_select(0, slots.flatten()).view(*slots.shape, *cache.shape[2:])


def _attend(
    group: TorchGroup,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    scaling: float,
    window: int | None,
) -> torch.Tensor:
    """The group's queries ``q`` ``[b, n, Hq, D]`` over its KV; returns ``[b, n, Hq, D]``."""
    assert window in group.masks, f"sliding_window={window} was not planned for (the model's: {list(group.masks)})"
    if group.kept:  # without a window, every slot a sequence kept is at or before its query
        mask = None if window is None else group.masks[window]
        return attend_kept(group.kept, rotate(q, group.q_rot), k_cache, v_cache, mask, scaling=scaling)
    q, k, v = _operands(group, q, k_cache, v_cache)
    mask = group.masks[window]  # [b, n, S]
    if group.context is not None:  # APE's context scaling: scores computed in full (a few query rows)
        context, scalings = group.context
        return ape_attention(q, k, v, mask, context, scalings, scaling=scaling).transpose(1, 2)
    if group.gemm is not None:  # a pass in bfloat16 on the CPU: through its products (``pic.attention.gemm``)
        return gemm_attention(q, k, v, group.gemm[window], scaling=scaling).transpose(1, 2)
    if mask is None and group.causal:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2)
    if group.sdpa_masks:  # [b, n, S], added to the scores (else the bool mask: see _ADDITIVE_MAX_ENTRIES)
        mask = group.sdpa_masks[window]
    if q.shape[2] == 1:  # decode: each KV head's query heads as rows, one fused call without the GQA path
        b, num_q_heads, _, dim = q.shape
        grouped = q.reshape(b, k.shape[1], num_q_heads // k.shape[1], dim)  # [b, Hkv, Hq / Hkv, D]
        mask = None if mask is None else mask[:, None]  # [b, 1, 1, S]
        out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask, scale=scaling)
        return out.reshape(b, num_q_heads, 1, dim).transpose(1, 2)  # CUDA's SDPA lays out [b, G, Hkv, D]: no view
    if len(group.tiles) == 1 and group.tiles[0][1] == k.shape[2]:  # one call over every slot: its output as it is
        tile_mask = None if mask is None else mask[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=tile_mask, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2)
    out = torch.empty_like(q)
    for rows, end in group.tiles:
        tile_mask = None if mask is None else mask[:, None, rows, :end]
        out[:, :, rows] = F.scaled_dot_product_attention(
            q[:, :, rows], k[:, :, :end], v[:, :, :end], attn_mask=tile_mask, scale=scaling, enable_gqa=True
        )
    return out.transpose(1, 2)
