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
    large = report["results"][1]
    assert large["num_bytes"] == 40 * 128 * 1024  # 128 KiB per token
    assert large["num_parts"] == 2  # K and V of 2.5 MiB each, in parts of at most 8 MiB
    for r in report["results"]:  # the ratios are what the measured medians say
        median = r["median_s"]
        assert r["put_ratio_raw_over_tier"] == median["raw_set"] / median["tier_put"]
        assert r["get_ratio_raw_over_tier"] == median["raw_get"] / median["tier_get"]


def test_cpu_threads_benchmark_writes_json(tmp_path):
    out = tmp_path / "threads.json"
    args = [sys.executable, str(BENCHMARKS / "cpu_threads.py"), "--threads", "1", "2", "--reps", "1", "--tokens", "4"]
    proc = subprocess.run([*args, "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    for condition in ("idle", "busy"):
        result = report["conditions"][condition]
        one, two = result["median_s"]["1"], result["median_s"]["2"]
        assert result["ratio_over_1_thread"]["2"] == {key: two[key] / one[key] for key in one}


def test_memory_benchmark_writes_json(tmp_path):
    out = tmp_path / "memory.json"
    args = [sys.executable, str(BENCHMARKS / "memory.py"), "--quick", "--out", str(out)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    results = report["results"]
    assert report["command"].endswith("memory.py --quick --out " + str(out))
    assert list(results) == ["mepic", "legolink:16", "cacheblend:0.15", "mepic private"]
    shared, private = results["mepic"], results["mepic private"]
    for rows in results.values():
        assert [r["n"] for r in rows] == [1, 2, 4]
        for r in rows:
            assert 0 < r["floor_blocks"] <= r["peak_blocks"] <= report["workload"]["pool_blocks"]
            assert r["peak_over_floor"] == r["peak_blocks"] / r["floor_blocks"]
    for s, p, blend in zip(shared, private, results["cacheblend:0.15"], strict=True):
        assert s["peak_blocks"] == s["floor_blocks"]  # one copy of each chunk, nothing else
        assert s["peak_blocks"] < p["peak_blocks"]
        assert blend["peak_blocks"] == p["peak_blocks"]  # a dynamic policy copies every chunk block
    ratios = [p["peak_blocks"] / s["peak_blocks"] for s, p in zip(shared, private, strict=True)]
    assert report["private_over_mepic"] == ratios
    assert (out.with_suffix(".png")).exists() or "matplotlib is not installed" in proc.stdout


def test_throughput_benchmark_writes_json(tmp_path):
    args = [sys.executable, str(BENCHMARKS / "throughput.py"), "--quick", "--out", str(tmp_path)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "throughput.json").read_text())
    assert report["command"].endswith("throughput.py --quick --out " + str(tmp_path))
    assert report["torch_threads"] == 1
    assert list(report["raw"]) == list(report["medians"]) == ["facade", "engine 1", "engine 4"]
    assert report["identical_tokens"]
    digests = {row["token_digest"] for rows in report["raw"].values() for row in rows}
    assert len(digests) == 1  # every variant generated the same tokens for every request
    workload, facade = report["workload"], report["medians"]["facade"]
    for name, rows in report["raw"].items():
        assert len(rows) == workload["repeats"] == 1
        for row in rows:
            assert row["generated_tokens"] == workload["requests"] * workload["new_tokens"] == 64
            assert row["tokens_per_s"] == row["generated_tokens"] / row["wall_s"]
            assert row["preemptions"] == 0
        median = report["medians"][name]
        assert median["tokens_per_s_over_facade"] == median["tokens_per_s"] / facade["tokens_per_s"]
        assert report["tokens_per_s_over_facade"][name] == median["tokens_per_s_over_facade"]
    assert 1 < report["medians"]["engine 4"]["mean_batch"] <= 4
    assert (tmp_path / "throughput.png").exists() or "matplotlib is not installed" in proc.stdout
