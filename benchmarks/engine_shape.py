"""The shape of pic's engine: how many files a request crosses, and how far its parts reach into each other.

python benchmarks/engine_shape.py --root PATH --out benchmarks/results/engine_shape.json

No timings: figures for a refactor to report before and after. Each JSON key holds counts and the lists they
come from (``--root``: the checkout measured, default this script's; nothing is hard-coded but the names below):

- ``default_request_files``: in a subprocess (cwd ``--root``, pic imported from there and checked),
  ``pic.PIC.from_pretrained()`` (embedded stories260K) compiles 3 short documents and runs
  ``engine.link(ids, "Who is there?").generate()`` (the defaults: policy, order, sampling) once untraced, a
  warm-up; then the same link and generate run traced in every thread: a ``sys.settrace`` +
  ``threading.settrace`` hook, installed before the engine starts its core thread, keeps the "call" events
  between a start and a stop flag (a dataclass's generated ``__init__``, file ``<string>``, counts in its
  module's file). The distinct files under ``pic/``, their lines (``wc -l``), how many are in ``pic/engine/``;
  the distinct functions entered (file, qualified name, first line) and the threads that ran them;
  ``crossed_before_core``: the files the calling thread entered, in first-entry order, before another thread
  ran a frame in the file defining ``EngineCore`` (approximate: the threads race), and how many of them are
  in ``pic/engine/``.
- ``engine_files``: the ``.py`` files under ``pic/engine/`` and their lines.
- ``sequence_fields_written_outside``: ``Sequence``'s attributes are the ``self.X`` its methods assign (the class
  is found by name under ``pic/engine``). A write outside, in any other ``.py`` under ``pic/``, is an assignment
  (plain, augmented, annotated; tuple targets unpacked, ``[...]`` stripped) or a ``del`` of ``<obj>.X``, or a
  call ``<obj>.X.m(...)`` for ``m`` in ``MUTATORS``. ``strict``: ``<obj>`` is a name in ``SEQ_NAMES``;
  ``loose``: any object but a bare ``self`` (so other classes' fields of the same name count too).
- ``scheduler_kv_calls``: in ``class Scheduler`` (and the classes in ``SCHEDULER_PARTS``, where they exist), the
  calls ``self.kv.m(...)`` (all; in ``_admit`` and ``_new_pass``, the admission of a waiting sequence) and the
  attributes of ``self.kv`` reached other than by a call (``self.kv.pool...``). In the ``--kv-class`` class,
  ``policy_branches``: the ``if``/``elif`` tests naming something with "policy" in it (a name or an attribute),
  and the code lines (docstrings and comments aside) naming one.
- ``import_layers``: the graph of pic-internal imports (absolute and relative, at any depth, not under ``if
  TYPE_CHECKING``). ``public_face_layers``: the modules on the longest path from ``pic/__init__`` to the module
  defining ``EngineCore``, through ``pic/__init__``, ``pic/api.py`` and ``pic/engine`` modules only;
  ``engine_levels``: the modules on the longest path inside ``pic.engine`` (its topological levels).
- ``link_signatures``: the functions under ``pic/`` named ``link`` with parameters ``cache_ids`` and ``query``;
  every function with both is listed beside them.
- ``engine_parts``: the files and lines of the engine's parts: ``pic/engine/caller``, ``pic/engine/core`` and the
  rest of ``pic/engine`` (the command channel and its messages); before issue 49 everything is "rest".
- ``status_changes``, ``result_landing``, ``command_dispatch``, ``import_cycles``, ``sizes``: issue 49's figures
  (where a sequence's status changes, where a step's results land, the commands dispatched by type, the import
  circles of ``pic/``, the functions and files over the size of the style guide), and issue 57's
  ``failure_sites`` (where a sequence is put on a way to failing, and the functions that move one) and the
  functions that take the loader's answers in (``result_landing``); see ``benchmarks/_shape_steps.py``.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _shape_steps  # noqa: E402

SEQ_NAMES = {"seq", "s", "waiter", "sequence"}
SCHEDULER_PARTS = {"Admission"}  # classes of the scheduler's own (issue 49: its admission of prefill work)
MUTATORS = {"append", "extend", "insert", "pop", "popitem", "remove", "update", "clear", "discard", "add", "setdefault"}
DOCS = ["Tom had a red ball.", "Lily liked to sing.", "The cat sat on the mat."]
QUERY = "Who is there?"


def parsed(root: Path, sub: str = "pic") -> dict[str, ast.Module]:
    """Every ``.py`` under ``root/sub``, by path relative to ``root``."""
    files = sorted((root / sub).rglob("*.py"))
    return {p.relative_to(root).as_posix(): ast.parse(p.read_text(), str(p)) for p in files}


def find_class(trees: dict[str, ast.Module], name: str, under: str = "pic/engine/") -> tuple[str, ast.ClassDef]:
    found = [(f, n) for f, t in trees.items() if f.startswith(under) for n in ast.walk(t)]
    found = [(f, n) for f, n in found if isinstance(n, ast.ClassDef) and n.name == name]
    if len(found) != 1:
        raise SystemExit(f"expected one class {name} under {under}, found {[f for f, _ in found]}")
    return found[0]


def trace_request(root: Path, core_file: str) -> dict:
    """Child process: run the default request once untraced (a warm-up), then again traced in every thread
    (``sys.settrace`` + ``threading.settrace``: each Python frame's "call"); the files and functions it enters
    under ``root/pic``."""
    sys.path.insert(0, str(root))
    events: list[tuple[int, str, str]] = []
    on = [False]

    def trace(frame, event, arg):
        if on[0] and event == "call":
            code = frame.f_code
            file = code.co_filename  # a dataclass's generated __init__: "<string>", its module's file
            file = file if file.endswith(".py") else frame.f_globals.get("__file__")
            events.append((threading.get_ident(), file, f"{code.co_qualname}:{code.co_firstlineno}"))
        return None  # (no line events)

    threading.settrace(trace)
    sys.settrace(trace)
    import pic

    if not Path(pic.__file__).resolve().is_relative_to(root / "pic"):
        raise SystemExit(f"pic imported from {pic.__file__}, not from {root}")
    engine = pic.PIC.from_pretrained()
    ids = engine.compile(DOCS)
    engine.link(ids, QUERY).generate()  # the warm-up: lazy imports and first-call work are not the request's
    on[0] = True
    engine.link(ids, QUERY).generate()
    on[0] = False
    sys.settrace(None)
    threading.settrace(None)
    engine.close()
    caller, pic_dir = threading.get_ident(), root / "pic"
    visits = [(t, Path(f).resolve(), fn) for t, f, fn in events if f and f.endswith(".py")]
    visits = [(t, p.relative_to(root).as_posix(), fn) for t, p, fn in visits if p.is_relative_to(pic_dir)]
    crossed: list[str] = []
    for thread, file, _ in visits:
        if thread != caller and file == core_file:
            break
        if thread == caller and file not in crossed:
            crossed.append(file)
    functions = sorted({f"{file} {fn}" for _, file, fn in visits})
    threads = len({t for t, _, _ in visits})
    return {
        "files": sorted({f for _, f, _ in visits}),
        "crossed_before_core": crossed,
        "functions": functions,
        "num_threads": threads,
    }


def default_request_files(root: Path, core_file: str) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--root", str(root), "--trace-child", core_file]
    out = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"traced request failed:\n{out.stderr}")
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    counts = line_counts(root, [root / f for f in seen["files"]])
    crossed = seen["crossed_before_core"]
    return (
        {
            "num_functions": len(seen["functions"]),
            "num_threads": seen["num_threads"],
            "num_engine_files": sum(f.startswith("pic/engine/") for f in counts["files"]),
            "num_crossed_before_core": len(crossed),
            "num_engine_crossed_before_core": sum(f.startswith("pic/engine/") for f in crossed),
            "crossed_before_core": crossed,
        }
        | counts
        | {"functions": seen["functions"]}
    )


def line_counts(root: Path, paths: list[Path]) -> dict:
    """``wc -l`` of each file, and their number and sum."""
    files = {p.relative_to(root).as_posix(): p.read_bytes().count(b"\n") for p in paths}
    return {"num_files": len(files), "total_lines": sum(files.values()), "files": files}


def targets_of(node: ast.AST, calls: bool = True) -> list[ast.expr]:
    """The expressions ``node`` writes to: assigned, deleted, or (``calls``) mutated by a call."""
    if isinstance(node, ast.Assign | ast.Delete):
        todo = list(node.targets)
    elif isinstance(node, ast.AugAssign | ast.AnnAssign):
        todo = [node.target]
    elif calls and isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
        todo = [node.func.value]
    else:
        return []
    out = []
    while todo:
        t = todo.pop()
        if isinstance(t, ast.Tuple | ast.List):
            todo.extend(t.elts)
        elif isinstance(t, ast.Starred | ast.Subscript):
            todo.append(t.value)
        else:
            out.append(t)
    return out


def is_name(node: ast.AST, names: set[str]) -> bool:
    return isinstance(node, ast.Name) and node.id in names


def sequence_fields_written_outside(trees: dict[str, ast.Module]) -> dict:
    home, cls = find_class(trees, "Sequence")
    assigned = [t for n in ast.walk(cls) for t in targets_of(n, calls=False)]
    fields = {t.attr for t in assigned if isinstance(t, ast.Attribute) and is_name(t.value, {"self"})}
    written: dict[str, dict[str, set[str]]] = {"strict": {}, "loose": {}}
    for file, tree in trees.items():
        for node in ast.walk(tree) if file != home else ():
            for t in targets_of(node):
                if isinstance(t, ast.Attribute) and t.attr in fields and not is_name(t.value, {"self"}):
                    written["loose"].setdefault(file, set()).add(t.attr)
                    if is_name(t.value, SEQ_NAMES):
                        written["strict"].setdefault(file, set()).add(t.attr)
    report = {"defined_in": home, "sequence_attributes": len(fields), "attributes": sorted(fields)}
    for kind, per_file in written.items():
        all_fields = set().union(*per_file.values())
        report[kind] = {
            "num_fields": len(all_fields),
            "num_files": len(per_file),
            "fields": sorted(all_fields),
            "per_file": {f: sorted(v) for f, v in sorted(per_file.items(), key=lambda kv: -len(kv[1]))},
        }
    return report


def policy_branches(cls: ast.ClassDef) -> dict:
    """The ``if``/``elif`` tests in ``cls`` that name a policy, and every code line that does."""

    def names_policy(node: ast.AST) -> bool:
        return any("policy" in getattr(n, "id", getattr(n, "attr", "")) for n in ast.walk(node))

    ifs = sorted(n.lineno for n in ast.walk(cls) if isinstance(n, ast.If) and names_policy(n.test))
    lines = sorted({n.lineno for n in ast.walk(cls) if isinstance(n, ast.Name | ast.Attribute) and names_policy(n)})
    return {"ifs": len(ifs), "if_lines": ifs, "code_lines_naming_policy": len(lines), "lines": lines}


def scheduler_kv_calls(trees: dict[str, ast.Module], kv_class: str) -> dict:
    file, cls = find_class(trees, "Scheduler")
    classes = [cls] + [
        n for t in trees.values() for n in ast.walk(t) if isinstance(n, ast.ClassDef) and n.name in SCHEDULER_PARTS
    ]

    def is_kv(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "kv" and is_name(node.value, {"self"})

    calls, reach = [], []
    for f in (f for c in classes for f in c.body if isinstance(f, ast.FunctionDef)):
        funcs = {id(n.func) for n in ast.walk(f) if isinstance(n, ast.Call)}
        for n in ast.walk(f):
            if isinstance(n, ast.Attribute) and is_kv(n.value):
                (calls if id(n) in funcs else reach).append((f.name, n.attr, n.lineno))
    kv_file, kv_cls = find_class(trees, kv_class, under="pic/")
    return {
        "defined_in": file,
        "num_methods": len({m for _, m, _ in calls}),
        "methods": sorted({m for _, m, _ in calls}),
        "num_call_sites": len(calls),
        "calls_in_admit": sum(f in ("_admit", "_new_pass") for f, _, _ in calls),
        "reach_through": sorted({a for _, a, _ in reach}),
        "reach_through_sites": [f"{f}:{line} self.kv.{a}" for f, a, line in reach],
        "call_sites": [f"{f}:{line} self.kv.{m}()" for f, m, line in calls],
        "kv_class": {"name": kv_class, "defined_in": kv_file, "policy_branches": policy_branches(kv_cls)},
    }


def import_graph(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Module -> the pic modules it imports (not under ``if TYPE_CHECKING:``)."""
    names = {f.removesuffix(".py").removesuffix("/__init__").replace("/", "."): f for f in trees}
    graph: dict[str, set[str]] = {}
    for mod, file in names.items():
        package = mod if file.endswith("__init__.py") else mod.rpartition(".")[0]
        todo, deps = list(trees[file].body), set()
        while todo:
            node = todo.pop()
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = package.rsplit(".", node.level - 1)[0] if node.level else ""
                base = ".".join(p for p in (base, node.module) if p)
                deps |= {f"{base}.{a.name}" if f"{base}.{a.name}" in names else base for a in node.names}
            else:
                todo.extend(ast.iter_child_nodes(node))
        graph[mod] = {d for d in deps if d in names and d != mod}
    return graph


def longest_path(graph: dict[str, set[str]], start: str, end: str | None = None) -> list[str]:
    """The longest import chain from ``start`` (to ``end`` if given); a cycle's closing edge is skipped."""
    best: dict[str, list[str] | None] = {}

    def visit(mod: str, stack: set[str]) -> list[str] | None:
        if mod not in best:
            tails = [visit(d, stack | {mod}) for d in sorted(graph.get(mod, ())) if d not in stack]
            tails = [t for t in tails if t is not None]
            if tails or end is None or mod == end:
                best[mod] = [mod, *max(tails, key=len, default=[])] if mod != end else [mod]
            else:
                best[mod] = None
        return best[mod]

    return visit(start, set()) or []


def import_layers(trees: dict[str, ast.Module]) -> dict:
    graph = import_graph(trees)
    core = find_class(trees, "EngineCore")[0].removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    engine = {m for m in graph if m == "pic.engine" or m.startswith("pic.engine.")}
    top = {m for m in ("pic", "pic.api") if m in graph}  # (pic.api: the separate facade before issue 43)
    face = {m: graph[m] & (engine | top) for m in engine | top}
    longest = longest_path(face, "pic", core)
    levels = max((longest_path({m: graph[m] & engine for m in engine}, m) for m in engine), key=len)
    return {
        "engine_core_module": core,
        "public_face_layers": len(longest),
        "public_face_longest": longest,
        "engine_levels": len(levels),
        "engine_longest_chain": levels,
        "graph": {m: sorted(ds) for m, ds in sorted(face.items())},
    }


def link_signatures(trees: dict[str, ast.Module]) -> dict:
    both = []
    for file, tree in trees.items():
        for f in ast.walk(tree):
            if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef):
                params = {a.arg for a in (*f.args.posonlyargs, *f.args.args, *f.args.kwonlyargs)}
                if {"cache_ids", "query"} <= params:
                    both.append((file, f.name, f.lineno))
    links = [f"{file}:{line} {name}" for file, name, line in both if name == "link"]
    return {"num_link": len(links), "link": links, "all_with_cache_ids_and_query": [f"{f}:{n} {m}" for f, m, n in both]}


