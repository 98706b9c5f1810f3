"""``pic serve``'s boundary (issue 63, item 5): secrets that never need the command line, a keyless server that no
web page can use (Host, Origin, content-type), ids cut in errors and logs, a request framed twice closing its
connection, large bodies parsed off the event loop. Real servers: ``pic serve`` subprocesses, uvicorn in a thread
(``tests.serving``), raw sockets."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import uvicorn

import pic
import pic.serve.bodies
from pic.cli import main as pic_main
from pic.serve.app import build_app
from pic.serve.hosts import AllowedHosts
from pic.serve.http import CutLongPaths, cut_path
from tests.models import QUERY, model, tokenizer
from tests.serving import free_port, serving, wait_healthy

KEY = "boundary-key-0123456789"
STORE_KEY = "a1" * 32  # 32 bytes, hex
MODEL = "stories260K"
SECRET_ENV = ("PIC_API_KEY", "PIC_STORE_KEY", "PIC_REDIS_URL")
FORM = "application/x-www-form-urlencoded"
CHUNKS = {"documents": ["A dog ran to the park."]}


@pytest.fixture(autouse=True)
def _no_secrets_in_env(monkeypatch) -> None:
    """The tests set the secrets' variables themselves; none leaks in from the environment they run in."""
    for name in SECRET_ENV:
        monkeypatch.delenv(name, raising=False)


def _secret_file(folder: Path, name: str, text: str, mode: int = 0o600) -> Path:
    path = folder / name
    path.write_text(text)
    path.chmod(mode)
    return path


# -- 1. secrets from files and the environment -------------------------------------------------------------


def _serve(port: int, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    argv = [sys.executable, "-m", "pic", "serve", "--port", str(port), "--skip-check", *args]
    environ = {**{k: v for k, v in os.environ.items() if k not in SECRET_ENV}, **(env or {})}
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environ)



def test_keys_from_a_file_and_from_the_environment_stay_off_the_command_line(tmp_path):
    """Accepted-when item 4: two real servers, one with the API key and the store key from files, one from the
    environment (each with a disk tier, which the store key authenticates): neither key is in ``/proc/PID/cmdline``,
    both servers authenticate with the key, neither warns nor notes an unkeyed tier; and an unknown id of 10,000
    characters in a path is answered and logged cut."""
    key_file = _secret_file(tmp_path, "api-key", KEY + "\n")  # echo KEY > file: the newline is dropped
    store_file = _secret_file(tmp_path, "store-key", STORE_KEY + "\n")
    ports = [free_port(), free_port()]
    disk = ["--disk-bytes", "64M"]
    procs = [
        _serve(ports[0], "--api-key-file", str(key_file), "--store-key-file", str(store_file),
               "--disk-path", str(tmp_path / "disk0"), *disk),
        _serve(ports[1], "--disk-path", str(tmp_path / "disk1"), *disk,
               env={"PIC_API_KEY": KEY, "PIC_STORE_KEY": STORE_KEY}),
    ]  # fmt: skip
    outputs = []
    long_id = "ab" * 5000
    try:
        for proc, port in zip(procs, ports, strict=True):
            wait_healthy(proc, port)
            cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            assert "serve" in cmdline and KEY not in cmdline and STORE_KEY not in cmdline, cmdline
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
                assert http.get("/v1/models").status_code == 401
                assert http.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
                keyed = {"Authorization": f"Bearer {KEY}"}
                assert http.get("/v1/models", headers=keyed).status_code == 200
                assert http.post("/v1/chunks", json=CHUNKS, headers=keyed).status_code == 200
                unknown = http.get(f"/v1/chunks/{long_id}", headers=keyed)
            assert unknown.status_code == 404 and "(10000 characters)" in unknown.text, unknown.text
            assert long_id[:64] not in unknown.text and len(unknown.text) < 1000, unknown.text
    finally:
        for proc in procs:
            proc.terminate()
            outputs.append(proc.communicate(timeout=60)[0])
    for output in outputs:
        assert KEY not in output and STORE_KEY not in output, output
        assert "pic: warning" not in output and "no store key" not in output, output
        assert "/v1/chunks/'abababababababababababababababab…' (10000 characters)" in output, output
        assert long_id[:64] not in output, output  # the access log cut the path


