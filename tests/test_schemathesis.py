"""schemathesis against ``pic serve``'s own ``/openapi.json``: every response is declared (status, media type,
body schema), no request gets a 5xx, a wrong method gets a 405 with the right ``Allow``, the API key is
enforced where the schema says so.

A real uvicorn (with ``pic serve``'s protocol) on 127.0.0.1 serves stories260K; schemathesis's CLI runs in a
subprocess against it, with a fixed seed and a bounded number of examples per operation (its examples,
coverage, fuzzing and stateful phases: about 20 s here). schemathesis is a test dependency: without it this
file fails to import (a failure, not a skip).

Left out: ``positive_data_acceptance``, which expects every schema-valid request to succeed: JSON Schema cannot
say that a policy must be registered, that a prompt must have tokens, or that ``4.0`` is not an integer (the
server's integers are strict, and the schema says so in words).
"""

from __future__ import annotations

import subprocess
import sys

import schemathesis  # noqa: F401  (imported so that a missing schemathesis fails the collection)

from tests.serving import serving
from tests.test_serve_strict import KEY, served_app

# Statuses that count as rejecting a schema-invalid request (schemathesis' default list lacks 413).
_CONFIG = """
[checks.negative_data_rejection]
expected-statuses = [400, 401, 404, 405, 406, 413, 415, 422]
"""
_MAX_EXAMPLES = 60


def test_schemathesis_finds_nothing(tmp_path):
    _engine, app = served_app(max_body_bytes=64 << 10)
    (tmp_path / "schemathesis.toml").write_text(_CONFIG)
    with serving(app) as url:
        command = [
            sys.executable, "-m", "schemathesis.cli", "--config-file", str(tmp_path / "schemathesis.toml"),
            "--no-color", "run", f"{url}/openapi.json", "--header", f"Authorization: Bearer {KEY}",
            "--checks", "all", "--exclude-checks", "positive_data_acceptance",
            "--max-examples", str(_MAX_EXAMPLES), "--seed", "1", "--workers", "1",
            "--generation-database", "none", "--request-timeout", "60",
        ]  # fmt: skip
        # (300 s: a bound on a hang, not on speed; ``--request-timeout`` bounds each request of the run)
        run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-8000:]
    assert "No issues found" in output or "passed" in output, output[-2000:]
