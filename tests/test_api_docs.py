"""docs/api.md covers the whole public API (issue 58, item 3): every name of ``pic.__all__``, every public method
and attribute of the engine (``PIC``) and of ``Linked``, every ``PicError`` subclass in its errors table, and every
field of the result objects. A name counts as covered when a code span of the page holds it as a word
(``Linked.input_ids``, `` `input_ids` ``, ``engine.store.describe(id)``); an alias (``engine = stepper``) is
covered by its twin. A new public name without a line in api.md fails here, naming it."""

from __future__ import annotations

import dataclasses
import enum
import inspect
import re
from pathlib import Path

import pic
from pic.errors import PicError
from tests.test_names import _assigned, defined

PAGE = Path(__file__).resolve().parent.parent / "docs" / "api.md"
# The objects a call returns, whose every field a user reads (by name, found wherever pic defines them).
RESULTS = (
    "Generation", "GenerationStats", "CompileReport", "KVStats", "ChunkOrder", "CheckResult", "RequestOutput",
    "Probe", "DtypeChoice", "ChunkDescription",
)  # fmt: skip


def _covered(text: str) -> set[str]:
    """The words inside the page's code spans."""
    return {word for span in re.findall(r"`([^`\n]+)`", text) for word in re.findall(r"[A-Za-z_]\w*", span)}


def _public_members(cls: type) -> set[str]:
    """Public methods, properties and class attributes of ``cls``, and the instance attributes it assigns; an alias
    (a name bound to the same function as another) is left out."""
    found, seen = set(), {}
    for name in sorted(dir(cls)):
        if name.startswith("_"):
            continue
        value = inspect.getattr_static(cls, name)
        twin = seen.setdefault(id(value), name) if callable(value) else name
        if twin == name:
            found.add(name)
    return found | {name for name in _assigned(cls) if not name.startswith("_")}


def _fields(cls: type) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    if issubclass(cls, enum.Enum):
        return set(cls.__members__)
    return set(getattr(cls, "model_fields", {})) or {n for n in vars(cls) if not n.startswith("_")}


def missing() -> dict[str, list[str]]:
    text = PAGE.read_text()
    words, errors = _covered(text), _covered(text[text.index("## Errors") :])
    subclasses = {c.__name__ for c in vars(pic.errors).values() if inspect.isclass(c) and issubclass(c, PicError)}
    found = {
        "pic.__all__": sorted(set(pic.__all__) - words),
        "PIC": sorted(_public_members(pic.PIC) - words),
        "Linked": sorted(_public_members(pic.Linked) - words),
        "the errors table": sorted(subclasses - errors),
        "pic.FinishReason": sorted(_fields(pic.FinishReason) - words),
    }
    for name in RESULTS:
        classes = defined().get(name)
        found[name] = sorted(_fields(classes[0]) - words) if classes else ["(no such class in pic)"]
    return {where: names for where, names in found.items() if names}


def test_api_md_covers_every_public_name():
    assert not missing(), f"docs/api.md lacks {missing()}"


def test_the_check_sees_a_name_the_page_lacks():
    """A public field added to a result object without a word in api.md is found; one the page names is not."""

    @dataclasses.dataclass
    class Grown:
        token_ids: list[int]
        num_frobnicated: int

    assert _fields(Grown) - _covered(PAGE.read_text()) == {"num_frobnicated"}