def shape_steps(root: Path, trees: dict[str, ast.Module], engine_lines: dict[str, int]) -> dict:
    """Issue 49's figures (``_shape_steps``), and the engine's files and lines by part."""
    parts: dict[str, dict[str, int]] = {"caller": {}, "core": {}, "rest": {}}
    for file, lines in engine_lines.items():
        part = file.split("/")[2] if file.count("/") > 2 else "rest"
        parts[part if part in parts else "rest"][file] = lines
    return {
        "engine_parts": {k: {"num_files": len(v), "total_lines": sum(v.values())} for k, v in parts.items()},
        "status_changes": _shape_steps.status_changes(trees),
        "result_landing": _shape_steps.result_landing(trees),
        "failure_sites": _shape_steps.failure_sites(trees),
        "command_dispatch": _shape_steps.command_dispatch(trees),
        "import_cycles": _shape_steps.import_cycles(trees),
        "sizes": _shape_steps.sizes(trees, engine_lines),
    }


def main() -> None:
    here = Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=here, help="a checkout of pic (default: this script's)")
    parser.add_argument("--out", type=Path, help="write the figures here (JSON)")
    parser.add_argument("--kv-class", default="KVManager", help="the class the scheduler's self.kv is")
    parser.add_argument("--commit", help="the commit ``--root`` holds, when it is not a git checkout (git archive)")
    parser.add_argument("--trace-child", metavar="CORE_FILE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    root = args.root.resolve()
    if args.trace_child:
        print(json.dumps(trace_request(root, args.trace_child)))
        return
    trees = parsed(root)
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    result = {
        "root": str(root),
        "commit": args.commit or commit.strip(),
        "python": sys.version.split()[0],
        "default_request_files": default_request_files(root, find_class(trees, "EngineCore")[0]),
        "engine_files": line_counts(root, sorted((root / "pic/engine").rglob("*.py"))),
        "sequence_fields_written_outside": sequence_fields_written_outside(trees),
        "scheduler_kv_calls": scheduler_kv_calls(trees, args.kv_class),
        "import_layers": import_layers(trees),
        "link_signatures": link_signatures(trees),
    }
    result |= shape_steps(root, trees, result["engine_files"]["files"])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)


