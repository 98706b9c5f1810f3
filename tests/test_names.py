"""Names that cannot drift from the code (issue 58, item 1): every dotted name that pic's docstrings and the docs
cite (``Class.member``, ``pic.module.name``, ``engine.method()``), every ``file.py:LINE`` and every
``file.py::test`` resolves against the code as it is now.

A docstring that cites ``KVManager.after_probe`` after the method moved to the policies, or a page that shows
``engine.store.describe()`` after a rename, fails here, naming the file and the line. What a name is checked
against:

- its first part is ``pic``: the package, its submodules and their attributes, or the field of a request body's
  ``"pic"`` object (``pic.relevance``: ``PicOptions``);
- a class or function that pic defines (``Linked``, ``Probe``, ``KVManager``): any of that name (a name defined
  twice resolves when one of them has the rest);
- a variable the docs use for one of pic's objects (``engine`` for a ``PIC``, ``linked`` for a ``Linked``, ...:
  ``VARIABLES``); ``self`` in a docstring, the class it is in;
- anything else (``torch.float32``, vLLM's ``LLM.generate``, a results file ``cpu_rag.json``) is not pic's to
  check, and is skipped.

An attribute of a class is found as an attribute, a dataclass or pydantic field, an annotation, an enum member or
an instance attribute its methods assign (``self.x = ...``); past an attribute whose type the code does not say,
the rest of the name is not checked.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
import pkgutil
import re
import textwrap
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest

import pic
from pic.serve.schemas import PicOptions

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# The docs' variables for pic's objects (README and docs/*.md write ``engine.compile``, ``linked.generate``).
VARIABLES = {
    "engine": "PIC",
    "linked": "Linked",
    "out": "Generation",
    "generation": "Generation",
    "chunk": "ChunkKV",
}
# Names that look like pic's but are another project's: (the page or file, the name) -> why.
NOT_PICS = {
    ("pic/vllm/client.py", "RequestOutput.kv_transfer_params"): "vLLM's RequestOutput, not pic.RequestOutput",
}
# A span that ends so is a file's name (``config.json``, ``model.safetensors``), not an attribute.
FILE_SUFFIXES = (".json", ".py", ".md", ".toml", ".txt", ".png", ".gguf", ".safetensors", ".yaml", ".yml", ".sh",
                 ".log", ".bin", ".cfg", ".jsonl", ".csv", ".ini", ".model")  # fmt: skip
DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")


@dataclasses.dataclass(frozen=True)
class Cited:
    """One dotted name cited at ``where`` (``pic/link/recompute.py:63``), inside class ``owner`` if any."""

    name: str
    where: str
    owner: str | None = None


# -- what is cited ---------------------------------------------------------------------------------------------


def _spans(text: str, double: bool) -> Iterator[tuple[int, str]]:
    """The code spans of ``text`` (``\\`x\\``` in Markdown, ````x```` and ``:role:\\`x\\``` in a docstring),
    with their offset."""
    patterns = [r"``([^`\n]+?)``", r":\w+:`~?([^`\n]+?)`"] if double else [r"(?<!`)`([^`\n]+?)`(?!`)"]
    for pattern in patterns:
        for m in re.finditer(pattern, text):
            yield m.start(), m.group(1)


def _names_in(span: str) -> list[str]:
    """The dotted names a code span cites: the span itself when it is one (a call's arguments dropped:
    ``pic.load(device="cuda")`` -> ``pic.load``), else none (an expression is an example, not a citation)."""
    head = re.match(r"\s*([A-Za-z_][\w.]*)\s*(\(.*\))?\s*$", span, flags=re.S)
    if head is None or "." not in head.group(1) or head.group(1).endswith(FILE_SUFFIXES):
        return []
    name = head.group(1).strip(".")
    return [name] if DOTTED.fullmatch(name) else []


def _outside_fences(text: str) -> str:
    """``text`` with fenced code blocks blanked (line numbers kept): examples are run or parsed elsewhere."""
    out, fenced = [], False
    for line in text.split("\n"):
        opens = line.lstrip().startswith("```")
        out.append("" if fenced or opens else line)
        fenced ^= opens
    return "\n".join(out)


def cited_in_pages() -> list[Cited]:
    found = []
    for page in PAGES:
        text = _outside_fences(page.read_text())
        rel = page.relative_to(ROOT)
        for offset, span in _spans(text, double=False):
            line = text.count("\n", 0, offset) + 1
            found += [Cited(name, f"{rel}:{line}") for name in _names_in(span)]
    return found


def _docstrings(tree: ast.Module) -> Iterator[tuple[ast.AST, str | None]]:
    """Every docstring of a module (its own, its classes', its functions'), with the class it is in."""

    def walk(node: ast.AST, owner: str | None) -> Iterator[tuple[ast.AST, str | None]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = child.name if isinstance(child, ast.ClassDef) else owner
                if ast.get_docstring(child, clean=False):
                    yield child.body[0], inner
                yield from walk(child, inner)

    if ast.get_docstring(tree, clean=False):
        yield tree.body[0], None
    yield from walk(tree, None)


def source_files() -> list[Path]:
    return sorted((ROOT / "pic").rglob("*.py"))


def cited_in_docstrings() -> list[Cited]:
    found = []
    for path in source_files():
        tree = ast.parse(path.read_text())
        rel = path.relative_to(ROOT)
        for node, owner in _docstrings(tree):
            text = node.value.value
            for offset, span in _spans(text, double=True):
                line = node.lineno + text.count("\n", 0, offset)
                found += [Cited(name, f"{rel}:{line}", owner) for name in _names_in(span)]
    return found


# -- what the code has -----------------------------------------------------------------------------------------


@functools.cache
def modules() -> dict[str, object]:
    """Every importable module of pic (one needing an extra that is not installed, such as vLLM, left out)."""
    found = {"pic": pic}
    for info in pkgutil.walk_packages(pic.__path__, "pic."):
        if info.name.endswith("__main__"):
            continue
        try:
            found[info.name] = importlib.import_module(info.name)
        except ImportError as exc:  # an optional dependency
            if (exc.name or "").startswith("pic"):
                raise
    return found


@functools.cache
def defined() -> dict[str, list[object]]:
    """pic's classes and functions by name (every module's own, at its top level and nested in its classes)."""
    found: dict[str, list[object]] = {}

    def add(obj: object) -> None:
        name = getattr(obj, "__name__", None)
        if name and all(obj is not o for o in found.get(name, [])):
            found.setdefault(name, []).append(obj)

    for name, module in modules().items():
        for value in vars(module).values():
            if (inspect.isclass(value) or inspect.isfunction(value)) and getattr(value, "__module__", "") == name:
                add(value)
                if inspect.isclass(value):
                    for inner in vars(value).values():
                        if inspect.isclass(inner):
                            add(inner)
    return found


@functools.cache
def _assigned(cls: type) -> frozenset[str]:
    """The instance attributes ``cls`` and its bases assign in their methods (``self.name = ...``,
    ``self.a, self.b = ...``)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is object or not (klass.__module__ or "").startswith("pic"):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id == "self":
                    names.add(node.attr)
    return frozenset(names)


