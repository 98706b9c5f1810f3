"""The README and docs/: every relative link reaches a file, and every ``#anchor`` a heading in it."""

from __future__ import annotations

import re
from pathlib import Path

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
