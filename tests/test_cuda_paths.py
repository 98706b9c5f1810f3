"""The CUDA paths of the KV pool, the chunk store and sampling, on ``PIC_TEST_DEVICE`` (tests/device.py).

On CUDA they hold the code to the stream semantics it relies on. A copy from the pool to the CPU tier's
page-locked memory must have finished when it returns, though kernels that write the pool are still
queued before it; a copy from page-locked memory into the pool may still be running when the host frees
its source and allocates again, and must read what was there. A ``torch.cuda._sleep`` keeps the GPU busy
so that the work queued after it is still pending when the host goes on. On the CPU the same tests check
what does not need a GPU (no page-locked memory for a CPU engine, the sampler's draws, pool sizing); the
host-sync and stream tests need CUDA and say so when skipped.
"""

from __future__ import annotations

import inspect
import os
import sys
import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import pic
import pic.kv.memory
from pic.config import CompileOptions
from pic.engine.core.kv_manager import KVManager
from pic.kv import BlockPool, ChunkInfo, ChunkKV, KVCache
from pic.kv.transfer import long_tensor, sync_sites
from pic.link.recompute import RecomputePass
from pic.model.sampler import _multinomial_one, sample_rows, sample_tokens
from pic.sampling import SamplingParams
from pic.store import LruTier, TieredStore
from pic.store.serde import Expected
from tests.conftest import make_target_engine
from tests.device import target
from tests.models import DOCS, QUERY

CUDA = target().device.type == "cuda"
cuda_only = pytest.mark.skipif(not CUDA, reason="CUDA only: host syncs and streams (PIC_TEST_DEVICE=cuda)")
SHAPE = dict(num_layers=2, num_kv_heads=2, head_dim=8)


def busy_gpu() -> None:
    """Queue about 0.1 s of GPU work, so that what is queued next is still pending when the host goes on."""
    if CUDA:
        torch.cuda._sleep(200_000_000)


def make_chunk(cache_id: str = "c", num_tokens: int = 10) -> ChunkKV:
    """A chunk of random KV on the CPU, in the test dtype."""
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(2, num_tokens, 2, 8, generator=gen).to(target().dtype) for _ in range(2))
    return ChunkKV(cache_id, torch.arange(num_tokens), k, v, CompileOptions())


def make_store(device: torch.device) -> tuple[TieredStore, BlockPool, KVCache]:
    """A pool of 16 blocks of 4 on ``device`` and an unbounded CPU tier, as the engine builds them."""
    pool, cache = (
        BlockPool(16, block_size=4),
        KVCache(num_blocks=16, block_size=4, dtype=target().dtype, device=device, **SHAPE),
    )
    expected = Expected("f", dtype=target().dtype, max_tokens=64, vocab_size=512, **SHAPE)
    kv = KVManager(
        pool, cache, block_size=4, kv_bytes_per_token=0,
        store_over=lambda d: TieredStore.from_config(pic.StoreConfig(cpu_bytes=None), device=d, expected=expected),
    )  # fmt: skip
    return kv.store, pool, cache


def test_the_cpu_tier_is_page_locked_only_for_an_engine_on_cuda():
    for device in (torch.device("cpu"), target().device):
        store, _, _ = make_store(device)
        (cpu,) = store.lower
        assert isinstance(cpu, LruTier) and cpu.put(make_chunk())
        assert cpu.peek("c").k.is_pinned() == (device.type == "cuda"), device


def test_write_through_to_page_locked_memory_waits_for_the_pool_writes():
    """``TieredStore.copy_for_lower`` copies the pool's blocks out (D2H) and ``write_lower`` puts the copy in the
    CPU tier; the data is there on return."""
    (store, pool, cache), chunk = make_store(target().device), make_chunk()
    k, v = chunk.k.to(target().device), chunk.v.to(target().device)
    blocks = pool.allocate(3)
    busy_gpu()
    cache.write(blocks, k, v)  # queued behind the busy GPU
    store.add(ChunkInfo("c", chunk.token_ids, chunk.options), blocks)
    assert store.write_lower(store.copy_for_lower("c")) == ["cpu"]
    copy = store.lower[0].peek("c")
    assert torch.equal(copy.k, chunk.k) and torch.equal(copy.v, chunk.v)  # read at once, no sync of ours


