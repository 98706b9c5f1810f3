"""``pic eval fidelity``: the policies' fidelity on the default stories260K workload (acceptance 3),
user workloads, the report files and the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import pic
from pic.evaluation import evaluate_fidelity, load_workload, plot_fidelity, sample_workload


@pytest.fixture(scope="module")
def engine() -> pic.PIC:
    return pic.PIC.from_pretrained()  # the real stories260K


@pytest.fixture(scope="module")
def report(engine):
    return evaluate_fidelity(engine, seed=0)


def test_default_workload_meets_the_fidelity_targets(report):
    """Acceptance 3: LegoLink and CacheBlend cut Naive's KL to Full Recompute by the stated factors,
    and more recompute gives lower KL within each family."""
    kl = {s.policy: s.mean_kl for s in report.scores}
    naive = kl["naive"]
    assert 1e-3 <= naive <= 1e-2, naive  # the workload really exercises the cache
    assert kl["legolink:16"] <= 0.75 * naive
    assert kl["cacheblend:0.15"] <= 0.5 * naive
    assert kl["cacheblend:0.3"] <= 0.3 * naive
    assert kl["cacheblend:0.3"] < kl["cacheblend:0.15"] < kl["cacheblend:0.05"] < naive
    assert kl["legolink:32"] < kl["legolink:16"] < naive
    full = report.score("full")
    assert full.mean_kl == 0.0 and full.top1_agreement == 1.0 and full.recompute_fraction == 1.0


def test_report_counts_recompute(report):
    naive, blend = report.score("naive"), report.score("cacheblend:0.15")
    assert naive.mean_recomputed == 20  # no prefix: only the 20 query tokens
    assert blend.mean_recomputed_first_layer == report.score("full").mean_recomputed  # all, up to the check layer
    assert naive.mean_recomputed < blend.mean_recomputed < blend.mean_recomputed_first_layer
    assert 0 < naive.recompute_fraction < report.score("legolink:16").recompute_fraction < 1
    assert report.score("legolink0:3").mean_recomputed == 20
    assert all(s.median_link_s > 0 and s.median_speedup_vs_full > 0 for s in report.scores)


def test_report_files(report, tmp_path):
    report.save_json(tmp_path / "fidelity.json")
    data = json.loads((tmp_path / "fidelity.json").read_text())
    assert data["workload"]["seed"] == 0 and data["workload"]["num_cases"] == 30
    assert [s["policy"] for s in data["scores"]][:3] == ["full", "naive", "legolink0:3"]
    plot_fidelity(report, tmp_path / "fidelity.png")
    assert (tmp_path / "fidelity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = report.table().splitlines()
    assert len(table) == 2 + len(report.scores) and table[3].startswith("| naive | ")
    with pytest.raises(pic.PolicyError, match="'legolink:99'"):
        report.score("legolink:99")


def test_sampled_workload_shape_and_seed(engine):
    first = sample_workload(engine, num_cases=4, seed=7)
    assert first == sample_workload(engine, num_cases=4, seed=7)
    assert first.cases != sample_workload(engine, num_cases=4, seed=8).cases
    for case in first.cases:
        assert len(case.chunks) == 3 and all(80 <= len(c) <= 120 for c in case.chunks) and len(case.query) == 20
        assert not {1, 2} & {t for c in (*case.chunks, case.query) for t in c}  # no BOS / EOS inside


def test_user_workload(engine, tmp_path):
    path = tmp_path / "cases.jsonl"
    cases = [
        {"chunks": ["Tom had a red ball.", "Lily liked to sing."], "query": "One day, Tom and Lily"},
        {"chunks": ["The cat sat on the mat.", [300, 301, 302]], "query": "Then the cat"},
    ]
    path.write_text("\n".join(json.dumps(c) for c in cases) + "\n\n")
    workload = load_workload(path)
    assert len(workload.cases) == 2 and workload.cases[1].chunks[1] == [300, 301, 302]
    report = evaluate_fidelity(engine, workload=workload, policies=["naive", "cacheblend:0.3"])
    assert [s.policy for s in report.scores] == ["full", "naive", "cacheblend:0.3"]
    assert report.score("naive").mean_kl > report.score("cacheblend:0.3").mean_kl > 0


@pytest.mark.parametrize(
    "content, named",
    [
        ('{"chunks": ["a"], "query": "b"}\n{"chunks": ["a"]}\n', "line 2: Field required"),
        ('{"chunks": [], "query": "b"}\n', "line 1: List should have at least 1 item"),
        ("not json\n", "line 1: Expecting value"),
        ("\n\n", "has no cases"),
    ],
)
def test_malformed_workload(tmp_path, content, named):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(pic.InvalidInputError, match=named):
        load_workload(path)
    with pytest.raises(pic.InvalidInputError, match="cannot read workload"):
        load_workload(tmp_path / "missing.jsonl")


def test_command_line_writes_json_and_png(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    command = [sys.executable, "-m", "pic", "eval", "fidelity", "--cases", "3", "--out", str(tmp_path)]
    proc = subprocess.run(
        [*command, "--policies", "naive legolink:8", "--name", "small"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "| legolink:8 |" in proc.stdout
    assert [s["policy"] for s in json.loads((tmp_path / "small.json").read_text())["scores"]] == [
        "full",
        "naive",
        "legolink:8",
    ]
    assert (tmp_path / "small.png").read_bytes()[:4] == b"\x89PNG"
    bad = subprocess.run([*command, "--policies", "nope"], capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 1 and "unknown policy 'nope'" in bad.stderr
