"""The runnable examples run offline on the embedded model and do what they say."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(script: str) -> list[str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_custom_policy_example():
    found = (re.match(r"\s*(\S+) recomputed +(\d+)/\d+: '.{10,}'$", line) for line in _run("custom_policy.py"))
    recomputed = {m[1]: int(m[2]) for m in found if m}
    # 3 chunks: lastk recomputes k tokens of each on top of what Naive recomputes
    assert recomputed["lastk:4"] == recomputed["naive"] + 3 * 4
    assert recomputed["lastk:6"] == recomputed["naive"] + 3 * 6
    assert recomputed["full"] > recomputed["lastk:6"]
    # topmass recomputes its share of the 3 chunks' tokens (stories260K writes a BOS before each) after its probe
    chunk_tokens = recomputed["full"] - recomputed["naive"]
    assert recomputed["topmass"] == recomputed["naive"] + round(0.2 * chunk_tokens)
    assert recomputed["topmass:0.5"] == recomputed["naive"] + round(0.5 * chunk_tokens)


def test_quickstart_example():
    lines = _run("quickstart.py")
    # the whole ids, which link() takes (issue "what a new user tripped on", item 4: they were cut to 12)
    assert re.fullmatch(r"cache ids: [0-9a-f]{32}, [0-9a-f]{32}, [0-9a-f]{32}", lines[0]), lines[0]
    # the default, auto: the documents by relevance, the most relevant last, recomputed whole, or (a prompt too short
    # to win: three one-line stories) Full Recompute in the caller's order
    links = [line for line in lines if line.startswith("Linked(")]
    ran = ("policy='suffix:0.05,whole=True', order='relevance'", "policy='full', order='given'")
    assert len(links) == 2 and all(any(form in line for form in ran) for line in links), links
    assert any(line.startswith("Full Recompute") for line in lines)
