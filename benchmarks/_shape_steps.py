"""The figures of ``engine_shape.py`` about a sequence's status, a step and the engine's layout (issue 49), read
from the sources (``trees``: every ``.py`` under ``pic/`` by its path).

- ``status_changes``: the assignments to a sequence's status (``<x>.status`` or ``<x>._status``, outside an
  ``__init__``) under ``pic/engine``; the methods of ``Sequence`` that change it (they assign it, or call
  ``self.m()`` for one that does); the call sites of those methods outside ``Sequence`` on a name in ``SEQ_NAMES``
  (``seq.park(h)``), and the functions and files they are in.
- ``result_landing``: the functions under ``pic/engine`` that take a step's results in: those calling
  ``self.<x>.m(...)`` for ``m`` in ``LANDING`` (a token sampled, a pass or a probe ended, a chunk prefill ended);
  and those calling the runner's forward (``self.runner.forward(...)``).
- ``failure_sites`` (issue 57): under ``pic/engine``, the calls that put a sequence on a way to failing: ``<x>.m(seq,
  ...)`` for ``m`` in ``FAIL_CALLS`` with a sequence (a name in ``SEQ_NAMES``, ``work``, or ``<x>.seq``) first, and the
  writes into a list named ``failed`` (``failed.append(...)``, ``failed += ...``, ``x.failed.append(...)``); the
  functions they are in; and the movers: the functions named in ``FAIL_CALLS`` that take a sequence (their
  definitions: each takes a failing sequence out of its queue).
- ``result_landing`` also counts (issue 57) the functions where the store's answers are taken in (those calling
  ``self.<x>.m(...)`` for ``m`` in ``ANSWERS``: a compile call's poll, a load landed) beside the forward's results,
  and of all those the entry points: the ones no other of them calls (``self.<name>(...)``); and, under
  ``pic/engine/core``, the functions that read a loader's answer (they call ``.done()`` or ``.result()`` on a
  future).
- ``command_dispatch``: the ``isinstance(x, C)`` tests under ``pic/engine`` where ``C`` is a class of the module
  that defines ``class Submit`` (the commands).
- ``import_cycles``: the import graph of ``pic/`` with every import (at any depth, under ``if TYPE_CHECKING``
  too; ``from a import b`` is an edge to ``a.b`` when that is a module), its strongly connected components of
  more than one module, and the edges between ``pic.engine.caller`` and ``pic.engine.core``.
- ``sizes``: the functions under ``pic/engine`` longer than ``MAX_FUNCTION_LINES`` lines (with their decorators
  and docstrings) and the files longer than ``MAX_FILE_LINES``.
"""

from __future__ import annotations

import ast

SEQ_NAMES = {"seq", "s", "waiter", "sequence"}
LANDING = {"sample", "probe_done", "pass_done", "chunk_done"}
FAIL_CALLS = {"drop", "guard", "fail"}
ANSWERS = {"poll", "loaded"}
MAX_FUNCTION_LINES, MAX_FILE_LINES = 50, 250
CALLER, CORE = "pic.engine.caller", "pic.engine.core"

Function = ast.FunctionDef | ast.AsyncFunctionDef


def _engine(trees: dict[str, ast.Module]) -> dict[str, ast.Module]:
    return {f: t for f, t in trees.items() if f.startswith("pic/engine/")}


def _functions(tree: ast.AST) -> list[Function]:
    return [n for n in ast.walk(tree) if isinstance(n, Function)]


def _calls(node: ast.AST) -> list[tuple[ast.expr, str, int]]:
    """``(receiver, method, line)`` of every ``receiver.method(...)`` call in ``node``."""
    calls = (n for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute))
    return [(n.func.value, n.func.attr, n.lineno) for n in calls]


def _is_self(node: ast.expr, attr: str | None = None) -> bool:
    """Whether ``node`` is ``self`` (``attr=None``) or ``self.<attr>`` (``attr="*"``: any)."""
    if attr is None:
        return isinstance(node, ast.Name) and node.id == "self"
    return isinstance(node, ast.Attribute) and _is_self(node.value) and attr in ("*", node.attr)


