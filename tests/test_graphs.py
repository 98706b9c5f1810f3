"""Graphs for the forwards of few rows (``pic.model.graphs``): on the CPU their eager body on the same buckets,
buffers, padding and plan copies a CUDA graph replays, held to the runner's own forward (Triton's interpreter).

On a GPU (``PIC_TEST_DEVICE=cuda``) the same tests capture and replay real graphs, held to eager.
"""

from __future__ import annotations

import pytest
import torch

import pic
from pic.model.graphs import ROW_BUCKETS, PlanMismatch, bucket_rows, copy_into
from tests.conftest import make_target_engine
from tests.device import target
from tests.models import DOCS, QUERY

pytest.importorskip("triton")

NUM_NEW = 6


def _engine() -> pic.PIC:
    return make_target_engine("stories260K", dtype=torch.float32, attention_backend="triton", eos_token_ids=())


def _run(engine: pic.PIC, ids, queries: list[str], policy: str):
    linked = [engine.link(ids, q, policy=policy) for q in queries]
    generations = pic.generate_together(linked, NUM_NEW) if len(linked) > 1 else [linked[0].generate(NUM_NEW)]
    return [link.logits for link in linked], [g.token_ids for g in generations]


@pytest.mark.parametrize("num_requests", [1, 3])  # 3 decode rows: a bucket of 4 with one padded sequence
def test_graphed_forwards_equal_the_runner(num_requests):
    """A naive link's query pass (padded to its bucket) and every decode step after it through the buckets give the
    tokens the runner's own forward gives, and logits within float32 rounding (the products run over padded rows)."""
    queries = [f"{QUERY} {i}" for i in range(num_requests)]
    plain = _engine()
    ids = plain.compile(list(DOCS))
    want_logits, want_tokens = _run(plain, ids, queries, "naive")
    plain.close()

    graphed = _engine()
    ids = graphed.compile(list(DOCS))
    with graphed.paused() as core:
        forwards = core.runner.use_graphs(capture=target().device.type == "cuda")
    got_logits, got_tokens = _run(graphed, ids, queries, "naive")
    graphed.close()
    assert got_tokens == want_tokens
    for got, want in zip(got_logits, want_logits, strict=True):
        assert (got - want).abs().max().item() <= 1e-4
    assert forwards.num_replays >= num_requests + NUM_NEW - 1 and forwards.num_eager == 0


def test_full_recompute_passes_stay_eager():
    """A pass of more rows than the largest bucket runs the runner's own forward; the decode steps after it graphs."""
    engine = _engine()
    ids = engine.compile(list(DOCS) * 3)  # a prompt of more than ROW_BUCKETS[-1] tokens
    with engine.paused() as core:
        forwards = core.runner.use_graphs(capture=target().device.type == "cuda")
    linked = engine.link(ids, QUERY, policy="full")
    assert linked.input_ids.shape[0] > ROW_BUCKETS[-1]
    linked.generate(3)
    engine.close()
    assert forwards.num_replays == 2  # the decode steps after the first token


def test_buckets_and_plan_copies():
    from pic.attention.triton_split import SplitScratch

    assert [bucket_rows(n) for n in (1, 3, 5, 64)] == [1, 4, 8, 64] and bucket_rows(65) is None
    dst = {"a": torch.zeros(3), "n": 2, "t": (torch.zeros(2, dtype=torch.int32),)}
    copy_into(dst, {"a": torch.ones(3), "n": 2, "t": (torch.full((2,), 7, dtype=torch.int32),)})
    assert dst["a"].tolist() == [1.0, 1.0, 1.0] and dst["t"][0].tolist() == [7, 7]
    with pytest.raises(PlanMismatch):
        copy_into(dst, {"a": torch.ones(4), "n": 2, "t": (torch.zeros(2, dtype=torch.int32),)})
    with pytest.raises(PlanMismatch):
        copy_into(dst, {"a": torch.ones(3), "n": 3, "t": (torch.zeros(2, dtype=torch.int32),)})
    scratch, fresh = SplitScratch(torch.zeros(4), torch.zeros(2)), SplitScratch(torch.ones(4), torch.ones(2))
    copy_into(scratch, fresh)  # scratch the kernels write first: not copied
    assert scratch.acc.sum() == 0 and scratch.ml.sum() == 0


def test_graphs_need_a_cuda_model_on_the_triton_backend():
    if target().device.type == "cuda":
        pytest.skip("a CUDA model captures")
    with pytest.raises(pic.PicError, match="CUDA graphs need a CUDA model; this one is on cpu"):
        pic.load(config=pic.PICConfig(cuda_graphs=True))
    engine = make_target_engine("stories260K", dtype=torch.float32)  # the reference backend
    try:
        with engine.paused() as core:
            assert core.runner.graphed is None  # the default (cuda_graphs=None) leaves a CPU model eager
            with pytest.raises(pic.PicError, match="attention_backend='triton'"):
                core.runner.use_graphs(capture=False)
    finally:
        engine.close()


def test_what_a_graph_replays_reads_no_host_value():
    """A CUDA graph cannot capture a host sync: the graph's body (every layer over the bucket's buffers) must move
    no value between host and device, nor should the work before each replay (the buffers filled, the plan copied;
    the plan itself is built as the runner's own forward builds it, checked on CUDA by tests/test_cuda_paths.py).
    Checked on the CPU with ``HostValues``, which records the operations that would (a Python number made a tensor,
    a tensor read by the host, ``nonzero``), in this thread, which steps the engine's core while its own waits."""
    from pic.model.graphs import GraphedForwards, copy_into
    from tests.test_cuda_paths import HostValues

    engine = _engine()
    ids = engine.compile(list(DOCS))
    core = engine.stepper()
    core.add_request(pic.Request(ids, QUERY, policy="naive", max_new_tokens=4))
    recorder = HostValues(GraphedForwards._body.__code__, GraphedForwards._fill.__code__, copy_into.__code__)
    try:
        with engine.paused() as owned:
            forwards = owned.runner.use_graphs(capture=False)
            with recorder:
                for _ in range(20):
                    owned.step()
                    if forwards.num_replays >= 4:
                        break
    finally:
        engine.close()
    assert forwards.num_replays >= 4  # the query pass and decode steps went through their buckets
    assert recorder.num_watched > 100  # the body, fills and copies ran under the recorder (its control)
    assert recorder.sites == [], recorder.sites  # nor does the work around it (buffers filled, plan copied)