def print_table(r: dict) -> None:
    d, e, s = r["default_request_files"], r["engine_files"], r["sequence_fields_written_outside"]
    k, i = r["scheduler_kv_calls"], r["import_layers"]
    ifs, crossed_engine = k["kv_class"]["policy_branches"], d["num_engine_crossed_before_core"]
    rows = [
        ("default request: files (lines)", f"{d['num_files']} ({d['total_lines']})"),
        ("  functions; threads", f"{d['num_functions']}; {d['num_threads']}"),
        ("  in pic/engine, of all engine files", f"{d['num_engine_files']} of {e['num_files']}"),
        ("  crossed before EngineCore (in pic/engine)", f"{d['num_crossed_before_core']} ({crossed_engine})"),
        ("engine files (lines)", f"{e['num_files']} ({e['total_lines']})"),
        ("Sequence attributes", s["sequence_attributes"]),
        ("  written outside: fields, files", f"{s['strict']['num_fields']}, {s['strict']['num_files']}"),
        ("  (loose: any object)", f"{s['loose']['num_fields']}, {s['loose']['num_files']}"),
        ("Scheduler -> kv: methods, sites", f"{k['num_methods']}, {k['num_call_sites']}"),
        ("  calls in _admit; reached through", f"{k['calls_in_admit']}; {', '.join(k['reach_through']) or '-'}"),
        (f"{k['kv_class']['name']}: ifs on policy, lines naming", f"{ifs['ifs']}, {ifs['code_lines_naming_policy']}"),
        ("public face layers", i["public_face_layers"]),
        ("pic.engine import levels", i["engine_levels"]),
        ("link(cache_ids, query) definitions", r["link_signatures"]["num_link"]),
    ]
    entries = ", ".join(e.split()[-1] for e in r["result_landing"]["landing_entries"])
    keys = ("status_changes", "result_landing", "command_dispatch", "import_cycles", "sizes", "failure_sites")
    st, la, co, cy, sz, fa = (r[k] for k in keys)
    parts = ", ".join(f"{k} {v['num_files']} ({v['total_lines']})" for k, v in r["engine_parts"].items())
    rows += [
        ("engine parts: files (lines)", parts),
        ("status assignments; transition call sites", f"{st['num_assignment_sites']}; {st['num_call_sites']}"),
        ("  in functions, files", f"{st['num_calling_functions']}, {st['num_calling_files']}"),
        (
            "functions where results land; calling forward",
            f"{la['num_landing_functions']}; {la['num_forward_functions']}",
        ),
        ("  entry points of results and store answers", f"{la['num_landing_entries']}: {entries}"),
        ("  functions reading loader futures", la["num_answer_functions"]),
        ("failure sites; in functions", f"{fa['num_sites']}; {fa['num_functions']}"),
        ("  functions moving a failing sequence", fa["num_movers"]),
        ("isinstance on commands: sites, functions", f"{co['num_isinstance_sites']}, {co['num_functions']}"),
        ("import cycles in pic/", cy["num_cycles"]),
        ("engine functions > 50 lines; files > 250", f"{sz['num_functions_over']}; {sz['num_files_over']}"),
    ]
    print(f"engine shape of {r['root']} @ {r['commit'][:10]}")
    for name, value in rows:
        print(f"{name:<44}  {value}")


if __name__ == "__main__":
    main()
