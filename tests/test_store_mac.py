"""``benchmarks/store_mac.py`` (what the store key costs) runs at a tiny size and writes the figures it prints."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "store_mac.py"


def test_the_mac_benchmark_writes_its_json(tmp_path):
    spec = importlib.util.spec_from_file_location("store_mac", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "mac.json"
    report = module.main(["--mib", "1", "--rounds", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    steps = [f"{step}_{kind}" for step in ("decode", "redis_put", "redis_get") for kind in ("unkeyed", "keyed")]
    assert report["payload_bytes"] == 2**20
    assert set(report["median_s"]) == {"xxh3_128", "hmac_sha256", "blake2b_keyed", *steps}
    median = report["median_s"]
    assert report["time_over_xxh3"]["hmac_sha256"] == median["hmac_sha256"] / median["xxh3_128"]
    assert report["keyed_over_unkeyed"]["redis_get"] == median["redis_get_keyed"] / median["redis_get_unkeyed"]
