"""Edges of ``pic serve`` a user meets first: a busy port, a server open to the network without a key, JSON sent
without its content-type, ``max_tokens: 0``, the tokens of a stream its client left, whether a store tier's
writes work, and the README's compile-then-chat flow."""

from __future__ import annotations

import errno
import json
import re
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI

import pic
from pic.cli import main as pic_main
from pic.engine import RequestOutput
from pic.serve import main as serve_main
from pic.serve.app import build_app
from pic.serve.loop import AsyncRequestStream
from pic.serve.protocol import TimedH11Protocol
from pic.store.tier import TierStats
from tests.models import QUERY, model
from tests.serving import free_port, serving
from tests.test_chat import CHATML, chat_tokenizer

ROOT = Path(__file__).resolve().parent.parent
KEY = "edge-key"
MODEL = "stories260K"


def _stories(**config) -> pic.PIC:
    """stories260K with a chat template, on the CPU."""
    return pic.PIC(model(MODEL), chat_tokenizer(CHATML), config=pic.PICConfig(**config))


def _metrics(http: httpx.Client) -> dict[str, float]:
    """``GET /metrics`` as ``{sample: value}``."""
    text = http.get("/metrics").text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[0] != "#"}


# -- 1. the port is taken before the model loads -------------------------------------------------------------


@pytest.fixture
def uvicorn_runs(monkeypatch) -> list[dict]:
    """``uvicorn.Server.run`` replaced: it records the server's config and the sockets it was handed (as they
    are during the call: ``pic serve`` closes its socket after), closes the app's engine, and serves nothing."""
    runs: list[dict] = []

    def run(server: uvicorn.Server, sockets=None) -> None:
        runs.append({
            "config": server.config, "sockets": sockets,
            "bound": [(s.family, s.getsockname()[:2]) for s in sockets or ()],
            "listening": [s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1 for s in sockets or ()],
        })  # fmt: skip
        state = getattr(server.config.app, "state", None)
        if state is not None and hasattr(state, "engine"):
            state.engine.engine.close()

    monkeypatch.setattr(uvicorn.Server, "run", run)
    return runs


@dataclass
class Loads:
    """``pic.load``'s calls: the model each named, and whether ``probe`` (a host and port) took a connection by
    then; ``probe`` ``None``: not asked (``None`` recorded)."""

    calls: list[tuple[str, bool | None]] = field(default_factory=list)
    probe: tuple[str, int] | None = None


@pytest.fixture
def loads(monkeypatch) -> Loads:
    """``pic.load`` wrapped to record its calls (``pic.serve.main`` looks ``pic.load`` up when it runs)."""
    loads, real_load = Loads(), pic.load

    def load(name, **options):
        loads.calls.append((name, None if loads.probe is None else _accepts(*loads.probe)))
        return real_load(name, **options)

    monkeypatch.setattr(pic, "load", load)
    return loads


def _accepts(host: str, port: int) -> bool:
    """Whether ``host:port`` takes a TCP connection."""
    try:
        socket.create_connection((host, port), timeout=10).close()
    except OSError:
        return False
    return True