def _class(trees: dict[str, ast.Module], name: str) -> tuple[str, ast.ClassDef]:
    return next((f, n) for f, t in trees.items() for n in ast.walk(t) if isinstance(n, ast.ClassDef) and n.name == name)


def _assigns_status(fn: Function) -> list[int]:
    """The lines of ``fn`` that assign ``<x>.status`` or ``<x>._status`` (tuple targets unpacked)."""
    lines = []
    for n in ast.walk(fn):
        targets = list(n.targets) if isinstance(n, ast.Assign) else [getattr(n, "target", None)]
        while targets:
            t = targets.pop()
            if isinstance(t, ast.Tuple | ast.List):
                targets += t.elts
            elif isinstance(t, ast.Attribute) and t.attr in ("status", "_status"):
                lines.append(n.lineno)
    return lines


def status_changes(trees: dict[str, ast.Module]) -> dict:
    engine = _engine(trees)
    home, cls = _class(engine, "Sequence")
    assigns = [
        f"{file}:{line} {fn.name}"
        for file, tree in engine.items()
        for fn in _functions(tree)
        if fn.name != "__init__"
        for line in _assigns_status(fn)
    ]
    methods = {f.name: f for f in cls.body if isinstance(f, Function) and f.name != "__init__"}
    changing = {m for m, f in methods.items() if _assigns_status(f)}
    while more := {
        m
        for m, f in methods.items()
        if m not in changing and any(_is_self(r) and c in changing for r, c, _ in _calls(f))
    }:
        changing |= more
    sites = [
        (file, fn.name, f"{file}:{line} {fn.name}: {r.id}.{m}()")
        for file, tree in engine.items()
        for fn in _functions(tree)
        if not (file == home and fn in methods.values())
        for r, m, line in _calls(fn)
        if m in changing and isinstance(r, ast.Name) and r.id in SEQ_NAMES
    ]
    return {
        "sequence_defined_in": home,
        "num_assignment_sites": len(assigns),
        "assignment_sites": assigns,
        "status_methods": sorted(changing),
        "num_call_sites": len(sites),
        "num_calling_functions": len({(f, fn) for f, fn, _ in sites}),
        "num_calling_files": len({f for f, _, _ in sites}),
        "calling_functions": sorted({f"{f} {fn}" for f, fn, _ in sites}),
        "call_sites": sorted(s for _, _, s in sites),
    }


def result_landing(trees: dict[str, ast.Module]) -> dict:
    landing, forward, every = [], [], {}
    for file, tree in _engine(trees).items():
        for fn in _functions(tree):
            calls = _calls(fn)
            found = sorted({m for r, m, _ in calls if m in LANDING and _is_self(r, "*")})
            if found:
                landing.append(f"{file} {fn.name}: {', '.join(found)}")
            answers = sorted({m for r, m, _ in calls if m in ANSWERS and _is_self(r, "*")})
            if found or answers:
                every[(file, fn.name)] = (fn, found + answers)
            if any(m == "forward" and _is_self(r, "runner") for r, m, _ in calls):
                forward.append(f"{file} {fn.name}")
    called = {m for fn, _ in every.values() for r, m, _ in _calls(fn) if _is_self(r)}
    entries = sorted(f"{f} {name}" for (f, name) in every if name not in called)
    answers = sorted(
        f"{file} {fn.name}"
        for file, tree in _engine(trees).items()
        if file.startswith("pic/engine/core/")
        for fn in _functions(tree)
        if any(m in ("done", "result") and not _is_self(r) for r, m, _ in _calls(fn))
    )
    return {
        "num_landing_entries": len(entries),
        "landing_entries": entries,
        "landing_with_answers": sorted(f"{f} {n}: {', '.join(ms)}" for (f, n), (_, ms) in every.items()),
        "num_answer_functions": len(answers),
        "answer_functions": answers,
        "num_landing_functions": len(landing),
        "landing_functions": landing,
        "num_forward_functions": len(forward),
        "forward_functions": forward,
    }


def _is_seq(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id in SEQ_NAMES | {"work"}) or (
        isinstance(node, ast.Attribute) and node.attr == "seq"
    )


