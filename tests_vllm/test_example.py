"""docs/vllm.md's runnable example, as a user runs it: pic compiles, vLLM links by cache id, and it answers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "vllm_link.py"


def test_the_vllm_example_links_the_documents_and_answers(tmp_path):
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), str(tmp_path)], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("stores", "links", "  linked="))]
    assert lines[0].startswith("stores the chat's prefix:") and "linked=False" in lines[1]  # a new prefix: stored
    assert lines[2].startswith("links:") and "Kilimanjaro" in lines[2], lines  # then linked, and right
    assert "linked=True order=relevance" in lines[3], lines
