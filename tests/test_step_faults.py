"""One rule for a step that fails (issue 64): a fault injected once at each site — the scheduler's ``schedule``, the
forward, the LM head the sampler reads, a lower tier's load, a lower tier's write — on engines with and without
lower tiers. The call that meets it fails with a ``PicError`` (or succeeds, where the store's own rule makes the
fault a miss); then the same engine compiles and links new documents and answers exactly what a clean engine
answers, its pool back at rest and its loader working. Before issue 64 a fault that escaped a step closed the
loader's threads while the engine kept accepting: every later compile on an engine with a CPU or disk tier raised a
raw ``RuntimeError: cannot schedule new futures after shutdown``, forever."""

from __future__ import annotations

import pytest

import pic
from pic.engine.core.scheduler import Scheduler
from pic.model import ModelRunner
from pic.store.disk import DiskTier
from pic.store.lru import LruTier
from tests.models import model, tokenizer

DOCS = ["Once upon a time there was a cat named Tom.", "The dog ran in the big park all day."]
NEW = ["A bird sang a song in the tall tree.", "The fish swam in the blue sea near the boat."]
QUERY = " What did they do?"


class Injected(RuntimeError):
    """The fault: nothing in pic raises it."""


def once(cls: type, name: str, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make ``cls.name`` raise ``Injected`` the first time it is called (from any thread); returns the count of
    faults raised (a list, so the test reads it after)."""
    original, raised = getattr(cls, name), []

    def faulty(*args, **kwargs):
        if not raised:
            raised.append(1)
            raise Injected(f"injected into {cls.__name__}.{name}")
        return original(*args, **kwargs)

    monkeypatch.setattr(cls, name, faulty)
    return raised


SITES = {
    "schedule": (Scheduler, "schedule"),
    "forward": (ModelRunner, "forward"),
    "sampling": (ModelRunner, "logits"),
    "load": (LruTier, "get"),
    "write": (LruTier, "put"),
    "disk load": (DiskTier, "get"),
    "disk write": (DiskTier, "put"),
}
LOWER = {"load", "write", "disk load", "disk write"}


def engine(tiers: bool, tmp_path, *, cpu: bool = True) -> pic.PIC:
    # A pool of 12 blocks of 16 tokens: the documents do not all stay resident, so links load from the lower tiers
    # (``cpu=False``: from the disk).
    config = pic.PICConfig(kv_pool_tokens=192)
    disk = str(tmp_path / "chunks")
    store = pic.StoreConfig(cpu_bytes=(64 << 20) if cpu else 0, disk_path=disk, disk_bytes=256 << 20)
    return pic.PIC(model("stories260K"), tokenizer(), config=config, store=store if tiers else None)


def answers(eng: pic.PIC, docs: list[str]) -> list[str]:
    """Compile ``docs``, then link each alone and both together and generate greedily."""
    ids = eng.compile(docs)
    links = [[ids[0]], [ids[1]], ids, ids[::-1]]
    return [eng.link(chunks, QUERY, policy="naive").generate(max_new_tokens=8).text for chunks in links]


def exercise(eng: pic.PIC) -> None:
    """Work that meets every site: compiles (writes), links of chunks evicted from the pool (loads), generation."""
    story = "the little girl walked to the old house by the river and saw a big red ball in the grass"
    fillers = [f"Filler {i}: {story}, and then {i} more birds." for i in range(6)]  # 3 blocks each: 24 > 12
    ids = [eng.compile([doc])[0] for doc in DOCS + fillers]  # (one at a time: together they overflow the pool)
    for cid in ids:
        eng.link([cid], QUERY, policy="naive").generate(max_new_tokens=4)


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> dict[bool, list[str]]:
    """What engines without a fault answer: with and without lower tiers (the CPU tier is no matter: it holds
    exact copies)."""
    out = {}
    for tiers in (False, True):
        with engine(tiers, tmp_path_factory.mktemp("clean")) as eng:
            out[tiers] = answers(eng, NEW)
    return out


@pytest.mark.parametrize("tiers", [False, True], ids=["pool only", "cpu and disk"])
@pytest.mark.parametrize("site", list(SITES))
def test_a_fault_once_fails_only_its_work_and_the_engine_goes_on(site, tiers, clean, tmp_path, monkeypatch):
    if site in LOWER and not tiers:
        pytest.skip("no lower tier to fail")
    with engine(tiers, tmp_path, cpu=not site.startswith("disk")) as eng:
        raised = once(*SITES[site], monkeypatch)
        try:
            exercise(eng)
        except pic.PicError:
            pass  # the work that met the fault, failed with a clear error (anything else escapes and fails)
        assert raised, f"the fault at {site} was never reached"
        monkeypatch.undo()
        assert answers(eng, NEW) == clean[tiers]
        stats = eng.kv_stats()
        assert stats.num_private_blocks == 0 and stats.num_held_chunk_blocks == 0, stats
        assert eng.compile(["One more document after the fault."])  # the loader still runs


def test_a_step_that_raises_does_not_stop_the_lower_tiers(tmp_path, monkeypatch):
    """The reproduction of issue 64: compile two documents on an engine with CPU and disk tiers, make
    ``Scheduler.schedule`` raise once, then compile a new document."""
    store = pic.StoreConfig(cpu_bytes=64 << 20, disk_path=str(tmp_path / "chunks"), disk_bytes=256 << 20)
    with pic.PIC(model("stories260K"), tokenizer(), store=store) as eng:
        eng.compile(DOCS)
        once(Scheduler, "schedule", monkeypatch)
        with pytest.raises(pic.EngineStepError, match="injected into Scheduler.schedule") as failed:
            eng.compile([NEW[0]])
        assert isinstance(failed.value.__cause__, Injected)
        assert eng.compile([NEW[1]])  # was: RuntimeError: cannot schedule new futures after shutdown
        assert eng.compile([NEW[0]])


def test_a_pool_that_does_not_add_up_closes_the_engine(monkeypatch):
    """Where the failed step left the pool inconsistent (here: a block leaked, as a half-done allocation would), the
    engine closes: the call in the step and every later one raise ``EngineClosedError``, none hangs."""
    with pic.PIC(model("stories260K"), tokenizer()) as eng:
        ids = eng.compile(DOCS)
        original = Scheduler.schedule

        def leaks(self):
            self.kv.pool.allocate(1)  # taken, never recorded anywhere
            raise Injected("a half-done allocation")

        monkeypatch.setattr(Scheduler, "schedule", leaks)
        with pytest.raises(pic.PicError):
            eng.link(ids, QUERY).generate(max_new_tokens=2)
        monkeypatch.setattr(Scheduler, "schedule", original)
        with pytest.raises(pic.EngineClosedError, match="inconsistent"):
            eng.compile([NEW[0]])
        with pytest.raises(pic.EngineClosedError):
            eng.link(ids, QUERY)