@pytest.fixture
def no_load(monkeypatch) -> list[str]:
    """``pic.load`` replaced by a tripwire: a model load fails the test (a bad flag must stop ``pic serve`` first)."""
    loaded: list[str] = []

    def load(name, **_options):
        loaded.append(str(name))
        raise AssertionError(f"pic.load({name!r}) ran: the flags should have stopped the start")

    monkeypatch.setattr(pic, "load", load)
    return loaded


@pytest.mark.parametrize(
    ("case", "named"),
    [
        ("missing file", "argument --api-key-file: cannot read"),
        ("group-readable", "may be read or written by others (mode 0644)"),
        ("empty", "is empty"),
        ("a newline only", "is empty"),
        ("two lines", "holds a control character ('\\n' at character"),
        ("over 64 KiB", "is over 65,536 bytes"),
        ("a folder", "is not a file"),
        ("store key not hex", "argument --store-key-file:"),
        ("store key short", "is 8 bytes; a store key has at least 16"),
        ("store key odd", "an odd number of hex digits (33)"),
        ("env key empty", "PIC_API_KEY is empty"),
        ("env store key bad", "PIC_STORE_KEY is not hex digits"),
        ("env redis url bad", "PIC_REDIS_URL: "),
        ("redis url file bad", "argument --redis-url-file:"),
        ("file and env", "--api-key-file and PIC_API_KEY both give the API key: give one"),
        ("flag and file", "--api-key and --api-key-file both give the API key: give one"),
        ("two redis urls", "--redis-url and PIC_REDIS_URL both give the Redis URL: give one"),
        ("allowed host bad", "argument --allowed-host: 'http://x/' is not a host name"),
        ("allowed host with a key", "--allowed-host is for a server without an API key"),
    ],
)
def test_a_bad_secret_is_a_usage_error_naming_its_source(case, named, tmp_path, monkeypatch, capsys, no_load):
    """Every bad secret is an argparse error (exit 2) naming the flag or variable, before the model loads; the
    secret itself is never echoed."""
    secret = "s3cr3t-value-never-shown"
    files = {
        "group-readable": _secret_file(tmp_path, "k", secret, 0o644),
        "empty": _secret_file(tmp_path, "e", ""),
        "a newline only": _secret_file(tmp_path, "n", "\n"),
        "two lines": _secret_file(tmp_path, "t", f"{secret}\nsecond\n"),
        "over 64 KiB": _secret_file(tmp_path, "big", secret * 3000),
        "a folder": tmp_path,
        "missing file": tmp_path / "none",
    }
    store = {"store key not hex": secret, "store key short": "ab" * 8, "store key odd": "a" * 33}
    argv: list[str] = []
    if case in files:
        argv = ["--api-key-file", str(files[case])]
    elif case in store:
        argv = ["--store-key-file", str(_secret_file(tmp_path, "sk", store[case]))]
    elif case == "env key empty":
        monkeypatch.setenv("PIC_API_KEY", "")
    elif case == "env store key bad":
        monkeypatch.setenv("PIC_STORE_KEY", secret)
    elif case == "env redis url bad":
        monkeypatch.setenv("PIC_REDIS_URL", f"http://:{secret}@localhost:6379")
    elif case == "redis url file bad":
        argv = ["--redis-url-file", str(_secret_file(tmp_path, "url", f"redis://:{secret}@localhost:99999"))]
    elif case == "file and env":
        argv = ["--api-key-file", str(_secret_file(tmp_path, "k", secret))]
        monkeypatch.setenv("PIC_API_KEY", secret)
    elif case == "flag and file":
        argv = ["--api-key", secret, "--api-key-file", str(_secret_file(tmp_path, "k", secret))]
    elif case == "two redis urls":
        argv = ["--redis-url", "redis://localhost:6379"]
        monkeypatch.setenv("PIC_REDIS_URL", "redis://localhost:6380")
    elif case == "allowed host bad":
        argv = ["--allowed-host", "http://x/"]
    elif case == "allowed host with a key":
        argv = ["--allowed-host", "pic.internal"]
        monkeypatch.setenv("PIC_API_KEY", secret)
    with pytest.raises(SystemExit) as stopped:
        pic_main(["serve", "--port", str(free_port()), *argv])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "pic serve: error: " in err and named in err, err
    assert secret not in err and not no_load, err


def _parsed(argv: list[str], capsys) -> tuple[object, str]:
    """``pic serve``'s arguments as ``check_flags`` leaves them (secrets resolved), and what it said on stderr."""
    from pic.cli import _parser

    args = _parser().parse_args(["serve", *argv])
    args.check_flags(args)
    return args, capsys.readouterr().err


