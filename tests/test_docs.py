"""The README and docs/: every relative link reaches a file, and every ``#anchor`` a heading in it; the Python
blocks parse; what docs/install.md and docs/integrations.md show is what their code does."""

from __future__ import annotations

import ast
import re
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but ``-`` and ``_`` dropped, spaces as ``-``."""
    anchors, fenced = set(), False
    for line in page.read_text().splitlines():
        fenced ^= line.startswith("```")
        heading = None if fenced else re.match(r"#{1,6} (.*)", line)
        if heading:
            anchors.add(re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-"))
    return anchors


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code is not markdown
    text = re.sub(r"`[^`\n]*`", "", text)
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", t)]


def test_relative_links_resolve():
    broken, count = [], 0
    for page in PAGES:
        for target in _links(page):
            count += 1
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert count > 50 and not broken, broken


def _blocks(page: Path, language: str) -> list[str]:
    """The fenced blocks of ``page`` opened with ```` ```language ```` (``""``: no language)."""
    blocks: list[str] = []
    body: list[str] | None = None
    keep = False
    for line in page.read_text().splitlines():
        if body is None:
            if line.startswith("```"):
                body, keep = [], line == f"```{language}"
        elif line == "```":
            if keep:
                blocks.append("\n".join(body) + "\n")
            body = None
        else:
            body.append(line)
    return blocks


def test_python_blocks_parse():
    broken = []
    for page in PAGES:
        for block in _blocks(page, "python"):
            try:
                ast.parse(block)
            except SyntaxError as exc:
                broken.append(f"{page.relative_to(ROOT)}: {exc}")
    assert not broken, broken


def test_install_md_shows_what_the_demo_prints(capsys):
    """docs/install.md pastes the output of ``pic demo``: it is that output, the times aside."""
    import pic
    from pic.demo import run_demo

    with pic.PIC.from_pretrained(pic.EMBEDDED_MODEL) as engine:
        run_demo(engine, max_new_tokens=48)  # the command's default
    printed = capsys.readouterr().out.rstrip("\n")
    pasted = next(b for b in _blocks(ROOT / "docs" / "install.md", "") if b.startswith("model: ")).rstrip("\n")

    shown = set(re.findall(r"^\[\S+\]", pasted, flags=re.M))

    def comparable(text: str) -> str:
        """Times aside, this CPU's bfloat16 unit (the page's machine is not every reader's: AMX-BF16 on one,
        AVX512-BF16 on another), and policies other tests registered in this process (the doc shows the built-in
        ones)."""
        lines, keep = [], True
        text = re.sub(r"bfloat16 \((AMX|AVX512)-BF16\)", "bfloat16 (_)", text)
        for line in re.sub(r"TTFT +[\d.]+ ms", "TTFT _ ms", text).splitlines():
            label = re.match(r"\[\S+\]", line)
            keep = (label.group() in shown) if label else (keep or not line.startswith("        "))
            if keep:
                lines.append(line)
        return "\n".join(lines)

    assert comparable(pasted) == comparable(printed)


class _Recorder:
    """A stand-in for a framework class: keeps its keyword arguments, answers like the OpenAI endpoint."""

    calls: list[tuple[str, object]] = []

    def __init__(self, *args, **kwargs):
        self.kwargs = kwargs
        _Recorder.calls.append(("init", kwargs))

    @classmethod
    def from_messages(cls, messages):
        return cls(messages=messages)

    def __or__(self, llm):
        return _Chain(self, llm)

    def chat(self, messages, **kwargs):
        _Recorder.calls.append(("chat", [m.kwargs["content"] for m in messages]))
        reply = types.SimpleNamespace(content="answer")
        return types.SimpleNamespace(message=reply, raw=types.SimpleNamespace(usage={}))


class _Chain:
    def __init__(self, prompt: _Recorder, llm: _Recorder):
        self.prompt, self.llm = prompt, llm

    def invoke(self, variables):
        rendered = [text.format(**variables) for _, text in self.prompt.kwargs["messages"]]  # LangChain's f-strings
        _Recorder.calls.append(("chat", rendered))
        return types.SimpleNamespace(content="answer", response_metadata={"token_usage": {"reused_tokens": 1}})


def _run_with(block: str, modules: dict[str, str], monkeypatch) -> list[tuple[str, object]]:
    """Run a docs example with the framework's classes replaced by recorders; the calls they saw."""
    for module, names in modules.items():
        monkeypatch.setitem(sys.modules, module, types.SimpleNamespace(**{n: _Recorder for n in names.split()}))
    _Recorder.calls = []
    exec(compile(block, "<docs/integrations.md>", "exec"), {})
    return _Recorder.calls


@pytest.mark.parametrize(
    ("index", "modules", "pic_at"),
    [
        (0, {"langchain_core.prompts": "ChatPromptTemplate", "langchain_openai": "ChatOpenAI"}, ("extra_body",)),
        (
            1,
            {"llama_index.core.llms": "ChatMessage", "llama_index.llms.openai_like": "OpenAILike"},
            ("additional_kwargs", "extra_body"),
        ),
    ],
)
def test_integration_examples_send_pic_where_the_server_reads_it(index, modules, pic_at, monkeypatch, capsys):
    """docs/integrations.md: the LangChain and LlamaIndex examples put pic's field inside the request's
    ``extra_body`` and the literal ``{documents}`` marker in the user message. (Against a real ``pic serve``
    with langchain-openai 1.7.4 and llama-index-llms-openai-like 0.8.1 they printed what the page shows.)"""
    block = _blocks(ROOT / "docs" / "integrations.md", "python")[index]
    calls = _run_with(block, modules, monkeypatch)
    llm = next(kwargs for kind, kwargs in calls if kind == "init" and "model" in kwargs)
    body = llm
    for key in pic_at:
        body = body[key]
    assert set(body) == {"pic"} and set(body["pic"]) <= {"documents", "cache_ids", "policy", "relevance"}
    assert llm["model"] == "smollm2" and llm.get("base_url", llm.get("api_base")) == "http://127.0.0.1:8000/v1"
    user = [messages[-1] for kind, messages in calls if kind == "chat"]
    assert len(user) == 1 and "\n\n{documents}Question: Into which sea" in user[0]


def test_install_md_shows_what_the_torch_check_prints(tmp_path):
    """Issue 51, item 7: docs/install.md's torch check, run right after the first line (torch alone, no NumPy yet),
    printed a NumPy warning the page did not show. Here NumPy is made missing as it is then (a ``numpy`` that
    fails to import as a missing one does, first on the path) and the check's output is the page's, its paths
    aside."""
    import subprocess

    page = ROOT / "docs" / "install.md"
    command = next(line for line in _blocks(page, "bash")[0].splitlines() if line.startswith("python -c"))
    shown = next(b for b in _blocks(page, "") if "Failed to initialize NumPy" in b).splitlines()
    (tmp_path / "numpy").mkdir()
    (tmp_path / "numpy" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'numpy'\")\n")
    code = command.removeprefix("python -c ").strip('"')
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    printed = (run.stderr + run.stdout).splitlines()
    assert run.returncode == 0 and len(printed) == len(shown) == 3, printed
    warning = re.sub(r"^.*/site-packages/", ".../site-packages/", printed[0])
    assert warning.split(" (Triggered")[0] == shown[0].split(" (Triggered")[0], (warning, shown[0])
    assert printed[1] == shown[1]
    import torch

    assert printed[2] == f"{torch.__version__} False" and shown[2].endswith("+cpu False")
