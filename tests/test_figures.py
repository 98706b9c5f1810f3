"""The docs' headline figures have one source, the results files under benchmarks/results/ (issue 51, item 7):
every marked block of README.md and docs/*.md is what ``benchmarks/figures.py`` renders from them now."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _figures():
    spec = importlib.util.spec_from_file_location("figures", ROOT / "benchmarks" / "figures.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["figures"] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


figures = _figures()


def test_every_marked_block_is_what_its_results_files_say():
    """A number in a block that differs from its results file fails here, with the diff; one no results file
    holds has no renderer (a KeyError naming the block). ``python benchmarks/figures.py --write`` fixes the
    first after a re-measure."""
    found = [block for page in figures.pages() for block in figures.blocks(page)]
    assert len(found) >= 6 and {b.page.name for b in found} >= {"README.md", "cpu.md", "chat.md"}, found
    assert not [problem for page in figures.pages() for problem in figures.misplaced(page)]
    assert not [diff for page in figures.pages() for diff in figures.stale(page)]


def test_a_drifted_number_fails_and_write_puts_the_results_back(tmp_path):
    """The check can fail: README's decode figure changed by hand is found, and re-rendering restores it (as the
    page wrapped it); a block whose name has no renderer is refused, naming it."""
    readme = (ROOT / "README.md").read_text()
    marked = re.search(r"<!-- figures: decode_at_a_glance -->(.*?)<!-- /figures -->", readme, re.S)
    assert marked and "12.5 tokens/s" in marked[1]
    page = tmp_path / "README.md"
    page.write_text(readme.replace(marked[0], marked[0].replace("12.5 tokens/s", "12.6 tokens/s")))
    figures_root, figures.ROOT = figures.ROOT, tmp_path
    try:
        [diff] = figures.stale(page)
        assert diff.startswith("README.md:") and "12.6 tokens/s" in diff and "12.5 tokens/s" in diff, diff
        written = figures.render_page(page.read_text())
        assert written.split() == readme.split()  # the results' words back
        page.write_text(written)
        assert not figures.stale(page) and max(map(len, written.splitlines())) == max(map(len, readme.splitlines()))
        page.write_text("a <!-- figures: no_such_figure -->1.0x<!-- /figures --> b\n")
        with pytest.raises(KeyError, match="no_such_figure"):
            figures.stale(page)
        page.write_text("a paragraph\n<!-- figures: decode_table -->x<!-- /figures --> goes on\n")
        assert figures.misplaced(page)  # a marker at a line's start would end the paragraph
    finally:
        figures.ROOT = figures_root


def test_each_figure_reads_results_files_only(monkeypatch):
    """Every renderer reads at least one file of benchmarks/results/ and nothing else: its figures' one source."""
    read: list[str] = []
    real = figures.results.__wrapped__

    def recorded(name: str) -> dict:
        read.append(name)
        return real(name)

    monkeypatch.setattr(figures, "results", recorded)
    for name in figures.FIGURES:
        read.clear()
        assert figures.rendered(name), name
        assert read and all((figures.RESULTS / f).is_file() for f in read), (name, read)


def test_the_cli_help_quotes_no_speed_that_no_results_file_holds(capsys):
    """``pic serve --help`` said int8 decode was "~1.6x" faster where the results say 1.84x (and README 2.19x
    against transformers): the help now points at the measurements instead of quoting one."""
    from pic.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--decode-weights" in help_text and not re.search(r"\d(\.\d+)?x\b", help_text), help_text


def test_no_figure_is_copied_by_hand_into_any_page():
    """Issue 58, item 2: every page's figures (a decimal with its unit: ``7.36 s``, ``3.36x``, ``83.3%``) are in
    marked blocks, rendered from their results files, except those benchmarks/figures_by_hand.json lists (still to
    be rendered, or not a measurement). docs/vllm.md's opening quoted a run's 7.36 s and 3.36x by hand after the
    default changed and the results said 8.02 s and 2.69x; a figure copied so now fails here, on any page."""
    assert not figures.new_by_hand()


def test_the_by_hand_check_finds_a_copied_figure(tmp_path, monkeypatch):
    """A figure added by hand is found; the same inside a marked block, in code, or listed, is not."""
    monkeypatch.setattr(figures, "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    page = tmp_path / "README.md"
    monkeypatch.setattr(figures, "pages", lambda: [page])
    monkeypatch.setattr(figures, "BY_HAND", tmp_path / "by_hand.json")
    figures.BY_HAND.write_text('{"README.md": ["30 s"]}'.replace("30 s", "30.0 s"))
    page.write_text("vLLM 7.36 s (3.36x sooner); a timeout of 30.0 s; `sleep 2.5 s`\n\n```\n1.5x\n```\n")
    assert [line.split(" is ")[0] for line in figures.new_by_hand()] == ["README.md: 7.36 s", "README.md: 3.36x"]
    page.write_text("vLLM <!-- figures: decode_table -->7.36 s (3.36x sooner)<!-- /figures -->; a timeout of 30.0 s\n")
    assert figures.new_by_hand() == []
    page.write_text("no figure\n")
    assert figures.new_by_hand() == ["README.md: 30.0 s is listed as by hand but the page no longer has it"]