def test_each_secret_source_reaches_the_server_and_the_store_config(tmp_path, monkeypatch, capsys):
    """The key of a file (one trailing newline dropped, CRLF too), of ``PIC_API_KEY``, of ``--api-key`` (with a
    warning naming ``ps`` and the alternatives); the store key, hex, into ``StoreConfig.store_key``; the Redis URL
    of a file or ``PIC_REDIS_URL`` (a password on the command line warned about, masked)."""
    from pic.serve.main import store_config

    args, err = _parsed(["--api-key-file", str(_secret_file(tmp_path, "k", f"{KEY}\r\n"))], capsys)
    assert args.api_key == KEY and err == ""
    monkeypatch.setenv("PIC_API_KEY", KEY)
    monkeypatch.setenv("PIC_STORE_KEY", STORE_KEY.upper())
    args, err = _parsed(["--disk-path", str(tmp_path / "d"), "--disk-bytes", "1G"], capsys)
    assert args.api_key == KEY and err == ""
    assert store_config(args).store_key == bytes.fromhex(STORE_KEY) and store_config(args).disk_path is not None
    monkeypatch.delenv("PIC_API_KEY")
    monkeypatch.delenv("PIC_STORE_KEY")
    args, err = _parsed(["--api-key", KEY], capsys)
    assert args.api_key == KEY and store_config(args) is None
    assert err.startswith("pic: warning: --api-key puts the key on the command line") and err.count("\n") == 1, err
    assert "/proc/PID/cmdline" in err and "--api-key-file PATH" in err and "PIC_API_KEY" in err and KEY not in err
    url = "redis://:hunter2-password@localhost:6379/0"
    args, err = _parsed(["--redis-url-file", str(_secret_file(tmp_path, "u", url + "\n"))], capsys)
    assert args.redis_url == url and err == ""
    monkeypatch.setenv("PIC_REDIS_URL", url)
    args, err = _parsed([], capsys)
    assert args.redis_url == url and store_config(args).redis_url == url and err == ""
    monkeypatch.delenv("PIC_REDIS_URL")
    args, err = _parsed(["--redis-url", url], capsys)
    assert "puts its password on the command line" in err and "redis://:***@localhost" in err, err
    assert "hunter2" not in err and "--redis-url-file PATH" in err and "PIC_REDIS_URL" in err, err
    _, err = _parsed(["--redis-url", "redis://localhost:6379"], capsys)
    assert err == ""  # no password, no warning


@pytest.fixture
def uvicorn_runs(monkeypatch) -> list[object]:
    """``uvicorn.Server.run`` replaced: it records the app and closes its engine; nothing is served."""
    apps: list[object] = []

    def run(server: uvicorn.Server, sockets=None) -> None:
        apps.append(server.config.app)
        server.config.app.state.engine.engine.close()

    monkeypatch.setattr(uvicorn.Server, "run", run)
    return apps


def test_a_shared_tier_without_a_store_key_is_said_at_start_up(tmp_path, monkeypatch, capsys, uvicorn_runs):
    """With a disk (or Redis) tier and no store key, one line on stderr says the tier is trusted as it is and how
    to set a key; with a key (``PIC_STORE_KEY``) or without a shared tier, nothing."""
    disk = ["--disk-path", str(tmp_path / "disk"), "--disk-bytes", "64M", "--skip-check"]
    assert pic_main(["serve", "--port", str(free_port()), *disk]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "store key" in line]
    assert len(notes) == 1 and notes[0].startswith("pic: note: no store key: chunks read from the disk folder"), notes
    assert "trusted as they are" in notes[0] and "--store-key-file PATH or PIC_STORE_KEY" in notes[0], notes
    monkeypatch.setenv("PIC_STORE_KEY", STORE_KEY)
    assert pic_main(["serve", "--port", str(free_port()), *disk]) == 0
    assert "store key" not in capsys.readouterr().err
    monkeypatch.delenv("PIC_STORE_KEY")
    assert pic_main(["serve", "--port", str(free_port()), "--skip-check"]) == 0
    assert "store key" not in capsys.readouterr().err and len(uvicorn_runs) == 3


# -- 2. a keyless server is no target for web pages ---------------------------------------------------------


@pytest.fixture(scope="module")
def keyless() -> Iterator[tuple[str, pic.PIC]]:
    """stories260K without an API key on a real uvicorn (127.0.0.1), allowing the name ``pic.internal``."""
    engine = pic.PIC(model(MODEL), tokenizer())
    app = build_app(engine, model_name=MODEL, allowed_hosts=AllowedHosts.parse(["pic.internal"]))
    with serving(app) as url:
        yield url, engine
    engine.close()