@pytest.mark.parametrize(
    ("host", "family"), [("127.0.0.1", socket.AF_INET), ("::", socket.AF_INET6)], ids=["ipv4", "ipv6"]
)
def test_a_busy_port_is_a_clear_error_before_the_model_loads(host, family, loads, uvicorn_runs, capsys):
    """``pic serve`` on a port another server listens on: one line naming the address and ``--port``, exit 1 (as
    every start-up error), and no model loaded (it loaded ~1 GB and ran its check before uvicorn failed)."""
    with socket.socket(family, socket.SOCK_STREAM) as other:
        other.bind((host, 0))
        other.listen()
        port = other.getsockname()[1]
        code = pic_main(["serve", "--host", host, "--port", str(port)])
    err = capsys.readouterr().err
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    assert code == 1 and not loads.calls and not uvicorn_runs
    assert err.startswith(f"pic: error: cannot listen on {where}: [Errno {errno.EADDRINUSE}] "), err
    assert err.rstrip().endswith("is another server running? pass --port") and err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("host", "family", "connect"),
    [("127.0.0.1", socket.AF_INET, "127.0.0.1"), ("::", socket.AF_INET6, "::1")],
    ids=["ipv4", "ipv6"],
)
def test_serve_listens_first_and_hands_that_socket_to_uvicorn(host, family, connect, loads, uvicorn_runs):
    """The port takes connections before the model loads, and uvicorn serves on that very socket, with ``pic
    serve``'s protocol (its read deadlines) and log level; the socket is closed when uvicorn returns."""
    port = free_port()
    loads.probe = (connect, port)
    argv = ["serve", "--host", host, "--port", str(port), "--header-timeout", "3", "--body-timeout", "4"]
    assert pic_main(argv) == 0
    assert loads.calls == [(pic.EMBEDDED_MODEL, True)]  # listening already while the model loaded
    [run] = uvicorn_runs
    assert run["bound"] == [(family, (host, port))] and run["listening"] == [True]
    config = run["config"]
    assert issubclass(config.http, TimedH11Protocol)
    assert (config.http.headers_timeout_s, config.http.body_timeout_s) == (3, 4)
    assert (config.host, config.port, config.log_level) == (host, port, "info")  # what uvicorn's log line names
    # An idle connection outlives the openai client's (httpx's) own idle expiry, so the client never sends a
    # request into a connection the server is closing at that very moment (uvicorn's default equals httpx's).
    assert config.timeout_keep_alive > httpx.Limits().keepalive_expiry
    assert run["sockets"][0].fileno() == -1  # closed after serving


# -- 2. a warning when the server is open to the network without a key --------------------------------------


@pytest.mark.parametrize(
    ("host", "api_key", "warned"),
    [
        ("0.0.0.0", None, "serving on 0.0.0.0:{port} without --api-key"),
        ("::", None, "serving on [::]:{port} without --api-key"),
        ("0.0.0.0", "k", None),
        ("127.0.0.1", None, None),
        ("::1", None, None),
        ("localhost", None, None),
    ],
    ids=["any-ipv4", "any-ipv6", "with-key", "loopback-ipv4", "loopback-ipv6", "localhost"],
)
def test_serving_beyond_loopback_without_a_key_warns(host, api_key, warned, monkeypatch, uvicorn_runs, capsys):
    """Bound beyond the loopback with no ``--api-key``, anyone who reaches the port can generate and delete
    chunks: ``pic serve`` says so on stderr before serving (and says nothing on a loopback address or with a
    key). The model is left out: an empty app stands in."""
    monkeypatch.setattr(serve_main, "_checked_app", lambda args, config, store: FastAPI())
    port = free_port()
    argv = ["serve", "--host", host, "--port", str(port)]
    if api_key:
        monkeypatch.setenv("PIC_API_KEY", api_key)  # off the command line: no warning about that either
    assert pic_main(argv) == 0 and len(uvicorn_runs) == 1
    err = capsys.readouterr().err
    if warned is None:
        assert "warning" not in err, err
    else:
        assert err.splitlines()[0] == (  # before uvicorn's own lines
            f"pic: warning: {warned.format(port=port)}: anyone who can reach this port can use the server and read "
            "or delete its chunks"
        )
    assert "Uvicorn running on http://" in err.splitlines()[-1]  # the address, as uvicorn says it of its own sockets


def test_loopback_addresses():
    loopback = ("127.0.0.1", "127.1.2.3", "::1", "localhost", "LOCALHOST", "::ffff:127.0.0.1")
    assert all(serve_main.is_loopback(host) for host in loopback)
    assert not any(serve_main.is_loopback(host) for host in ("0.0.0.0", "::", "10.0.0.1", "example.com", "128.0.0.1"))


