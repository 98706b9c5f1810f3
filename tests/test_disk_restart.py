"""The disk tier under an engine and a server: compiled chunks survive a restart (two real ``pic serve``
processes in turn on one ``--disk-path``), a damaged file is compiled again, a failing disk fails only
what needs it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

import pic
from pic.cli import main
from pic.errors import StoreUnavailableError
from tests.serving import free_port, wait_healthy
from tests.test_serve import DOCS, KEY, QUERY

# Not the start-up check's documents (pic.check), so the restarted server has never seen them
SERVED = ("A little bird flew over the hill to find food.", "Sam and his sister built a tall sand castle.")

DISK_BYTES = 64 << 20


def store(path: Path, **kwargs) -> pic.StoreConfig:
    return pic.StoreConfig(disk_path=str(path), disk_bytes=DISK_BYTES, **kwargs)


def model_dir(path: Path) -> Path:
    """The folder of the one model a disk tier at ``path`` holds chunks of."""
    (folder,) = path.iterdir()
    return folder


def test_a_new_engine_links_what_the_last_one_compiled_and_recompiles_a_damaged_chunk(tmp_path):
    first = pic.load(store=store(tmp_path))
    ids = first.compile(list(DOCS))
    before = first.link(ids, QUERY)
    logits, text = before.logits, before.generate(max_new_tokens=10).text
    first.close()

    fresh = pic.load(store=store(tmp_path))  # never saw the documents: the files are all it has
    path = model_dir(tmp_path) / f"{ids[1]}.kv"
    path.write_bytes(path.read_bytes()[:-7])  # a torn write's leftovers
    assert fresh.store.lookup(ids[0]) == ("disk",)
    # promoted from disk into the pool (naive: auto recomputes half of a lone chunk, sharing none of its blocks)
    assert fresh.link([ids[0]], QUERY, policy="naive").num_shared_blocks > 0
    with pytest.raises(pic.UnknownCacheIdError):
        fresh.link(ids, QUERY)  # the truncated file is a miss (and is removed)
    assert not path.exists() and fresh.store.stats()[1].errors == 1
    fresh.close()

    path.write_bytes(b"PICKV" + bytes(100))  # damaged again, for an engine that compiles the documents
    damaged = pic.load(store=store(tmp_path))
    assert damaged.compile(list(DOCS)) == ids  # every file exists: nothing is prefilled
    after = damaged.link(ids, QUERY)  # the bad file is a miss: compiled again from the compile's tokens
    torch.testing.assert_close(after.logits, logits, atol=1e-4, rtol=0)
    assert after.generate(max_new_tokens=10).text == text
    deadline = time.monotonic() + 30  # (a bound on the wait: the writer thread writes it in milliseconds)
    while not path.exists() and time.monotonic() < deadline:  # written back by the engine's writer thread
        time.sleep(0.01)
    assert damaged.store.lookup(ids[1]) == ("device", "disk")
    damaged.close()
    restarted = pic.load(store=store(tmp_path))
    assert restarted.link(ids, QUERY).generate(max_new_tokens=10).text == text
    restarted.close()


def test_a_failing_disk_fails_the_compile_or_is_logged_as_a_miss(tmp_path, caplog):
    raising = pic.load(store=store(tmp_path / "a"))
    missing = pic.load(store=store(tmp_path / "b", on_disk_error="miss"))
    for name in ("a", "b"):  # the model's directory becomes a file: every write fails
        directory = model_dir(tmp_path / name)
        shutil.rmtree(directory)
        directory.write_bytes(b"")
    with pytest.raises(StoreUnavailableError, match="disk tier at .* failed: ENOTDIR"):
        raising.compile([DOCS[0]])
    ids = missing.compile([DOCS[0]])  # the pool has it; the disk's failure is logged
    assert missing.link(ids, QUERY, policy="naive").num_shared_blocks > 0
    assert "serving from the other tiers" in caplog.text
    raising.close()
    missing.close()


def _serve(disk: Path, port: int) -> subprocess.Popen:
    args = [sys.executable, "-m", "pic", "serve", "--port", str(port), "--api-key", KEY,
            "--disk-path", str(disk), "--disk-bytes", "64M"]  # fmt: skip
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _complete(port: int, ids: list[str]) -> str:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
    out = client.completions.create(
        model="stories260K", prompt=QUERY, max_tokens=10, temperature=0, extra_body={"pic": {"cache_ids": ids}}
    )
    return out.choices[0].text


def test_a_restarted_server_answers_by_the_cache_ids_it_compiled_before(tmp_path):
    """Two ``pic serve`` processes in turn on one ``--disk-path``: the second, whose pool never saw the chunks,
    answers by the first one's cache ids, with its text; a corrupted file is compiled again."""
    headers = {"Authorization": f"Bearer {KEY}"}
    port = free_port()
    proc = _serve(tmp_path, port)
    try:
        wait_healthy(proc, port)
        ids = httpx.post(f"http://127.0.0.1:{port}/v1/chunks", json={"documents": list(SERVED)}, headers=headers)
        ids = ids.json()["cache_ids"]
        text = _complete(port, ids)
    finally:
        proc.terminate()
        proc.wait(30)
    (corrupt,) = [p for p in tmp_path.rglob(f"{ids[1]}.kv")]
    data = bytearray(corrupt.read_bytes())
    data[-3] ^= 0x55  # a flipped payload byte: only the checksum finds it
    corrupt.write_bytes(bytes(data))

    port = free_port()
    proc = _serve(tmp_path, port)
    try:
        wait_healthy(proc, port)
        info = httpx.get(f"http://127.0.0.1:{port}/v1/chunks/{ids[0]}", headers=headers).json()
        assert info["tiers"] == ["disk"]  # the restarted server holds it only on disk
        missing = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions", headers=headers,
            json={"model": "stories260K", "prompt": QUERY, "pic": {"cache_ids": ids}},
        )  # fmt: skip
        assert missing.status_code == 404 and ids[1] in missing.text  # the corrupted file: a miss
        again = httpx.post(f"http://127.0.0.1:{port}/v1/chunks", json={"documents": list(SERVED)}, headers=headers)
        assert again.json()["cache_ids"] == ids  # the damaged chunk compiled again, the other read from disk
        assert _complete(port, ids) == text
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.parametrize(
    ("argv", "named", "code"),
    [
        # issue 51, item 5: the flags named, and argparse's usage error (exit 2), as docs/serve.md says
        (["--disk-path", "/tmp/x"], "pic serve: error: --disk-path needs --disk-bytes", 2),
        (["--disk-bytes", "10G"], "pic serve: error: --disk-bytes needs --disk-path", 2),
        (["--disk-path", "/tmp/x", "--disk-bytes", "0"], "'0' is not a positive size", 2),
        (["--disk-path", "/tmp/x", "--disk-bytes", "ten"], "'ten' is not a size", 2),
        (["--disk-path", "/tmp/x", "--disk-bytes", "1G", "--on-disk-error", "ignore"], "invalid choice", 2),
    ],
)
def test_serve_refuses_bad_disk_flags_before_loading_a_model(argv, named, code, monkeypatch, capsys):
    def no_load(*args, **kwargs):
        raise AssertionError("loaded a model")

    monkeypatch.setattr(pic, "load", no_load)
    try:
        result = main(["serve", *argv])
    except SystemExit as exited:
        result = exited.code
    err = capsys.readouterr().err
    assert result == code and named in err and "Traceback" not in err and "StoreConfig" not in err, err
