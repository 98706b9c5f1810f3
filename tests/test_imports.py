"""The import graph of ``pic/``, computed from the sources (issue 49): no circle anywhere, and the engine's two sides
meet only through the command channel.

Every import counts: at module level, inside functions, and under ``if TYPE_CHECKING`` (a circle there is still
two modules that need each other); ``from a import b`` is an edge to ``a.b`` when that is a module, else to ``a``.
The graph is the one ``benchmarks/engine_shape.py`` reports (``benchmarks/_shape_steps.py``).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The one module of the core the caller's side imports: the function that starts the core and returns the channel.
CORE_ENTRY = "pic.engine.core.build"


def _shape_steps():
    spec = importlib.util.spec_from_file_location("_shape_steps", ROOT / "benchmarks" / "_shape_steps.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


STEPS = _shape_steps()


def import_graph() -> dict[str, set[str]]:
    """Module -> the ``pic`` modules it imports."""
    files = sorted((ROOT / "pic").rglob("*.py"))
    return STEPS.import_graph({p.relative_to(ROOT).as_posix(): ast.parse(p.read_text(), str(p)) for p in files})


def test_the_finder_sees_a_circle():
    assert STEPS.strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert STEPS.strongly_connected({"a": {"b"}, "b": set()}) == []
    tree = {"pic/x.py": ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pic.y import Y\n")}
    tree["pic/y.py"] = ast.parse("def f():\n    from pic import x\n")
    tree["pic/__init__.py"] = ast.parse("")
    assert STEPS.strongly_connected(STEPS.import_graph(tree)) == [["pic.x", "pic.y"]]


def test_no_module_of_pic_is_in_an_import_circle():
    graph = import_graph()
    assert len(graph) > 100 and "pic.engine.core.scheduler" in graph["pic.engine.core.core"]
    assert STEPS.strongly_connected(graph) == []


def test_the_engine_sides_meet_only_through_the_command_channel():
    """The core imports nothing of the caller's side; the caller's side imports of the core only the function that
    starts it (``start_core``, which returns the channel)."""
    graph = import_graph()
    core_to_caller = {
        (m, e) for m, es in graph.items() if m.startswith(STEPS.CORE) for e in es if e.startswith(STEPS.CALLER)
    }
    caller_to_core = {
        e for m, es in graph.items() if m.startswith(STEPS.CALLER) for e in es if e.startswith(STEPS.CORE)
    }
    assert core_to_caller == set()
    assert caller_to_core == {CORE_ENTRY}
