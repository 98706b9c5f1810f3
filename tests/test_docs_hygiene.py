"""What a reader of the repository can check (issue 67, item 7): the README and docs/ cite no issue number (a reader
cannot open the project's issues, so "issue 49's run" or "since issue 54" tells them nothing: a page names what the
issue's work was, the benchmark, the doc section, the results file), and no docstring or comment in pic/ quotes a
measured figure (it points at the doc section that renders it). Other projects' numbers (``LMCache #2878``, ``vLLM
PR #17045``) are theirs to open and are not matched."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# "issue 49", "Issues 40 and 41", "issue\n56" (a page wraps its lines anywhere): whitespace between the two words.
ISSUE = re.compile(r"\bissues?\s+\d+", re.IGNORECASE)


def cited_issues(text: str, name: str) -> list[str]:
    """``name:line: words`` for every issue number ``text`` cites."""
    return [f"{name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group()!r}" for m in ISSUE.finditer(text)]


def test_no_page_cites_an_issue_number():
    found = [hit for page in PAGES for hit in cited_issues(page.read_text(), str(page.relative_to(ROOT)))]
    assert len(PAGES) > 10 and not found, "pages cite issue numbers a reader cannot open:\n" + "\n".join(found)


def test_the_check_finds_a_citation_and_names_its_line():
    page = "a line\nthe run of issue 56's work\nIssues 40\nand 41 and\nan issue\n49 wrapped\nLMCache #2878, PR #17045\n"
    assert cited_issues(page, "docs/x.md") == [
        "docs/x.md:2: 'issue 56'",
        "docs/x.md:3: 'Issues 40'",
        "docs/x.md:5: 'issue\\n49'",
    ]


# -- figures in pic's docstrings and comments --------------------------------------------------------------------

# A speedup (``1.4x``, ``3.4-3.7x``; not a shape such as ``576x1536``) or a decimal figure with its unit, as the pages
# write measurements (benchmarks/figures.py's ``FIGURE``: ``36.9 ms``, ``83.3%``, ``12.5 tokens/s``).
SPEEDUP = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:[-–]\d+(?:\.\d+)?)?x\b")
DECIMAL = re.compile(r"(?<![\w.%])[−+-]?\d[\d,]*\.\d+(?:x|%| %| s\b| ms\b| tokens/s| points?\b| KiB| MiB| GB/s)")
# Figures a docstring or comment may quote: not measurements of pic (file, figure) -> why.
NOT_MEASURED = {("pic/evaluation/musique.py", "3.6 MiB"): "the size of CacheBlend's data file, which bounds a read"}


def _commentary(path: Path) -> list[tuple[int, str]]:
    """The comments and docstrings (triple-quoted strings) of a Python file, with the line each starts on."""
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        is_doc = tok.type == tokenize.STRING and tok.string.lstrip("rbuRBU").startswith(('"""', "'''"))
        if tok.type == tokenize.COMMENT or is_doc:
            found.append((tok.start[0], tok.string))
    return found


def quoted_figures(path: Path) -> list[str]:
    """``file:line: figure`` for each measured figure a comment or docstring of ``path`` quotes."""
    name = str(path.relative_to(ROOT))
    out = []
    for line, text in _commentary(path):
        hits = {m.start(): m.group() for pattern in (DECIMAL, SPEEDUP) for m in pattern.finditer(text)}  # one a place
        for start, figure in sorted(hits.items()):
            if (name, figure) not in NOT_MEASURED:
                out.append(f"{name}:{line + text.count(chr(10), 0, start)}: {figure!r}")
    return out


def test_no_docstring_or_comment_in_pic_quotes_a_measured_figure():
    """Issue 67, item 7: pic/config.py said CUDA graphs made a naive 16K link "1.4x" faster where docs/gpu.md said 1.55x
    (1.39x was the 32K figure). A figure typed into a docstring is checked by nothing and drifts after the next run;
    a docstring points at the doc section that renders it instead (``docs/gpu.md#the-third-run-...``)."""
    found = [hit for path in sorted((ROOT / "pic").rglob("*.py")) for hit in quoted_figures(path)]
    why = "figures typed into pic's docstrings and comments (point at the doc section that renders them instead)"
    assert not found, why + ":\n" + "\n".join(found)


def test_the_figure_check_finds_a_speedup_and_a_time_but_not_a_shape(tmp_path, monkeypatch):
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    source = tmp_path / "m.py"
    source.write_text('"""Graphs made it 1.4x faster.\n\nA 576x1536 matrix."""\n\nX = 1  # 36.9 ms; 64 << 20 bytes\n')
    assert quoted_figures(source) == ["m.py:1: '1.4x'", "m.py:5: '36.9 ms'"]