@pytest.fixture(scope="module")
def keyed() -> Iterator[tuple[str, pic.PIC]]:
    """stories260K behind ``KEY`` on a real uvicorn."""
    engine = pic.PIC(model(MODEL), tokenizer())
    with serving(build_app(engine, model_name=MODEL, api_key=KEY)) as url:
        yield url, engine
    engine.close()


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and set(error) == {"message", "type", "param", "code"}, error
    return error["message"]


def test_a_cross_site_form_post_is_refused_by_a_keyless_server(keyless):
    """Accepted-when item 4: the form a web page posts (foreign Origin; under DNS rebinding a foreign Host too) is
    a 403 saying why, whatever its body; nothing is compiled."""
    url, engine = keyless
    before = sorted(engine.store.ids())
    body = json.dumps(CHUNKS).encode()
    with httpx.Client(base_url=url, timeout=60) as http:
        rebound = {"host": f"evil.example:{_port(url)}", "origin": f"http://evil.example:{_port(url)}"}
        message = _error(http.post("/v1/chunks", content=body, headers={"content-type": FORM, **rebound}), 403)
        assert "Host 'evil.example:" in message and "DNS rebinding" in message and "--allowed-host" in message
        assert "pic.internal" not in message  # the operator's names are not told to a stranger
        forged = {"content-type": FORM, "origin": "http://evil.example"}
        message = _error(http.post("/v1/chunks", content=body, headers=forged), 403)
        assert "'http://evil.example'" in message and "cross-site" in message, message
        for origin in ("null", f"http://127.0.0.1:{_port(url) + 1}", "file://", "http://127.0.0.1.evil.example"):
            _error(http.post("/v1/chunks", json=CHUNKS, headers={"origin": origin}), 403)
    assert sorted(engine.store.ids()) == before


@pytest.mark.parametrize(
    "content_type", [None, FORM, "text/plain", "multipart/form-data; boundary=x", "application/jsonx"]
)
def test_a_keyless_server_reads_only_json_sent_as_json(keyless, content_type):
    """A POST to a keyless server that is not ``application/json`` (none at all included: a page's ``fetch`` can
    send a body without one) is a 415 saying what to send, with ``Accept: application/json``."""
    headers = {} if content_type is None else {"content-type": content_type}
    with httpx.Client(base_url=keyless[0], timeout=60) as http:
        response = http.post("/v1/chunks", content=json.dumps(CHUNKS).encode(), headers=headers)
    message = _error(response, 415)
    assert response.headers["accept"] == "application/json"
    said = "no content-type" if content_type is None else f"content-type {content_type!r}"
    assert message.startswith(f"the request body came with {said}; "), message
    assert "content-type: application/json" in message and "--api-key" in message, message


def test_a_keyless_server_serves_its_own_clients(keyless):
    """curl-style JSON with its content-type, the ``openai`` client, a page of the server's own site (its
    ``/docs``), loopback names, an allowed name (any port), and ``/health`` whatever its Host."""
    import openai

    url, port = keyless[0], _port(keyless[0])
    body = json.dumps(CHUNKS).encode()
    with httpx.Client(base_url=url, timeout=60) as http:
        json_type = {"content-type": "application/json; charset=utf-8"}
        assert http.post("/v1/chunks", content=body, headers=json_type).status_code == 200
        for host, origin in [
            (f"127.0.0.1:{port}", f"http://127.0.0.1:{port}"),
            (f"localhost:{port}", f"http://localhost:{port}"),
            (f"LOCALHOST.:{port}", None),
            (f"[::1]:{port}", f"http://[::1]:{port}"),
            ("pic.internal", "https://pic.internal"),
            ("pic.internal:443", None),
        ]:
            headers = {"host": host, **({"origin": origin} if origin else {})}
            assert http.post("/v1/chunks", json=CHUNKS, headers=headers).status_code == 200, (host, origin)
        assert http.get("/health", headers={"host": "evil.example"}).status_code == 200
        for path in ("/v1/models", "/metrics", "/openapi.json", f"/v1/chunks/{'0' * 32}"):
            _error(http.get(path, headers={"host": f"evil.example:{port}"}), 403)  # a rebound page reads nothing
        _error(http.get("/v1/models", headers={"host": f"127.0.0.1:{port + 1}"}), 403)
        _error(http.delete(f"/v1/chunks/{'0' * 32}", headers={"host": "evil.example"}), 403)
        schema = http.get("/openapi.json").json()["paths"]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    assert client.completions.create(model=MODEL, prompt=QUERY, max_tokens=2).choices[0].text
    assert {"403", "415"} <= set(schema["/v1/chunks"]["post"]["responses"])
    assert "403" in schema["/v1/models"]["get"]["responses"] and "415" not in schema["/v1/models"]["get"]["responses"]
    assert "403" not in schema["/health"]["get"]["responses"]