def _names_failed(node: ast.expr) -> bool:
    return getattr(node, "id", getattr(node, "attr", None)) == "failed"


def failure_sites(trees: dict[str, ast.Module]) -> dict:
    sites, movers = [], []
    for file, tree in _engine(trees).items():
        for fn in _functions(tree):
            params = {a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)}
            if fn.name in FAIL_CALLS and params & SEQ_NAMES:
                movers.append(f"{file}:{fn.lineno} {fn.name}")
            for n in ast.walk(fn):
                if n is not fn and isinstance(n, Function):
                    continue
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
                    m = n.func.attr
                    if m in FAIL_CALLS and n.args and _is_seq(n.args[0]):
                        sites.append((file, fn.name, f"{file}:{n.lineno} {fn.name}: .{m}()"))
                    elif m in ("append", "extend") and _names_failed(n.func.value):
                        sites.append((file, fn.name, f"{file}:{n.lineno} {fn.name}: failed.{m}()"))
                elif isinstance(n, ast.AugAssign) and _names_failed(n.target):
                    sites.append((file, fn.name, f"{file}:{n.lineno} {fn.name}: failed +="))
    return {
        "num_sites": len(sites),
        "num_functions": len({(f, fn) for f, fn, _ in sites}),
        "sites": sorted({s for _, _, s in sites}),
        "num_movers": len(movers),
        "movers": movers,
    }


def command_dispatch(trees: dict[str, ast.Module]) -> dict:
    engine = _engine(trees)
    home, _ = _class(engine, "Submit")
    commands = {n.name for n in engine[home].body if isinstance(n, ast.ClassDef)}
    sites = []
    for file, tree in engine.items():
        for fn in _functions(tree):
            for n in ast.walk(fn):
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "isinstance":
                    kinds = {x.id for x in ast.walk(n.args[1]) if isinstance(x, ast.Name)} & commands
                    if kinds:
                        sites.append((fn.name, f"{file}:{n.lineno} {fn.name}: {', '.join(sorted(kinds))}"))
    return {
        "commands_defined_in": home,
        "num_isinstance_sites": len(sites),
        "num_functions": len({fn for fn, _ in sites}),
        "sites": [s for _, s in sites],
    }


def import_graph(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Module -> the ``pic`` modules it imports, every import counted."""
    mods = {f.removesuffix(".py").removesuffix("/__init__").replace("/", "."): f for f in trees}
    graph = {}
    for mod, file in mods.items():
        package = mod if file.endswith("__init__.py") else mod.rpartition(".")[0]
        edges = set()
        for node in ast.walk(trees[file]):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                parts = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                base = ".".join([*parts, *([node.module] if node.module else [])])
                edges |= {f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names}
        graph[mod] = {e for e in edges if e in mods and e != mod}
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The components of more than one module (Tarjan's algorithm, recursive: the graph is a few hundred deep)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def import_cycles(trees: dict[str, ast.Module]) -> dict:
    graph = import_graph(trees)
    cycles = strongly_connected(graph)
    crossing = sorted(
        f"{m} -> {e}"
        for m, edges in graph.items()
        for e in edges
        if (m.startswith(CALLER) and e.startswith(CORE)) or (m.startswith(CORE) and e.startswith(CALLER))
    )
    return {"num_cycles": len(cycles), "cycles": cycles, "caller_core_edges": crossing}


def sizes(trees: dict[str, ast.Module], line_counts: dict[str, int]) -> dict:
    long = [
        f"{file}:{fn.lineno} {fn.name} ({n} lines)"
        for file, tree in _engine(trees).items()
        for fn in _functions(tree)
        if (n := fn.end_lineno - min([fn.lineno, *(d.lineno for d in fn.decorator_list)]) + 1) > MAX_FUNCTION_LINES
    ]
    files = {f: n for f, n in line_counts.items() if n > MAX_FILE_LINES}
    return {
        "num_functions_over": len(long),
        "functions_over": long,
        "num_files_over": len(files),
        "files_over": files,
        "max_file_lines": max(line_counts.values()),
    }
