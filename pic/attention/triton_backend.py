"""The Triton backend: its plan (``triton_plan.py``), its launches and their precompilation.

Imported only when the Triton backend is chosen (``pic.attention.select``), so ``import pic`` never
imports Triton. On CUDA it compiles the kernels; on the CPU it needs Triton's interpreter
(``TRITON_INTERPRET=1`` set before Triton is first imported), which is how CI tests the same source.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import replace

import torch
import triton
import triton.runtime.interpreter

from pic.attention.backend import AttentionBackend, AttentionShape
from pic.attention.batch import AttentionBatch
from pic.attention.triton_compile import CompiledLaunch, compile_launches, kernel_resources
from pic.attention.triton_config import ROTATE_ONCE_MAX_BYTES, ROTATE_ONCE_MIN_TILES, launch_config, slot_step
from pic.attention.triton_kernels import paged_attention_kernel
from pic.attention.triton_launch import launch_attention, launch_store, pow2
from pic.attention.triton_plan import (
    Launch,
    RotatedK,
    TritonPlan,
    TritonTiles,
    make_tiles,
    padded_slots,
    query_tiles,
)  # fmt: skip
from pic.attention.triton_split import MIN_TILES_PER_SPLIT, split_limit
from pic.config import AttentionBackendName

# A launch of passes of 64 rows or fewer has one query tile per sequence: never rotated once by default, so not
# precompiled that way (``launches``).
assert ROTATE_ONCE_MIN_TILES >= 2, ROTATE_ONCE_MIN_TILES
# Programs an SM holds at once, until ``precompile`` reads it from each compiled kernel: a decode program (4 warps,
# about 140 registers) and a recompute pass's (the 128-row tile: 8 warps, about 250 registers).
ASSUMED_BLOCKS_PER_SM = {True: 2, False: 1}  # by decode


class TritonBackend(AttentionBackend[TritonPlan]):
    """The fused-RoPE paged kernel (``triton_kernels.py``); same contract as the torch backend.

    Tiles: a decode program takes one token's ``GROUP`` query heads (``block_m`` the next power of two, at
    least 16); recompute passes take 128 rows on sm_90 and newer (the configuration of Triton's own flash
    attention there) and 64 rows on older GPUs and for passes of 64 rows or fewer. KV tile, warps and stages
    per head dim come from one table, ``triton_config.LAUNCH_CONFIGS``. Either launch splits its KV work lists
    (``triton_split``) when its programs would leave most of the GPU idle: decodes of a small batch, a link's few
    rows over a long context.

    K rotation: decodes rotate K in the KV loop (each K tile is visited once per KV head). A recompute passes'
    launch whose sequences have ``ROTATE_ONCE_MIN_TILES`` query tiles or more each (on average) rotates its
    sequences' K once per layer instead (``rotate_k_kernel``, into rows shared by every layer of the forward) and
    reads it without rotating and without K's block table: in the loop, each of a sequence's query tiles would
    rotate every KV tile it visits again.

    Args:
        shape: the model's attention shape (``head_dim`` even: the kernel rotates the two halves).
        block_n: slots per KV tile of every launch (a power of two, at least 16); ``None``: the head dim's
            ``LAUNCH_CONFIGS`` (head dim 128: 32 for decodes and 64-row passes, 64 for 128-row passes).
        prefill_block_m: rows per program of the recompute passes (``None``: by GPU and pass length, above).
        num_splits: most KV splits per decode tile (flash-decoding), each of one KV tile or more; ``None``: by
            occupancy, per forward, each split of ``MIN_TILES_PER_SPLIT`` tiles or more.
        prefill_splits: the same for the recompute passes' tiles.
        capability: the CUDA compute capability to launch for (``None``: the device's, read at the first
            plan; ``(0, 0)`` in the interpreter).
        num_sms: the SMs the occupancy rule fills (``None``: the CUDA device's; none in the interpreter, so no
            split there unless asked for or given an SM count).
        k_is_rotated: the cache holds K already rotated at its slots' positions, so the kernel only pages it
            (``benchmarks/attention.py`` separates the cost of rotation from that of paging; pic's caches hold
            NoPE K, so the engine never sets it).
        rotate_once: recompute passes read K rotated once per layer (``True``), rotate it in the KV loop
            (``False``), or (``None``) rotate it once when the launch's sequences average ``ROTATE_ONCE_MIN_TILES``
            query tiles or more and the rotated rows fit ``ROTATE_ONCE_MAX_BYTES``. Decodes always rotate in the loop.
    """

    name = AttentionBackendName.TRITON

    def __init__(
        self,
        shape: AttentionShape,
        *,
        block_n: int | None = None,
        prefill_block_m: int | None = None,
        num_splits: int | None = None,
        prefill_splits: int | None = None,
        capability: tuple[int, int] | None = None,
        num_sms: int | None = None,
        k_is_rotated: bool = False,
        rotate_once: bool | None = None,
    ) -> None:
        super().__init__(shape)
        assert shape.head_dim % 2 == 0, shape
        self.block_n, self.prefill_block_m = block_n, prefill_block_m
        self.splits = {True: num_splits, False: prefill_splits}  # asked for, by decode
        self.group = shape.num_q_heads // shape.num_kv_heads
        self.decode_block_m = pow2(self.group)
        self.blocks_per_sm: dict[Launch, int] = {}  # read by ``precompile`` from each compiled (unsplit) launch
        self.capability, self.num_sms = capability, num_sms
        self.rotate_k = not k_is_rotated
        self.rotate_once = rotate_once
        self._halves: tuple[torch.Tensor, ...] = ()  # the last rotary table, its halves in the model dtype and float32

    def launches(self, device: torch.device) -> dict[str, Launch]:
        """Every launch configuration this backend may use on ``device``, by name (each compiles once per
        window kind): ``"decode"``, ``"prefill 64"`` and, on sm_90 and newer, ``"prefill 128"``; the long passes'
        one (``"prefill 128"`` on sm_90, else ``"prefill 64"``) also reading K rotated once (``"prefill 128 once"``;
        every prefill launch with ``rotate_once=True``, none with ``False`` or ``k_is_rotated``: the shorter passes'
        launch has one query tile per sequence, never ``ROTATE_ONCE_MIN_TILES``), and each launch also split
        (``"decode split"``, ...)."""
        launches = {"decode": self._decode_launch(False)}
        for rows in (1, 1 << 30):
            launch = self._prefill_launch(device, rows=rows)
            launches[f"prefill {launch.block_m}"] = launch
        if self.rotate_k and self.rotate_once is not False:  # by default only the long passes' launch rotates once
            long = self._prefill_launch(device, rows=1 << 30)
            prefills = [
                (n, launch) for n, launch in launches.items() if n != "decode" and (self.rotate_once or launch == long)
            ]
            launches |= {f"{name} once": self._once(launch) for name, launch in prefills}
        return launches | {f"{name} split": replace(launch, split=True) for name, launch in launches.items()}

    def _once(self, launch: Launch) -> Launch:
        """``launch`` (a recompute passes' one) reading K rotated once (``rotate_k_kernel``'s rows) instead of rotating
        it in the loop, configured by its ``"prefill N once"`` row of ``LAUNCH_CONFIGS``."""
        config = launch_config(self.shape.head_dim, f"{self._prefill_kind(launch.block_m)} once")
        return replace(
            launch, rotate_k=False, rotated_once=True, block_n=self.block_n or config.block_n,
            num_warps=config.num_warps, num_stages=config.num_stages, max_registers=config.max_registers,
        )  # fmt: skip

    def _capability(self, device: torch.device) -> tuple[int, int]:
        if self.capability is None:
            self.capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)
        return self.capability

    def _decode_launch(self, split: bool) -> Launch:
        config = launch_config(self.shape.head_dim, "decode")
        return Launch(
            block_m=self.decode_block_m, block_n=self.block_n or config.block_n, num_warps=config.num_warps,
            split=split, num_stages=config.num_stages, max_registers=config.max_registers, rotate_k=self.rotate_k,
        )  # fmt: skip

    def _prefill_launch(self, device: torch.device, *, rows: int) -> Launch:
        block_m = self.prefill_block_m
        has_big = launch_config(self.shape.head_dim, "prefill 128") is not None
        if block_m is None:
            big = self._capability(device)[0] >= 9 and rows > 64 and has_big
            block_m = 128 if big else 64
        block_m = max(block_m, self.decode_block_m)
        config = launch_config(self.shape.head_dim, self._prefill_kind(block_m))
        # The unmasked loop of whole tiles costs the 64-row tile 168 -> 236 registers on sm_90 (3 -> 2 programs per
        # SM): not there. The 128-row tile it costs none (253 -> 245): tests/compile_kernels.py, docs/gpu.md.
        return Launch(
            block_m=block_m, block_n=self.block_n or config.block_n, num_warps=config.num_warps, split=False,
            num_stages=config.num_stages, max_registers=config.max_registers, whole_tiles=block_m != 64,
            rotate_k=self.rotate_k,
        )  # fmt: skip

    def _prefill_kind(self, block_m: int) -> str:
        """The ``LAUNCH_CONFIGS`` row of a recompute passes' launch of ``block_m`` rows."""
        big = block_m >= 128 and launch_config(self.shape.head_dim, "prefill 128") is not None
        return "prefill 128" if big else "prefill 64"

    def plan(self, batch: AttentionBatch) -> TritonPlan:
        device = batch.q_positions.device
        page = batch.kv_positions.shape[1] // max(1, batch.block_tables.shape[1])
        step = self.block_n or slot_step(self.shape.head_dim)  # a multiple of every block_n (and rotate block)
        kv_pos, tables = padded_slots(batch, block_n=step, page=page)
        cu_q = batch.cu_seqlens_q.to(device=device, dtype=torch.int32, non_blocking=True)
        q_pos = batch.q_positions.to(torch.int32)
        longest = int((batch.cu_seqlens_q[1:] - batch.cu_seqlens_q[:-1]).max()) * self.group
        common = dict(cu_q=cu_q, q_pos=q_pos, kv_pos=kv_pos, windows=set(self.shape.sliding_windows), group=self.group)
        cos, sin, cos32, sin32 = self._rope_halves(batch)
        decode = self._tiles(batch, self._decode_launch(False), decode=True, **common)
        prefill = self._tiles(
            batch, self._prefill_launch(device, rows=longest), decode=False, rope32=(cos32, sin32), **common
        )
        rope_off = batch.rope_offsets.to(device=device, dtype=torch.int32)
        return TritonPlan(
            cos=cos, sin=sin, rope_off=rope_off, cu_q=cu_q, q_pos=q_pos, tables=tables, kv_pos=kv_pos,
            decode=decode, prefill=prefill,
        )  # fmt: skip

    def _tiles(
        self, batch: AttentionBatch, launch: Launch, *, decode: bool, rope32: tuple | None = None, **common
    ) -> TritonTiles:
        """The decode (``decode``) or the recompute passes' tiles for ``launch``, split as asked for or, by default,
        by ``split_limit`` (waves balanced for recompute passes): from the tiles (rows), the KV heads, the widest
        table (slots) and the GPU's resident programs of this launch (SMs x programs per SM). Host data only."""
        tiles = query_tiles(batch, decode=decode, per_tile=launch.block_m // self.group)
        seqs, num_slots = sorted(set(tiles[0])), common["kv_pos"].shape[1]
        once = not decode and self._rotates_once(num_tiles=len(tiles[0]), seqs=seqs, num_slots=num_slots)
        launch = self._once(launch) if once else launch
        asked = self.splits[decode]
        splits = asked or split_limit(
            num_programs=len(tiles[0]) * self.shape.num_kv_heads,
            num_kv_tiles=num_slots // launch.block_n,
            resident=self._resident_programs(launch, batch.q_positions.device, decode=decode),
            balance_waves=not decode,
        )
        min_chunk = 1 if asked else MIN_TILES_PER_SPLIT  # asked-for splits split short contexts too
        made = make_tiles(
            tiles, replace(launch, split=splits > 1), max_splits=splits, min_chunk=min_chunk,
            num_kv_heads=self.shape.num_kv_heads, d_pad=pow2(self.shape.head_dim), **common,
        )  # fmt: skip
        if not once:
            return made
        return replace(made, rotated=self._rotated_rows(seqs, batch, num_slots=num_slots, rope32=rope32))

    def _rotates_once(self, *, num_tiles: int, seqs: list[int], num_slots: int) -> bool:
        """Whether a recompute passes' launch of ``num_tiles`` query tiles over ``seqs`` (``num_slots`` slots each)
        reads K rotated once: as asked (``rotate_once``), else when its sequences average ``ROTATE_ONCE_MIN_TILES``
        query tiles or more (each KV tile would be rotated that many times in the loop) and the rows fit
        ``ROTATE_ONCE_MAX_BYTES``. Host data only."""
        if not self.rotate_k or not num_tiles or self.rotate_once is False:
            return False
        if self.rotate_once:
            return True
        size = len(seqs) * num_slots * self.shape.num_kv_heads * self.shape.head_dim * self.shape.dtype.itemsize
        return num_tiles >= ROTATE_ONCE_MIN_TILES * len(seqs) and size <= ROTATE_ONCE_MAX_BYTES

    def _rotated_rows(self, seqs: list[int], batch: AttentionBatch, *, num_slots: int, rope32: tuple) -> RotatedK:
        config = launch_config(self.shape.head_dim, "rotate")
        return RotatedK.empty(
            seqs, *rope32, num_seqs=batch.kv_positions.shape[0], num_slots=num_slots,
            num_kv_heads=self.shape.num_kv_heads,
            head_dim=self.shape.head_dim, dtype=self.shape.dtype, device=batch.q_positions.device,
            block=math.gcd(config.block_n, num_slots), num_warps=config.num_warps,
        )  # fmt: skip

    def _resident_programs(self, launch: Launch, device: torch.device, *, decode: bool) -> int:
        """Programs of ``launch`` the GPU holds at once (0 in the interpreter without ``num_sms``: no splits)."""
        num_sms = self.num_sms
        if num_sms is None:
            num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0
        return num_sms * self.blocks_per_sm.get(replace(launch, split=False), ASSUMED_BLOCKS_PER_SM[decode])

    def _rope_halves(self, batch: AttentionBatch) -> tuple[torch.Tensor, ...]:
        """One half of each rotary table, cos and sin, in the model's dtype (transformers rounds cos and sin to it
        too: half the bytes per slot of the float32 table, for the loops that rotate K per tile), then in float32
        (what K rotated once per layer and its launch's queries are rotated with: read once, so the bytes do not
        count, and the rounding of the table, which made the in-loop kernel's error larger than SDPA's on an H100, goes:
        docs/gpu.md#the-first-run-an-nvidia-h100-2026-11-26).
        A static table is the same tensor every forward: kept."""
        cos, sin = batch.rope_cos, batch.rope_sin
        assert cos.shape[1] == self.shape.head_dim, (self.shape.head_dim, cos.shape)
        if self._halves and self._halves[0] is cos and self._halves[1] is sin:
            return self._halves[2:]
        half = self.shape.head_dim // 2
        halves = tuple(t[:, :half].to(self.shape.dtype).contiguous() for t in (cos, sin))
        halves += tuple(t[:, :half].float().contiguous() for t in (cos, sin))
        self._halves = (cos, sin, *halves)
        return halves

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: TritonPlan,
        *,
        scaling: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        assert q.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
        out = torch.empty_like(q)
        for tiles in (plan.decode, plan.prefill):
            if tiles.num_tiles:
                launch_attention(q, k_cache, v_cache, out, plan, tiles, scaling=scaling, window=sliding_window)
        return out

    def precompile(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> list[CompiledLaunch]:
        """Compile every kernel variant this backend may launch over this cache, before serving, so that no
        request waits on a compile. Each compiles as a real launch would: the JIT's own specialization of the
        real argument layout (aligned pointers, strides divisible by 16), cached where the launch finds it.
        In the interpreter nothing compiles (``[]``).

        Args:
            k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, one layer's
                (only their layout counts).

        Returns:
            Each launch and window kind with its compiled ``paged_attention_kernel`` (and ``combine_splits_kernel``).
        """
        if isinstance(paged_attention_kernel, triton.runtime.interpreter.InterpretedFunction):
            return []
        on_gpu = k_cache.device.type == "cuda"  # else compiling for a GPU elsewhere (tests/compile_kernels.py)
        with torch.cuda.device(k_cache.device) if on_gpu else nullcontext():  # the JIT caches per current device
            compiled = compile_launches(self, k_cache, v_cache)
        if on_gpu:
            self._read_residency(compiled, k_cache.device)
        return compiled

    def _read_residency(self, compiled: list[CompiledLaunch], device: torch.device) -> None:
        """Split by the residency each compiled (unsplit) launch really has, its tightest window variant's."""
        major, minor = self._capability(device)
        for name, launch in self.launches(device).items():
            kernels = [c.kernels[0] for c in compiled if c.name == name]
            if kernels and not launch.split:
                self.blocks_per_sm[launch] = min(
                    kernel_resources(k, arch=10 * major + minor).blocks_per_sm for k in kernels
                )

    def store(self, k_rows: torch.Tensor, v_rows: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """One launch for K and V."""
        if not rows.numel():
            return
        launch_store(k_rows, v_rows, rows, k, v)