def _annotation(cls: type, attr: str) -> object:
    """The class ``cls`` annotates ``attr`` with, when it says one (else ``None``)."""
    for klass in cls.__mro__:
        try:
            hints = typing.get_type_hints(klass, vars(importlib.import_module(klass.__module__)))
        except Exception:  # a forward reference it cannot evaluate here
            hints = getattr(klass, "__annotations__", {})
        hint = hints.get(attr)
        if hint is not None:
            return hint if inspect.isclass(hint) else None
    return None


_UNKNOWN = object()  # an attribute that exists, of a type the code does not say


def _member(obj: object, attr: str) -> object | None:
    """``obj.attr`` as far as the code says: the attribute, ``_UNKNOWN`` when it exists with no known type, or
    ``None`` when ``obj`` has no such attribute."""
    if obj is _UNKNOWN:
        return _UNKNOWN
    if inspect.ismodule(obj):
        if hasattr(obj, attr):
            return getattr(obj, attr)
        try:
            return importlib.import_module(f"{obj.__name__}.{attr}")
        except ModuleNotFoundError as exc:
            return None if exc.name == f"{obj.__name__}.{attr}" else _UNKNOWN  # an optional dependency missing
    if inspect.isclass(obj):
        fields = {**getattr(obj, "__dataclass_fields__", {}), **getattr(obj, "model_fields", {})}
        if attr in fields or attr in _assigned(obj) or any(attr in vars(k).get("__annotations__", {})
                                                          for k in obj.__mro__):  # fmt: skip
            return _annotation(obj, attr) or _UNKNOWN
        if hasattr(obj, attr):
            value = inspect.getattr_static(obj, attr)
            if isinstance(value, property):
                hint = typing.get_type_hints(value.fget).get("return") if value.fget else None
                return hint if inspect.isclass(hint) else _UNKNOWN
            return getattr(obj, attr)
        return None
    return getattr(obj, attr) if hasattr(obj, attr) else _UNKNOWN if callable(obj) else None