def test_a_request_without_a_host_is_refused_by_a_keyless_server(keyless):
    """HTTP/1.0 lets a client leave out ``Host``; a keyless server cannot tell where such a request was sent."""
    with socket.create_connection(("127.0.0.1", _port(keyless[0])), timeout=60) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.0\r\n\r\n")
        answer = _read_all(sock)
    assert answer.startswith(b"HTTP/1.1 403 ") and b"a request without a Host header" in answer, answer


def test_a_keyed_server_keeps_reading_curl_d(keyed):
    """With a key, today's behaviour: a body without a content-type, or as curl -d sends it, is JSON, whatever
    Host or Origin it names (a browser never sends the bearer key to another site); without the key, a 401."""
    url = keyed[0]
    body = json.dumps(CHUNKS).encode()
    with httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as http:
        for headers in ({"content-type": FORM}, {}, {"content-type": FORM, "origin": "http://evil.example"}):
            assert http.post("/v1/chunks", content=body, headers=headers).status_code == 200, headers
        assert http.get("/v1/models", headers={"host": "evil.example"}).status_code == 200
        schema = http.get("/openapi.json").json()["paths"]
    assert httpx.post(f"{url}/v1/chunks", content=body, headers={"content-type": FORM}).status_code == 401
    assert "403" not in schema["/v1/chunks"]["post"]["responses"]
    assert "415" not in schema["/v1/chunks"]["post"]["responses"]


# -- 3. ids echoed and logged cut -------------------------------------------------------------------------------


def test_an_unknown_id_is_echoed_and_logged_cut(keyless, caplog):
    """An unknown id of a million characters: its 404 (a path, a completion's ``cache_ids``, a DELETE) names its
    first 32 characters and its length, and so does the engine's log line of the failed request (at debug: the
    caller's own error, which the caller gets)."""
    url = keyless[0]
    huge, path_id = "f" * 1_000_000, "e" * 5000
    with caplog.at_level(logging.DEBUG, logger="pic"), httpx.Client(base_url=url, timeout=120) as http:
        body = {"model": MODEL, "prompt": QUERY, "max_tokens": 1, "pic": {"cache_ids": [huge]}}
        messages = [
            _error(http.post("/v1/completions", json=body), 404),
            _error(http.get(f"/v1/chunks/{path_id}"), 404),
            _error(http.delete(f"/v1/chunks/{path_id}"), 404),
        ]
    assert messages[0].startswith(f"unknown cache id {'f' * 32 + '…'!r} (1000000 characters) "), messages[0]
    for message, shown in zip(messages[1:], ["e" * 32 + "…"] * 2, strict=True):
        assert message.startswith(f"unknown cache id {shown!r} (5000 characters)"), message
    assert all(len(message) < 1000 for message in messages), messages
    logged = [r.getMessage() for r in caplog.records if "(1000000 characters)" in r.getMessage()]
    assert logged and all(len(line) < 1000 for line in logged), logged
    assert not any("f" * 64 in r.getMessage() for r in caplog.records)


def test_access_log_paths_are_cut():
    """uvicorn's access-log record of a long path gets it cut (``pic serve`` adds the filter to ``uvicorn.access``);
    a short one is left as it is."""
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d', None, None)
    record.args = ("127.0.0.1:5", "GET", f"/v1/chunks/{'a' * 16000}", "1.1", 404)
    assert CutLongPaths().filter(record)
    shown = repr("a" * 32 + "…")
    assert record.getMessage() == f'127.0.0.1:5 - "GET /v1/chunks/{shown} (16000 characters) HTTP/1.1" 404'
    assert cut_path("/v1/chunks/0123") == "/v1/chunks/0123" and len(cut_path("/x" * 5000)) < 200


# -- 4. Content-Length and Transfer-Encoding: the connection closes -----------------------------------------