# -- 3. JSON without its content-type ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, pic.PIC, FastAPI]]:
    """stories260K (never stopping at EOS) behind ``KEY`` on a real uvicorn; yields ``(url, engine, app)``."""
    engine = _stories(eos_token_ids=())
    app = build_app(engine, model_name=MODEL, api_key=KEY)
    with serving(app) as url:
        yield url, engine, app
    engine.close()


def _http(server) -> httpx.Client:
    return httpx.Client(base_url=server[0], headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


CHUNKS = ("/v1/chunks", {"documents": ["A dog ran to the park."]})
COMPLETION = ("/v1/completions", {"model": MODEL, "prompt": QUERY, "max_tokens": 4, "temperature": 0})
FORM = "application/x-www-form-urlencoded"


@pytest.mark.parametrize(("route", "body"), [CHUNKS, COMPLETION], ids=["chunks", "completions"])
@pytest.mark.parametrize("content_type", [None, FORM, f"{FORM}; charset=utf-8"])
def test_json_without_its_content_type_is_taken_as_json(server, route, body, content_type):
    """A JSON body with no content-type (forgotten), or with curl -d's form type, was a 400 "not a valid JSON
    object"; it gets what the same body sent as application/json gets."""
    headers = {} if content_type is None else {"content-type": content_type}
    with _http(server) as http:
        typed = http.post(route, json=body)
        sent = http.post(route, content=json.dumps(body).encode(), headers=headers)
    assert "content-type" not in sent.request.headers or content_type is not None
    assert typed.status_code == sent.status_code == 200, sent.text
    got, want = sent.json(), typed.json()
    if route == "/v1/completions":
        got, want = got["choices"], want["choices"]
    assert got == want


@pytest.mark.parametrize(("route", "body"), [CHUNKS, COMPLETION], ids=["chunks", "completions"])
@pytest.mark.parametrize(
    ("content_type", "content", "named"),
    [
        ("text/plain", None, "not a valid JSON object (it came with content-type 'text/plain'"),
        (FORM, b"documents=x&model=y", "malformed JSON: Expecting value at line 1, column 1 (char 0)"),
        (None, b"documents=x", "malformed JSON: Expecting value at line 1, column 1 (char 0)"),
        ("application/json", b"{not json", "malformed JSON: Expecting property name enclosed in double quotes at"),
    ],
    ids=["text-plain", "form-not-json", "none-not-json", "json-broken"],
)
def test_a_body_that_is_not_json_names_its_content_type(server, route, body, content_type, content, named):
    """A body that is not read as JSON (text/plain) is a 400 naming the content-type it came with; one that was
    read as JSON (no content-type, curl -d's form type, JSON's) and does not parse is a 400 saying where the parser
    stopped, not blaming its content-type (issue 51, item 5c)."""
    headers = {} if content_type is None else {"content-type": content_type}
    with _http(server) as http:
        response = http.post(route, content=content or json.dumps(body).encode(), headers=headers)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert message.startswith(f"the request body is {named}"), message
    assert ("content-type" in message) == (content_type == "text/plain"), message


# -- 4. max_tokens 0 ---------------------------------------------------------------------------------------


def test_max_tokens_zero_is_an_empty_completion_as_in_python(server):
    """``max_new_tokens=0`` is an empty generation in Python (finish reason ``length``, no token); over HTTP
    ``max_tokens: 0`` (and ``max_completion_tokens: 0``) was a 422. Both routes, streamed or not."""
    url, engine = server[0], server[1]
    python = engine.link([], QUERY).generate(max_new_tokens=0)
    assert (python.text, python.token_ids, python.stats.finish_reason.value) == ("", [], "length")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    out = client.completions.create(model=MODEL, prompt=QUERY, max_tokens=0, temperature=0)
    assert (out.choices[0].text, out.choices[0].finish_reason) == ("", "length")
    assert (out.usage.completion_tokens, out.usage.prompt_tokens) == (0, python.stats.num_prompt_tokens)
    chunks = list(client.completions.create(model=MODEL, prompt=QUERY, max_tokens=0, temperature=0, stream=True))
    assert [(c.choices[0].text, c.choices[0].finish_reason) for c in chunks] == [("", "length")]
    messages = [{"role": "user", "content": "Tell me a story."}]
    for limit in ({"max_tokens": 0}, {"max_completion_tokens": 0}, {"max_completion_tokens": 0, "max_tokens": 9}):
        chat = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **limit)
        assert (chat.choices[0].message.content, chat.choices[0].finish_reason) == ("", "length"), limit
        assert chat.usage.completion_tokens == 0
    with _http(server) as http:
        negative = http.post("/v1/completions", json={**COMPLETION[1], "max_tokens": -1})
        schema = http.get("/openapi.json").json()["components"]["schemas"]
    assert negative.status_code == 422 and "max_tokens=-1" in negative.json()["error"]["message"]
    for body, name in (("CompletionBody", "max_tokens"), ("ChatBody", "max_completion_tokens")):
        assert schema[body]["properties"][name]["anyOf"][0] == {"type": "integer", "minimum": 0}


