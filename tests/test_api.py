"""The module-level API and the demo, as a user runs them."""

from __future__ import annotations

import os
import subprocess
import sys

import pic


def test_module_level_api_uses_the_default_engine():
    engine = pic.load()  # the embedded stories260K, offline
    assert pic.default_engine() is engine and engine.spec.architecture == "LlamaForCausalLM"
    ids = pic.compile(["Tom had a red ball.", "Lily liked to sing."])
    out = pic.link(ids[::-1], "One day,", policy=pic.policies.Naive()).generate(max_new_tokens=16)
    assert out.text and len(out.token_ids) == 16 and out.ttft_s > 0
    assert list(pic.link(ids, "One day,", prefix="A story.").stream(max_new_tokens=8))


def test_demo_runs_offline():
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pic", "demo", "--max-new-tokens", "24"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert sum(line.lstrip().startswith("[naive]") for line in lines) == 2
    assert sum(line.lstrip().startswith("[full]") for line in lines) == 2
    generations = [lines[i + 1].strip() for i, line in enumerate(lines) if line.lstrip().startswith("[")]
    assert all(len(g) > 20 and sum(c.isalpha() for c in g) > 10 for g in generations), generations
