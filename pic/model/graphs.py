"""CUDA graphs for the forwards of few rows: decode steps and a link's query pass, one graph per bucket.

A forward of few rows is bound by the host: on the H100 runs a naive 16K link's wall time was several times its GPU
work, spent launching over a thousand kernels (docs/gpu.md#the-second-run-the-fixes-and-split-kv-the-same-day). A CUDA
graph replays a forward's launches in one call. As vLLM captures its decode batches, each graph here serves one
*bucket*: a number of rows (decode sequences, or a pass's query tokens) and of slots, each padded up to the next bucket.
Everything a graph reads lives in its static buffers, rewritten before each replay: the token ids, positions and cache
rows of the padded rows; the block tables and slot positions; and the attention plan, which is built eagerly for every
forward (``AttentionBackend.plan``: a few small operations, some on the host) and copied into the plan the graph was
captured with (``copy_into``: same shapes by construction of the bucket; a plan that differs anyway runs eagerly,
counted in ``num_eager``).

Padding: a padded decode row is a sequence of its own with no slot written (it attends nothing, writes nothing);
a padded pass row belongs to the pass at position 0 and writes nothing (cache row ``-1``: the Triton store kernel
skips it), so real rows never see a padded one. Only the Triton backend takes part (the torch backend's plan is
not of fixed shape), and only forwards without layer hooks, attention observers, APE's context scaling or a dynamic
rope type (whose tables change with the length).

With ``capture=False`` (the CPU, where there are no graphs) the same buckets, buffers, padding and plan copies run,
and the body runs eagerly on them: what a graph would replay, checked against the runner's own forward
(``tests/test_graphs.py``, under Triton's interpreter).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pic.attention import AttentionBatch, make_batch
from pic.attention.backend import SCRATCH

# Rows per bucket (decode sequences, or a pass's query tokens): vLLM's capture sizes' start.
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# Slots per sequence are padded to a power of two of at least this many: a decode growing from 4K to 32K slots
# captures 4 graphs per row bucket, not one per step. Padded slots cost the plan only: they are never written, so
# no work list visits them.
MIN_SLOTS = 256


class PlanMismatch(Exception):
    """A plan whose shape differs from the captured one's (it runs eagerly)."""


def copy_into(dst, src) -> None:
    """Copy the plan ``src`` into ``dst`` (dataclasses, dicts, tuples, lists of tensors and scalars): every tensor
    ``copy_``-ed in place (but a dataclass field marked ``SCRATCH`` in its metadata: scratch the kernels write before
    they read, which the captured plan's own serve), every other value equal. Raises ``PlanMismatch`` on a shape,
    dtype or value that differs."""
    if isinstance(dst, torch.Tensor):
        if not isinstance(src, torch.Tensor) or src.shape != dst.shape or src.dtype != dst.dtype:
            raise PlanMismatch(f"{getattr(src, 'shape', src)} into {tuple(dst.shape)}")
        if src.data_ptr() != dst.data_ptr():
            dst.copy_(src, non_blocking=True)
    elif dataclasses.is_dataclass(dst):
        for f in dataclasses.fields(dst):
            if not f.metadata.get(SCRATCH):
                copy_into(getattr(dst, f.name), getattr(src, f.name))
    elif isinstance(dst, dict):
        if dst.keys() != src.keys():
            raise PlanMismatch(f"keys {list(src)} into {list(dst)}")
        for key in dst:
            copy_into(dst[key], src[key])
    elif isinstance(dst, (tuple, list)):
        if len(dst) != len(src):
            raise PlanMismatch(f"{len(src)} items into {len(dst)}")
        for a, b in zip(dst, src, strict=True):
            copy_into(a, b)
    elif dst != src:
        raise PlanMismatch(f"{src!r} into {dst!r}")


def bucket_rows(num_rows: int) -> int | None:
    """The bucket of ``num_rows`` rows, ``None`` past the largest."""
    return next((b for b in ROW_BUCKETS if b >= num_rows), None)


@dataclass
class _Graph:
    """One bucket's static buffers (``[R]`` rows, ``[B]`` sequences, ``[B, S]`` slots) and its graph."""

    decode: bool
    token_ids: torch.Tensor  # [R] int64
    positions: torch.Tensor  # [R] int64
    rows: torch.Tensor  # [R] int64 cache rows written; -1: none (a padded row)
    tables: torch.Tensor  # [B, S // block_size] int64
    kv_positions: torch.Tensor  # [B, S] int64
    cache: object  # the engine's KVCache
    plan: object = None  # the attention plan the graph reads (rewritten by copy_into before each replay)
    graph: object = None  # torch.cuda.CUDAGraph once captured
    out: torch.Tensor | None = None  # [R, hidden_size] the captured output (the graph rewrites it at each replay)


# A bucket: (every sequence decodes, rows, slots per sequence).
Bucket = tuple[bool, int, int]