def _read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _framed(port: int, body: bytes, *, content_length: bool) -> bytes:
    """A chunked ``POST /v1/chunks`` (with a false Content-Length too, when asked), then a pipelined GET of
    ``/health`` on the same connection: what a proxy that read the first by its Content-Length would pass on."""
    head = (
        f"POST /v1/chunks HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {KEY}\r\n"
        "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
        + ("Content-Length: 4\r\n" if content_length else "")
        + "\r\n"
    )
    chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    return head.encode() + chunked + f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()


def test_content_length_with_transfer_encoding_closes_the_connection(keyed):
    """RFC 9112 §6.1: a request with both is answered (by its Transfer-Encoding) with ``Connection: close`` and its
    connection closed, so the request after it is never read; without the Content-Length, the same two requests
    are both answered on one kept-alive connection."""
    port, body = _port(keyed[0]), json.dumps(CHUNKS).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(_framed(port, body, content_length=True))
        answer = _read_all(sock)  # returns: the server closed the connection
    assert answer.count(b"HTTP/1.1 ") == 1 and answer.startswith(b"HTTP/1.1 200 "), answer
    assert b"connection: close" in answer.lower() and b"cache_ids" in answer, answer
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(_framed(port, body, content_length=False))
        answer = b""
        while answer.count(b"HTTP/1.1 200 ") < 2 or not answer.endswith(b'{"status":"ok"}'):
            chunk = sock.recv(65536)
            assert chunk, answer  # the connection stays open
            answer += chunk
    assert b"connection: close" not in answer.lower(), answer


# -- 5. large bodies parsed off the event loop --------------------------------------------------------------


@dataclass
class Parses:
    """The body parses a test watched: each one's thread, and a parse of a large body held while ``hold`` is set
    (``parsing`` says one is held)."""

    threads: list[str] = field(default_factory=list)
    hold: threading.Event = field(default_factory=threading.Event)
    parsing: threading.Event = field(default_factory=threading.Event)


@pytest.fixture
def parses(monkeypatch) -> Iterator[Parses]:
    """``pic.serve.bodies.parse`` wrapped: each call records its thread's name, waits while ``hold`` is set (a large
    body only), then parses as before."""
    watched, real = Parses(), pic.serve.bodies.parse

    def parse(body: bytes):
        watched.threads.append(threading.current_thread().name)
        if len(body) > pic.serve.bodies.OFF_LOOP_BYTES and watched.hold.is_set():
            watched.parsing.set()
            while watched.hold.is_set():
                time.sleep(0.01)
        return real(body)

    monkeypatch.setattr(pic.serve.bodies, "parse", parse)
    yield watched
    watched.hold.clear()


def test_a_large_body_is_parsed_off_the_event_loop(keyed, parses):
    """A body over ``OFF_LOOP_BYTES`` is parsed on the parser's thread, and while its parse is held the same server
    answers ``/health``; a small body is parsed on the loop. The large body then gets what it always got (a 422
    for 100,000 scores, its message short), and a malformed large one the parser's position."""
    url = keyed[0]
    headers = {"Authorization": f"Bearer {KEY}"}
    large = {"model": MODEL, "prompt": QUERY, "max_tokens": 1, "pic": {"relevance": [0.5] * 100_000}}
    with httpx.Client(base_url=url, timeout=120, headers=headers) as http:
        assert http.post("/v1/chunks", json=CHUNKS).status_code == 200
        parses.hold.set()
        answer: dict[str, httpx.Response] = {}
        sender = threading.Thread(target=lambda: answer.update(r=httpx.post(
            f"{url}/v1/completions", json=large, headers=headers, timeout=120)))  # fmt: skip
        sender.start()
        assert parses.parsing.wait(120)
        assert http.get("/health").status_code == 200  # the loop serves while the parse is held
        assert http.get("/v1/models").status_code == 200
        parses.hold.clear()
        sender.join(120)
        broken = json.dumps(large).encode()[:-2] + b",}"
        malformed = http.post("/v1/completions", content=broken, headers={"content-type": "application/json"})
    small_thread, large_thread, broken_thread = parses.threads
    assert large_thread.startswith("pic-serve-json") and broken_thread.startswith("pic-serve-json"), parses.threads
    assert not small_thread.startswith("pic-serve-json"), parses.threads
    message = _error(answer["r"], 422)
    assert message.startswith("pic.relevance=[0.5, 0.5") and "(100000 items)" in message and len(message) < 400
    assert _error(malformed, 400).startswith("the request body is malformed JSON: Expecting property name"), malformed