def test_promotion_from_page_locked_memory_survives_its_source_being_freed():
    """The H2D copy of a promotion is asynchronous; freeing its source and allocating page-locked memory
    again before it ran must not change what lands in the pool."""
    (store, pool, cache), chunk = make_store(target().device), make_chunk()
    blocks = pool.allocate(3)
    cache.write(blocks, chunk.k.to(target().device), chunk.v.to(target().device))
    store.add(ChunkInfo("c", chunk.token_ids, chunk.options), blocks)
    store.write_lower(store.copy_for_lower("c"))
    pool.free(blocks)
    assert store.device.delete("c") and store.lookup("c") == ("cpu",)
    source = store.load("c")
    assert isinstance(source, ChunkKV) and source.k.is_pinned() == CUDA
    busy_gpu()
    promoted = store.promote(source)  # the copy waits behind the busy GPU
    del source
    assert store.lower[0].delete("c")  # the last reference to the page-locked source: freed
    junk = [torch.empty(chunk.k.shape, dtype=chunk.k.dtype, pin_memory=CUDA).fill_(float("nan")) for _ in range(8)]
    k, v = cache.read(promoted, chunk.num_tokens)
    assert torch.equal(k.cpu(), chunk.k) and torch.equal(v.cpu(), chunk.v), len(junk)


def test_sampling_is_seeded_on_the_device_and_draws_what_multinomial_draws():
    device = target().device
    logits = 3 * torch.randn(4, 512, generator=torch.Generator().manual_seed(1)).to(device)
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.9, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=50),
        SamplingParams(temperature=0.7),
    ]

    def generators() -> list[torch.Generator | None]:
        return [None] + [torch.Generator(device=device).manual_seed(seed) for seed in (1, 2, 3)]

    tokens = sample_tokens(logits, params, generators())
    assert tokens.device == logits.device and tokens.dtype == torch.long
    assert sample_rows(logits, params, generators()) == tokens.tolist()
    assert tokens[0].item() == logits[0].argmax().item()
    for seed in range(50):
        probs = (logits[3] / 0.7).softmax(-1)
        ours = _multinomial_one(probs, torch.Generator(device=device).manual_seed(seed))
        theirs = torch.multinomial(probs, 1, generator=torch.Generator(device=device).manual_seed(seed))
        assert ours.item() == theirs.item(), seed


