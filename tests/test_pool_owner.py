"""The KV manager is the one writer of the block pool (issue 64), checked two ways: statically, no module of pic/ but
the KV manager (and the pool itself) calls a method of ``BlockPool`` that changes it, on anything; at run time, every
call of one during real work (compiles, links with a lower tier, probes, decoding, preemption, eviction, promotion,
pins, deletes) comes from the KV manager's frames. And the scheduler's module imports no torch: it decides who
runs; the tensors live behind the core's executor."""

from __future__ import annotations

import ast
import inspect
import sys
from pathlib import Path

import pytest

import pic
from pic.kv.block_pool import BlockPool
from tests.models import model, tokenizer

PIC = Path(pic.__file__).parent
OWNER = PIC / "engine" / "core" / "kv_manager.py"
POOL = PIC / "kv" / "block_pool.py"
# BlockPool's public methods that change it (everything else it offers reads).
MUTATING = {"allocate", "free", "incref", "add_chunk", "hold", "pin", "unpin", "drop", "reset_peak"}


def test_the_mutating_methods_are_the_pools_own():
    """The list above is BlockPool's: each is a method of it, and every public method not in it only reads (a new
    mutating method must be added here, or the static check below would not see it)."""
    public = {n for n, f in inspect.getmembers(BlockPool, inspect.isfunction) if not n.startswith("_")}
    assert public >= MUTATING
    readers = {"is_resident", "usage", "share", "num_available", "check_available", "stats", "audit"}
    assert public - MUTATING == readers, public - MUTATING - readers


def pool_calls(path: Path) -> list[str]:
    """The calls ``<anything>.<m>(...)`` with ``m`` a pool mutator whose receiver names a pool (``pool``,
    ``self.pool``, ``self._pool``, ``core.kv.pool`` ...)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATING:
            receiver = node.func.value
            name = receiver.attr if isinstance(receiver, ast.Attribute) else getattr(receiver, "id", "")
            if "pool" in name.lower():
                found.append(f"{path.relative_to(PIC.parent)}:{node.lineno}: {ast.unparse(node.func)}")
    return found


def test_no_module_but_the_kv_manager_writes_the_pool():
    files = [p for p in PIC.rglob("*.py") if p not in (OWNER, POOL)]
    assert len(files) > 100
    assert pool_calls(OWNER), "the check finds the KV manager's own calls (it can see one)"
    assert [c for p in files for c in pool_calls(p)] == []


def test_every_pool_write_at_run_time_comes_from_the_kv_manager(tmp_path, monkeypatch):
    callers: dict[str, set[str]] = {}
    for name in MUTATING:
        original = getattr(BlockPool, name)

        def watched(self, *args, _name=name, _original=original, **kwargs):
            frame = sys._getframe(1)
            callers.setdefault(_name, set()).add(frame.f_code.co_filename)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(BlockPool, name, watched)
    store = pic.StoreConfig(cpu_bytes=64 << 20)
    config = pic.PICConfig(kv_pool_tokens=640)  # 40 blocks of 16: compiles evict, links promote from the CPU tier
    with pic.PIC(model("stories260K"), tokenizer(), config=config, store=store) as eng:
        story = "the little girl walked to the old house by the river and saw a big red ball"
        ids = [eng.compile([f"Document {i}: {story} number {i}."])[0] for i in range(20)]
        eng.store.pin(ids[-1])
        for policy in ("naive", "legolink:4", "cacheblend:0.3", "auto"):
            eng.link(ids[:2], " What did she see?", policy=policy).generate(max_new_tokens=12)
        linked = eng.link([ids[0]], " Where?")
        linked.release()
        many = eng.link_many([pic.Request(cache_ids=[i], query=" And then?") for i in ids[:3]])
        pic.generate_together(many, max_new_tokens=40)  # (three streams of 40)
        eng.store.unpin(ids[-1])
        eng.store.expire(ids[1])
        eng.reset_peak()
    seen = {name: {Path(f).resolve() for f in files} for name, files in callers.items()}
    assert {"allocate", "free", "hold", "add_chunk", "pin", "unpin", "drop", "reset_peak"} <= set(seen), set(seen)
    outside = {name: sorted(str(f) for f in files if f != OWNER.resolve()) for name, files in seen.items()}
    assert all(not files for files in outside.values()), outside


@pytest.mark.parametrize("module", ["pic.engine.core.scheduler"])
def test_the_scheduler_imports_no_torch(module):
    """Its module's own imports (at any depth of the file, TYPE_CHECKING ones too) name no torch."""
    path = Path(sys.modules[module].__file__ if module in sys.modules else __import__(module, fromlist=["_"]).__file__)
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append(node.module or "")
    assert names and not [n for n in names if n.split(".")[0] == "torch"], names
