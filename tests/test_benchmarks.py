"""The benchmark scripts run (tiny sizes) and write their JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_store_benchmark_writes_json(tmp_path):
    out = tmp_path / "store.json"
    args = [sys.executable, str(BENCHMARKS / "store.py"), "--tokens", "4", "40", "--reps", "1", "--out", str(out)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert [r["num_tokens"] for r in report["results"]] == [4, 40]
    assert report["results"][1]["num_bytes"] == 40 * 128 * 1024  # 128 KiB per token
    assert all(r["put_ratio_raw_over_tier"] > 0 and r["get_ratio_raw_over_tier"] > 0 for r in report["results"])