def test_a_pool_sized_from_free_cuda_memory_counts_the_allocator_cache_and_fits(monkeypatch):
    """On CUDA, memory torch caches but no tensor uses is free to the pool, and a pool sized from free
    memory rounds down to whole blocks, so ``kv_memory_fraction=1`` is not refused (CUDA faked)."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1000 * 48, 1 << 40))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 500 * 48)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 100 * 48)
    cuda = torch.device("cuda", 0)
    assert pic.kv.memory.available_bytes(cuda) == 1400 * 48
    made = {}
    monkeypatch.setattr(pic.kv.memory, "KVCache", lambda **kwargs: made.update(kwargs) or "cache")
    pool, cache = pic.kv.memory.build_kv_pool(  # 2 x 1 x 3 x 4 x 2 = 48 bytes per token
        num_layers=1, num_kv_heads=3, head_dim=4, dtype=torch.float16, device=cuda, block_size=16,
        kv_pool_tokens=None, memory_fraction=1.0,
    )  # fmt: skip
    assert cache == "cache" and made["num_blocks"] == pool.num_blocks == 1400 // 16


@cuda_only
def test_a_default_pool_on_cuda_takes_its_share_of_the_free_memory():
    make_target_engine("stories260K", kv_pool_tokens=16)  # the model and its tables are on the GPU first
    free = pic.kv.memory.available_bytes(target().device)
    engine = make_target_engine("stories260K", kv_pool_tokens=None, kv_memory_fraction=0.05)
    with engine.paused() as core:
        block_bytes = core.cache.bytes_per_block
    pool_bytes = engine.kv_stats().num_blocks * block_bytes
    assert abs(pool_bytes - 0.05 * free) <= 1e-3 * free + block_bytes, (pool_bytes, free)
    del engine
    torch.cuda.empty_cache()


@cuda_only
def test_sampling_and_moving_host_data_queue_without_a_host_sync():
    device = target().device
    logits = torch.randn(3, 512, device=device)
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, top_k=40), SamplingParams(temperature=1.0)]
    gens = [None, torch.Generator(device=device).manual_seed(0), None]
    torch.cuda.synchronize()
    assert sync_sites(lambda: (sample_tokens(logits, params, gens), long_tensor([3, 1, 2], device))) == []


@cuda_only
def test_steps_sync_the_host_only_to_read_the_sampled_tokens():
    """pic's own code (engine, link, kv, store) syncs once per step, in ``sample_rows``: in the step that
    admits requests under static policies (assembly, recompute passes, first tokens) and in every decode
    step after it. The runner's and attention's syncs, if any, are listed in the failure message."""
    engine = make_target_engine("stories260K", eos_token_ids=())  # every request runs all its steps
    ids = engine.compile(list(DOCS))
    core = engine.stepper()
    for i, policy in enumerate(("legolink:16", "mepic", "naive", "full")):
        sampling = dict(temperature=0.8, seed=i) if i % 2 else {}
        core.add_request(pic.Request(ids, f"{QUERY} {i}", policy=policy, max_new_tokens=40, **sampling))
    lines, start = inspect.getsourcelines(sample_rows)
    token_read = (os.path.realpath(inspect.getsourcefile(sample_rows)), range(start, start + len(lines)))
    package = os.path.dirname(os.path.realpath(pic.__file__))
    ours = tuple(os.path.join(package, p) + os.sep for p in ("engine", "link", "kv", "store"))
    with engine.paused() as owned:  # this thread steps the core while its own thread waits
        for _ in range(23):  # admission, then decode steps across block boundaries (decode blocks appended)
            sites = [(os.path.realpath(f), n) for f, n in sync_sites(owned.step)]
            mine = [(f, n) for f, n in sites if f.startswith(ours)]
            assert len(mine) == 1 and mine[0][0] == token_read[0] and mine[0][1] in token_read[1], sites
        assert [len(s.output_ids) for s in owned.scheduler.queues.requests.values()] == [23] * 4


class HostValues(TorchDispatchMode):
    """Records the ops that code objects ``watched`` run (directly or through helpers) which, on CUDA, move a value
    between the host and the device and so wait for the GPU: a Python number made a tensor (``lift_fresh``: made
    on the host, then copied to the device by a blocking copy, as ``t[index] = -1`` does), a tensor read by the host
    (``_local_scalar_dense``: ``item()``, ``int()``, ``bool()``) and ``nonzero`` (its size is read). Runs on the CPU,
    where torch's sync debug mode does not exist: ``[(op, file, line)]`` of the watched function's line.
    ``num_watched`` counts every op the watched code ran: a check's control that it ran under the recorder at all."""

    HOST_OPS = ("aten.lift_fresh", "aten._local_scalar_dense", "aten.nonzero")

    def __init__(self, *watched) -> None:
        super().__init__()
        self.watched, self.sites, self.num_watched = watched, [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frame = sys._getframe(1)
        while frame is not None and frame.f_code not in self.watched:
            frame = frame.f_back
        if frame is not None:
            self.num_watched += 1
            if str(func).startswith(self.HOST_OPS):
                self.sites.append((str(func), os.path.basename(frame.f_code.co_filename), frame.f_lineno))
        return func(*args, **(kwargs or {}))


def test_a_recompute_piece_moves_no_value_between_host_and_device():
    """Each piece of a recompute pass (``RecomputePass.seq_input``, per request and piece: its slots' positions
    written, later pieces' cleared) runs device ops only, on any device. The first H100 run found a host sync
    there in every step admitting a request (``req.kv_positions[slots] = -1``: the -1 made on the host and copied
    to the GPU, blocking); the CUDA test above counts syncs, this one shows their cause on the CPU."""
    engine = make_target_engine("stories260K", eos_token_ids=(), max_num_batched_tokens=64)  # in pieces
    ids = engine.compile(list(DOCS))
    core = engine.stepper()
    for i, policy in enumerate(("legolink:16", "mepic", "naive", "full")):
        core.add_request(pic.Request(ids, f"{QUERY} {i}", policy=policy, max_new_tokens=2))
    recorder = HostValues(RecomputePass.seq_input.__code__)
    with engine.paused() as owned, recorder:
        for _ in range(40):
            owned.step()
            if all(s.output_ids for s in owned.scheduler.queues.requests.values()):
                break
    assert all(s.output_ids for s in owned.scheduler.queues.requests.values())
    assert recorder.num_watched > 0  # the pieces' inputs were built under the recorder (its control)
    assert recorder.sites == []


@cuda_only
def test_steps_from_a_thread_on_another_stream_run_on_the_engine_stream():
    """Whichever stream a calling thread has made current, the engine's forwards run on its own thread's
    stream, the default one (so one step's pool writes are ordered before the next step's reads), with the
    same tokens."""
    engine = make_target_engine("stories260K")
    ids = engine.compile(list(DOCS))
    expected = engine.link(ids, QUERY).generate(24).token_ids
    engine_stream, streams, got = torch.cuda.current_stream(), [], {}
    with engine.paused() as core:
        forward = core.runner.forward

        def recording_forward(seqs):
            streams.append(torch.cuda.current_stream())
            return forward(seqs)

        core.runner.forward = recording_forward

    def run() -> None:
        with torch.cuda.stream(torch.cuda.Stream()):
            busy_gpu()
            got["tokens"] = engine.link(ids, QUERY).generate(24).token_ids

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=120)
    assert got["tokens"] == expected
    assert streams and all(s == engine_stream for s in streams)