def _resolves(start: object, rest: list[str]) -> bool:
    obj = start
    for attr in rest:
        obj = _member(obj, attr)
        if obj is None:
            return False
    return True


def unresolved(cited: Cited) -> bool:
    """Whether ``cited`` names something pic lacks (``False`` also for a name that is not pic's)."""
    first, *rest = cited.name.split(".")
    if first == "self" and cited.owner:
        first = cited.owner
    first = VARIABLES.get(first, first)
    if first == "pic":
        if rest and rest[0] in PicOptions.model_fields:  # the HTTP body's "pic" field: ``pic.relevance``
            return len(rest) > 1
        starts: list[object] = [pic]
    else:
        starts = defined().get(first, [])
    if not starts:
        return False
    if (cited.where.split(":")[0], cited.name) in NOT_PICS:
        return False
    return not any(_resolves(start, rest) for start in starts)


def test_every_dotted_name_in_pics_docstrings_resolves():
    cited = cited_in_docstrings()
    bad = sorted({f"{c.where}: {c.name}" for c in cited if unresolved(c)})
    assert len(cited) > 300 and not bad, bad


def test_every_dotted_name_in_the_docs_resolves():
    cited = cited_in_pages()
    bad = sorted({f"{c.where}: {c.name}" for c in cited if unresolved(c)})
    assert len(cited) > 100 and not bad, bad


FILE_LINE = re.compile(r"(?<![\w/.-])((?:[\w-][\w.-]*/)*[\w.-]+\.py)(?::(\d+)(?:-(\d+))?|::(\w+))")


def _file_citations() -> Iterator[tuple[str, str, str | None, str | None, str | None]]:
    """``(where, path, line, last line, test)`` for each ``file.py:LINE``, ``file.py:A-B`` and ``file.py::name``
    in the pages and in pic's sources."""
    for path in [*PAGES, *source_files()]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for m in FILE_LINE.finditer(line):
                yield f"{path.relative_to(ROOT)}:{number}", m.group(1), m.group(2), m.group(3), m.group(4)


def _find(path: str, near: Path) -> Path | None:
    """The file ``path`` names: relative to the root, the citing file's folder or pic/."""
    for base in (ROOT, near.parent, ROOT / "pic"):
        if (base / path).is_file():
            return base / path
    return None


def test_every_file_line_and_test_cited_exists():
    """``pic/link/auto.py:82-84`` and ``tests/test_policies.py::test_x``: the file has those lines, the test exists."""
    bad, count = [], 0
    for where, path, line, last, test in _file_citations():
        found = _find(path, ROOT / where.split(":")[0])
        if found is None:
            if "/" in path:  # a bare ``x.py`` may be anyone's; a path is this repository's
                bad.append(f"{where}: {path} (no such file)")
            continue
        count += 1
        lines = found.read_text().splitlines()
        if line and int(last or line) > len(lines):
            bad.append(f"{where}: {path}:{line} (the file has {len(lines)} lines)")
        if test and not re.search(rf"^\s*(async )?(def|class) {test}\b", "\n".join(lines), flags=re.M):
            bad.append(f"{where}: {path}::{test} (no such test)")
    assert count >= 1 and not bad, bad


@pytest.mark.parametrize(
    ("name", "owner", "resolves"),
    [
        ("KVManager.after_probe", None, False),  # issue 58: recompute.py cited it after it moved to the policies
        ("Policy.after_probe", None, True),
        ("pic.policies.Suffix", None, True),
        ("pic.policies.Sufix", None, False),
        ("engine.store", None, True),
        ("engine.compile_reprot", None, False),
        ("Linked.input_ids", None, True),
        ("Probe.mass", None, True),
        ("Order.RELEVANCE", None, True),
        ("Order.LAST", None, False),
        ("torch.float32", None, True),  # not pic's: skipped
        ("self.policy", "LinkState", True),
    ],
)
def test_the_check_finds_what_is_missing(name, owner, resolves):
    """The check itself: a name pic lacks is found, one it has is not, one not pic's is left alone."""
    assert unresolved(Cited(name, "here", owner)) is not resolves