class GraphedForwards:
    """The runner's forwards of few rows through per-bucket graphs (``capture``) or their eager body on the same
    buffers (``capture=False``).

    Args:
        runner: the ``ModelRunner`` whose forward this serves (its ``forward_rows`` is what a graph replays).
        capture: capture CUDA graphs (a CUDA runner only).
    """

    def __init__(self, runner, *, capture: bool) -> None:
        self.runner, self.capture = runner, capture
        self._graphs: dict[Bucket, _Graph] = {}
        self._pool = None
        self.num_replays = 0  # forwards served by a bucket
        self.num_eager = 0  # forwards it accepted whose plan differed from the bucket's (run eagerly instead)

    def bucket(self, seqs: Sequence) -> Bucket | None:
        """The bucket serving ``seqs``, or ``None``: a bucket serves every sequence decoding, or one pass, of
        ``ROW_BUCKETS`` rows at most, without hooks, APE's context or a dynamic rope type (the runner attends with
        the Triton backend: ``ModelRunner.use_graphs`` refuses any other)."""
        if self.runner.rope.is_dynamic:
            return None
        if any(s.after_layer is not None or s.kv.context is not None for s in seqs):
            return None
        decode = all(s.decode for s in seqs)
        num_rows = bucket_rows(sum(s.token_ids.shape[0] for s in seqs))
        if num_rows is None or not (decode or len(seqs) == 1):
            return None
        block_size = seqs[0].kv.cache.block_size
        slots = max(s.kv.kv_positions.shape[0] for s in seqs)
        num_slots = max(MIN_SLOTS, 1 << (slots - 1).bit_length())
        return decode, num_rows, -(-num_slots // block_size) * block_size

    def forward(self, seqs: Sequence, bucket: Bucket) -> list[torch.Tensor]:
        """``ModelRunner.forward`` of ``seqs`` (their slot positions already written) through ``bucket``
        (``self.bucket(seqs)``)."""
        graph = self._graphs.get(bucket)
        if graph is None:
            graph = self._graphs[bucket] = self._new(seqs, bucket)
        self._fill(graph, seqs)
        batch, plan = self._plan(graph)
        try:
            copy_into(graph.plan, plan)
        except PlanMismatch:
            self.num_eager += 1
            return self._outputs(self._body(graph, batch, plan), seqs)
        self.num_replays += 1
        if graph.graph is None:
            return self._outputs(self._body(graph, batch, graph.plan), seqs)
        graph.graph.replay()
        return self._outputs(graph.out, seqs)

    def _new(self, seqs: Sequence, bucket: Bucket) -> _Graph:
        """A bucket's buffers, filled from ``seqs``, its plan, and (``capture``) its graph."""
        decode, num_rows, num_slots = bucket
        num_seqs = num_rows if decode else 1
        cache = seqs[0].kv.cache
        device = seqs[0].token_ids.device
        graph = _Graph(
            decode=decode,
            token_ids=torch.zeros(num_rows, dtype=torch.long, device=device),
            positions=torch.zeros(num_rows, dtype=torch.long, device=device),
            rows=torch.full((num_rows,), -1, dtype=torch.long, device=device),
            tables=torch.zeros(num_seqs, num_slots // cache.block_size, dtype=torch.long, device=device),
            kv_positions=torch.full((num_seqs, num_slots), -1, dtype=torch.long, device=device),
            cache=cache,
        )
        self._fill(graph, seqs)
        batch, graph.plan = self._plan(graph)
        if self.capture:
            self._body(graph, batch, graph.plan)  # warm: every kernel compiled before the capture
            torch.cuda.synchronize(device)
            graph.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph.graph, pool=self._pool):
                graph.out = self._body(graph, batch, graph.plan)  # in the graph's memory, rewritten by each replay
            self._pool = graph.graph.pool()
        return graph

    def _fill(self, graph: _Graph, seqs: Sequence) -> None:
        """Write ``seqs``' rows and KV into the bucket's buffers; padded rows and sequences as the module says."""
        # Device copies and fills only (``fill_`` takes the number as a scalar: no host tensor copied, no sync).
        ids = torch.cat([s.token_ids for s in seqs])
        n = ids.shape[0]
        graph.token_ids[:n].copy_(ids)
        graph.token_ids[n:].fill_(0)
        graph.positions[:n].copy_(torch.cat([s.positions for s in seqs]))
        graph.positions[n:].fill_(0)
        graph.rows[:n].copy_(torch.cat([s.kv.physical(s.slots) for s in seqs]))
        graph.rows[n:].fill_(-1)
        graph.kv_positions.fill_(-1)
        graph.tables.zero_()
        for b, seq in enumerate(seqs):
            graph.kv_positions[b, : seq.kv.kv_positions.shape[0]].copy_(seq.kv.kv_positions)
            graph.tables[b, : seq.kv.block_table.shape[0]].copy_(seq.kv.block_table)

    def _plan(self, graph: _Graph) -> tuple[AttentionBatch, object]:
        """The attention batch of the bucket's buffers as they are now, and its plan."""
        num_seqs, num_rows = graph.tables.shape[0], graph.token_ids.shape[0]
        batch = make_batch(
            block_tables=list(graph.tables), kv_positions=list(graph.kv_positions), q_positions=graph.positions,
            seq_lens=[1] * num_seqs if graph.decode else [num_rows], rope=self.runner.rope,
            decoding=[graph.decode] * num_seqs,
        )  # fmt: skip
        return batch, self.runner.attention_backend.plan(batch)

    def _body(self, graph: _Graph, batch: AttentionBatch, plan: object) -> torch.Tensor:
        """What a graph replays: ``ModelRunner.forward_rows`` over the bucket's buffers."""
        return self.runner.forward_rows(graph.token_ids, graph.rows, graph.cache, batch, plan, decode=graph.decode)

    @staticmethod
    def _outputs(out: torch.Tensor, seqs: Sequence) -> list[torch.Tensor]:
        """Each sequence's ``output_rows`` of ``out`` ``[R, hidden_size]`` (copies: a replay rewrites ``out``)."""
        outputs, start = [], 0
        for seq in seqs:
            rows = seq.output_rows
            outputs.append(out[:0] if rows is None or not rows.numel() else out[start + rows].clone())
            start += seq.token_ids.shape[0]
        return outputs