# -- 5. the tokens of a stream its client left ---------------------------------------------------------------

HELD_AFTER = 6  # outputs the engine hands over before it is held (until the client has left)


def test_a_stream_the_client_leaves_counts_the_tokens_it_generated(server, monkeypatch):
    """A client that closes a stream mid-way: ``pic_tokens_total{kind="generated"}`` counted none of its tokens.

    The rule: a stream the client left counts every token of the outputs it read from the engine (each output
    carries the token sampled in its step); its prompt, reused and recomputed tokens and timings are not counted
    (the engine's last output, which has them, goes unread once the stream is closed). To know exactly what the
    stream read, the engine's thread is held before its ``HELD_AFTER + 1``-th output until the client has left:
    the stream reads ``HELD_AFTER`` outputs, the client receives every event they make, and no more."""
    engine = server[1]
    outputs: list[RequestOutput] = []
    held, release, left = threading.Event(), threading.Event(), threading.Event()
    put, abort = AsyncRequestStream.put, engine.abort

    def held_put(stream, item) -> None:
        if isinstance(item, RequestOutput) and not item.finished:
            if len(outputs) == HELD_AFTER:
                held.set()
                release.wait(60)  # the engine's thread: no further output until the client has left
            else:
                outputs.append(item)
        put(stream, item)

    def aborted(request_id: int) -> None:  # on the event loop, as the stream is closed: the client left
        abort(request_id)
        left.set()

    monkeypatch.setattr(AsyncRequestStream, "put", held_put)
    monkeypatch.setattr(engine, "abort", aborted)
    with _http(server) as http:
        before = _metrics(http)
    body = {"model": MODEL, "prompt": QUERY, "max_tokens": 400, "temperature": 0, "stream": True}
    try:
        with _http(server) as http, http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            assert held.wait(60), "the engine never produced its outputs"
            texts = [out.text for out in outputs if out.text]  # one event per output with text
            lines = (line for line in response.iter_lines() if line.startswith("data: "))
            received = [json.loads(next(lines)[6:])["choices"][0]["text"] for _ in texts]
        assert received == texts
        assert left.wait(60), "the server did not see the client leave"
    finally:
        release.set()
    with _http(server) as http:
        after = _metrics(http)
    delta = {kind: after[f'pic_tokens_total{{kind="{kind}"}}'] - before[f'pic_tokens_total{{kind="{kind}"}}']
             for kind in ("prompt", "reused", "recomputed", "generated")}  # fmt: skip
    assert sum(len(out.token_ids) for out in outputs) == HELD_AFTER  # one token per output
    assert delta == {"prompt": 0, "reused": 0, "recomputed": 0, "generated": HELD_AFTER}


# -- 6. pic_store_writable ---------------------------------------------------------------------------------


def test_store_writable_is_exported_per_tier(tmp_path, monkeypatch):
    """``pic_store_writable{tier}``: 1 while a tier's writes work, 0 while they fail (``TierStats.writable``),
    next to ``pic_store_up``."""
    from fastapi.testclient import TestClient

    engine = pic.PIC(
        model(MODEL), chat_tokenizer(CHATML), store=pic.StoreConfig(disk_path=str(tmp_path), disk_bytes=64 << 20)
    )
    with engine, TestClient(build_app(engine, model_name=MODEL)) as http:
        values = _metrics(http)
        assert values['pic_store_writable{tier="disk"}'] == 1 and values['pic_store_writable{tier="device"}'] == 1
        assert values['pic_store_up{tier="disk"}'] == 1
        full = [TierStats(name="device"), TierStats(name="disk", writable=False)]
        monkeypatch.setattr(engine.store, "stats", lambda: full)
        values = _metrics(http)
        assert values['pic_store_writable{tier="disk"}'] == 0 and values['pic_store_writable{tier="device"}'] == 1
        assert values['pic_store_up{tier="disk"}'] == 1


# -- 7. README's compile-then-chat flow ------------------------------------------------------------------------


def _readme_compile() -> tuple[dict, list[str]]:
    """The JSON body of README's ``curl .../v1/chunks`` example, and the cache ids it prints."""
    serve = ROOT.joinpath("README.md").read_text().split("## Serve", 1)[1].split("\n## ", 1)[0]
    command = re.search(r"^curl [^\n]*/v1/chunks.*?-d '(.*?)'\n", serve, flags=re.S | re.M)
    assert command is not None, "README's Serve section has no curl .../v1/chunks -d '...' command"
    printed = re.search(r'^# (\{"cache_ids":.*\})$', serve[command.end() :], flags=re.M)
    assert printed is not None, "README does not print what its curl command returns"
    return json.loads(command.group(1)), json.loads(printed.group(1))["cache_ids"]


def _serve_md_chat() -> list[dict]:
    """docs/serve.md client example's messages: its system prompt, and its user message with the question and
    ``{documents}``."""
    block = ROOT.joinpath("docs", "serve.md").read_text().split("```python\n", 1)[1].split("```", 1)[0]
    question = re.search(r'^question = "(.*)"$', block, flags=re.M).group(1)
    system = re.search(r'"role": "system", "content": "(.*?)"', block).group(1)
    user = re.search(r'"role": "user", "content": f"(.*?)"\}', block).group(1)
    user = user.replace("{question}", question).replace("\\n", "\n").replace("{{documents}}", "{documents}")
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def test_readme_compile_then_chat_by_id_answers_from_the_documents(smollm2):
    """README's ``POST /v1/chunks`` compiles the documents in the chat's context (``"system"``: the system
    prompt docs/serve.md's chat uses), so a chat by those ids links what its inline documents would have been,
    and answers from them; the ids README prints are the ones the command returns (``pic serve --model
    smollm2``'s default config: cache ids depend on the model and the text, not on the pool size)."""
    from fastapi.testclient import TestClient

    body, printed = _readme_compile()
    messages = _serve_md_chat()
    assert body.get("system") == messages[0]["content"], "README compiles outside the chat's context"
    with TestClient(build_app(smollm2, model_name="smollm2")) as http:
        compiled = http.post("/v1/chunks", json=body)
        assert compiled.status_code == 200, compiled.text
        ids = compiled.json()["cache_ids"]
        chat = {"model": "smollm2", "messages": messages, "max_tokens": 32, "temperature": 0}
        answer = http.post("/v1/chat/completions", json={**chat, "pic": {"cache_ids": ids}}).json()
    assert ids == printed
    assert ids == smollm2.compile(body["documents"], context=smollm2.chat_context(messages), progress=False)
    text = answer["choices"][0]["message"]["content"]
    assert "North Sea" in text and "Baltic" not in text, text
    with smollm2.link_chat(ids, messages) as linked:  # the usage says what ran, as the engine's link does
        assert answer["usage"]["pic_policy"] == linked.policy.spec and answer["usage"]["reused_tokens"] == int(
            (~linked.recomputed).sum()
        )
