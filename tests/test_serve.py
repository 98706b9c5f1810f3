"""``pic serve``'s app on a real uvicorn server, driven by the official ``openai`` client and raw HTTP."""

from __future__ import annotations

import collections
import json
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

import pic
from pic.serve.app import build_app
from tests.models import DOCS, QUERY, model
from tests.serving import free_port, serving, wait_healthy
from tests.test_chat import CHATML, chat_tokenizer
from tests.test_check import break_attention_scale

KEY = "test-key"


@pytest.fixture(scope="module")
def server():
    """A uvicorn server on a free loopback port, serving stories260K; yields ``(base_url, engine, app)``."""
    engine = pic.PIC(model("stories260K"), chat_tokenizer(CHATML))  # a copy of the tokenizer, with a template
    app = build_app(engine, model_name="stories260K", api_key=KEY, max_body_bytes=64 << 10)
    with serving(app) as url:
        yield url, engine, app


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key=KEY, max_retries=0)


def _http(server) -> httpx.Client:
    return httpx.Client(base_url=server[0], headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def _compile(server, docs) -> list[str]:
    with _http(server) as http:
        response = http.post("/v1/chunks", json={"documents": list(docs)})
    assert response.status_code == 200, response.text
    return response.json()["cache_ids"]


def test_compile_complete_and_stream_equal_link(server, client):
    engine = server[1]
    ids = _compile(server, DOCS)
    expected = engine.link(ids, QUERY, policy="mepic").generate(max_new_tokens=12)
    extra = {"pic": {"cache_ids": ids, "policy": "mepic"}}
    out = client.completions.create(model="stories260K", prompt=QUERY, max_tokens=12, temperature=0, extra_body=extra)
    assert out.choices[0].text == expected.text
    assert out.choices[0].finish_reason == expected.stats.finish_reason.value.replace("eos", "stop")
    usage = out.usage.model_extra
    assert out.usage.prompt_tokens == expected.stats.num_prompt_tokens
    assert usage["reused_tokens"] == expected.stats.num_reused_tokens
    assert usage["recomputed_tokens"] == expected.stats.num_recomputed_tokens
    stream = client.completions.create(
        model="stories260K", prompt=QUERY, max_tokens=12, temperature=0, stream=True, extra_body=extra
    )
    assert "".join(c.choices[0].text for c in stream) == expected.text
    # Documents given inline are compiled on the way: the same ids, the same text.
    inline = {"pic": {"documents": list(DOCS), "policy": "mepic"}}
    out = client.completions.create(model="stories260K", prompt=QUERY, max_tokens=12, temperature=0, extra_body=inline)
    assert out.choices[0].text == expected.text


def test_chunks_resource(server):
    ids = _compile(server, ["A dog ran to the park."])
    with _http(server) as http:
        info = http.get(f"/v1/chunks/{ids[0]}").json()
        assert info["tiers"] == ["device"] and info["num_tokens"] > 0 and info["bytes"] > 0
        assert http.delete(f"/v1/chunks/{ids[0]}").status_code == 200
        missing = http.get(f"/v1/chunks/{ids[0]}")
        assert missing.status_code == 404 and ids[0] in missing.json()["error"]["message"]
        assert http.delete(f"/v1/chunks/{ids[0]}").status_code == 404
        assert http.get("/v1/models").json()["data"][0]["id"] == "stories260K"


def test_32_concurrent_streams_are_batched_and_correct(server, client):
    engine, app = server[1], server[2]
    ids = _compile(server, DOCS)
    cases = [(ids[i % 3 :] + ids[: i % 3], f"{QUERY} {i}") for i in range(32)]
    expected = [engine.link(c, q).generate(max_new_tokens=10).text for c, q in cases]
    baseline = engine.kv_stats().num_private_blocks
    core = app.state.engine.engine.stepper()
    steps_before, seqs_before = core.num_steps, core.num_batched_seqs

    def run(case):
        chunks, query = case
        stream = client.completions.create(
            model="stories260K", prompt=query, max_tokens=10, temperature=0, stream=True,
            extra_body={"pic": {"cache_ids": chunks}},
        )  # fmt: skip
        return "".join(c.choices[0].text for c in stream)

    with ThreadPoolExecutor(32) as pool:
        assert list(pool.map(run, cases)) == expected
    num_steps, num_seqs = core.num_steps - steps_before, core.num_batched_seqs - seqs_before
    assert num_seqs / num_steps > 4  # mean batch: shared forwards (one at a time gives 1)
    assert num_steps < 32 * 10
    assert engine.kv_stats().num_private_blocks == baseline


def test_client_disconnect_aborts_and_frees_blocks(server):
    engine, core = server[1], server[2].state.engine.engine.stepper()
    ids = _compile(server, DOCS)
    baseline, steps_before = engine.kv_stats().num_private_blocks, core.num_steps
    body = {
        "model": "stories260K",
        "prompt": QUERY,
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
        "pic": {"cache_ids": ids},
    }
    with _http(server) as http, http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        next(response.iter_lines())  # the first event: the request is running
    deadline = time.monotonic() + 30  # (a bound on the wait: the abort frees them within a step or two)
    while engine.kv_stats().num_private_blocks != baseline:
        assert time.monotonic() < deadline, "the aborted request's blocks were not freed"
        time.sleep(0.05)
    assert core.num_steps - steps_before < 200  # aborted, not run to its 400 tokens


def test_a_client_that_leaves_a_non_streaming_completion_aborts_it():
    """A client that stops waiting for a (non-streaming) completion: the request is aborted and its blocks
    freed, as for a stream, instead of running to its ``max_tokens``."""
    engine = pic.PIC(model("stories260K"), chat_tokenizer(CHATML), config=pic.PICConfig(eos_token_ids=()))
    ids = engine.compile(list(DOCS))
    steps = engine.stepper()
    body = {"model": "stories260K", "prompt": QUERY, "max_tokens": 450, "temperature": 0, "pic": {"cache_ids": ids}}
    with serving(build_app(engine, model_name="stories260K")) as url:
        before = steps.num_steps
        with pytest.raises(httpx.TimeoutException), httpx.Client(base_url=url, timeout=0.2) as http:
            http.post("/v1/completions", json=body)
        deadline = time.monotonic() + 30  # (a bound on the wait: the abort frees them within a step or two)
        while engine.kv_stats().num_private_blocks:
            assert time.monotonic() < deadline, "the abandoned request's blocks were not freed"
            time.sleep(0.02)
        assert steps.num_steps - before < 400  # aborted, not run to its 450 tokens
        assert engine.kv_stats().num_used_blocks == 0


def test_a_large_bad_body_gets_a_short_error(server):
    """A 422 names the bad field and echoes its value cut short, not the whole body (issue 21, item 6)."""
    with _http(server) as http:  # ``user``: an OpenAI field the server ignores (an unknown one is a 400)
        response = http.post("/v1/completions", json={"model": "m", "user": "x" * 50_000})
        many = http.post(
            "/v1/completions", json={"model": "stories260K", "prompt": "x", "stop": [1] * 4, "n": 2, "temperature": "a"}
        )
    assert response.status_code == 422 and len(response.content) < 1000, len(response.content)
    message = response.json()["error"]["message"]
    assert message == "prompt: a required field is missing"  # the body around it is not echoed (issue 51, item 5a)
    assert many.status_code == 422 and "n=2: n=2" not in many.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "status", "named"),
    [
        ({"model": "stories260K", "prompt": "x", "pic": {"cache_ids": ["nope"]}}, 404, "'nope'"),
        ({"model": "stories260K", "prompt": "x", "temperature": 5}, 422, "temperature=5"),
        ({"model": "stories260K", "prompt": "x", "top_p": 0}, 422, "top_p=0"),
        ({"model": "stories260K", "prompt": "x", "max_tokens": -1}, 422, "max_tokens=-1"),
        ({"model": "stories260K", "prompt": "x", "n": 2}, 422, "n=2"),
        ({"model": "stories260K", "prompt": "x", "pic": {"policy": "nonsense"}}, 400, "nonsense"),
        ({"model": "stories260K", "prompt": "x", "pic": {"bogus": 1}}, 422, "bogus"),
        ({"model": "stories260K", "prompt": "one two " * 400}, 400, "context"),
        ({"model": "stories260K", "max_tokens": 3}, 422, "prompt"),
        # issue 21, item 8: JSON types taken strictly, as the Python API takes them
        ({"model": "stories260K", "prompt": "x", "max_tokens": "4"}, 422, "max_tokens='4'"),
        ({"model": "stories260K", "prompt": "x", "max_tokens": True}, 422, "max_tokens=True"),
        ({"model": "stories260K", "prompt": "x", "max_tokens": 4.0}, 422, "max_tokens=4.0"),
        ({"model": "stories260K", "prompt": "x", "temperature": "0.5"}, 422, "temperature='0.5'"),
        ({"model": "stories260K", "prompt": "x", "seed": "1"}, 422, "seed='1'"),
        ({"model": "stories260K", "prompt": "x", "stream": "yes"}, 422, "stream='yes'"),
        ({"model": "stories260K", "prompt": "x", "stream": 1}, 422, "stream=1"),
        # parameters this server does not honour, asking for something
        ({"model": "stories260K", "prompt": "x", "logprobs": 5}, 400, "logprobs=5: not supported"),
        ({"model": "stories260K", "prompt": "x", "echo": True}, 400, "echo=True"),
        ({"model": "stories260K", "prompt": "x", "frequency_penalty": 0.5}, 400, "frequency_penalty=0.5"),
        ({"model": "stories260K", "prompt": "x", "tools": [{"type": "function"}]}, 400, "tools="),
        ({"model": "stories260K", "prompt": "x", "best_of": 3, "suffix": "y"}, 400, "best_of=3, suffix='y'"),
        ({"model": "gpt-4", "prompt": "x"}, 404, "'gpt-4' is not served here"),
        ({"model": "stories260K", "prompt": "x", "seed": -1}, 422, "seed=-1"),
        ({"model": "stories260K", "prompt": "x", "seed": 2**64}, 422, "seed="),
        ({"model": "stories260K", "prompt": "x", "stop": ""}, 422, "stop strings must be non-empty"),
        ({"model": "stories260K", "prompt": "x", "stop": ["a", ""]}, 422, "stop strings must be non-empty"),
        ({"prompt": "x"}, 422, "model"),
    ],
)
def test_bad_input_gets_its_status_and_names_the_value(server, body, status, named):
    with _http(server) as http:
        response = http.post("/v1/completions", json=body)
    assert response.status_code == status, response.text
    assert named in response.json()["error"]["message"]


def test_neutral_values_unknown_routes_top_k_and_chat_prefix(server):
    """Unsupported parameters at their neutral values pass; an unknown route is OpenAI's 404; ``top_k`` is
    honoured; ``pic.prefix`` on chat is refused (the chat template writes that text)."""
    engine = server[1]
    ids = _compile(server, DOCS)
    neutral = {"logprobs": None, "echo": False, "frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {}}
    body = {"model": "stories260K", "prompt": QUERY, "max_tokens": 8, "temperature": 1.0, "top_k": 3, "seed": 7}
    want = engine.link(ids, QUERY).generate(8, temperature=1.0, top_k=3, seed=7).text
    with _http(server) as http:
        got = http.post("/v1/completions", json={**body, **neutral, "pic": {"cache_ids": ids}})
        assert got.status_code == 200 and got.json()["choices"][0]["text"] == want
        missing = http.get("/v1/nothing")
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
        chat = {"model": "stories260K", "messages": [{"role": "user", "content": "hi"}], "pic": {"prefix": "p"}}
        prefixed = http.post("/v1/chat/completions", json=chat)
        assert prefixed.status_code == 422 and "pic.prefix does not apply" in prefixed.json()["error"]["message"]


def test_protocol_edges_get_openai_errors_and_are_counted(server):
    """Issue 21, item 8: NaN, invalid UTF-8 and an oversized chunked body get OpenAI-shaped errors (413 for
    the size), 401s and 413s are counted in /metrics, a chat stream names the role once, and usage is
    streamed only when asked for (``stream_options.include_usage``)."""
    with _http(server) as http:
        nan = http.post(
            "/v1/completions", content=b'{"model": "stories260K", "prompt": "x", "temperature": NaN}',
            headers={"content-type": "application/json"},
        )  # fmt: skip
        assert nan.status_code == 422 and "finite" in nan.json()["error"]["message"]
        utf8 = http.post(
            "/v1/completions", content=b'{"prompt": "\xff\xfe"}', headers={"content-type": "application/json"}
        )
        assert utf8.status_code == 400 and "error" in utf8.json()

        def chunks():
            for _ in range(100):
                yield b"x" * 1024  # 100 KiB, no content-length: the limit is 64 KiB

        big = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert big.status_code == 413 and "over the limit" in big.json()["error"]["message"]
        with httpx.Client(base_url=server[0], timeout=30) as anonymous:
            assert anonymous.get("/v1/models").status_code == 401
        text = http.get("/metrics").text
        assert 'status="401"' in text and 'status="413"' in text

        ids = _compile(server, DOCS)
        chat = {"model": "stories260K", "messages": [{"role": "user", "content": "Who had a ball?"}], "max_tokens": 6}
        chat |= {"temperature": 0, "stream": True, "pic": {"cache_ids": ids}}
        for include_usage in (False, True):
            body = chat | {"stream_options": {"include_usage": include_usage}}
            with http.stream("POST", "/v1/chat/completions", json=body) as response:
                lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
            events = [json.loads(line) for line in lines[:-1]]
            deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
            assert [bool(d.get("role")) for d in deltas] == [True] + [False] * (len(deltas) - 1)
            assert [("usage" in e) for e in events] == [False] * len(deltas) + [True] * include_usage
            assert lines[-1] == "[DONE]"


def test_auth_body_limit_and_malformed_json(server):
    with httpx.Client(base_url=server[0], timeout=30) as http:
        assert http.get("/health").status_code == 200  # no key needed
        assert http.get("/v1/models").status_code == 401
        wrong = http.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert wrong.status_code == 401 and "API key" in wrong.json()["error"]["message"]
    with _http(server) as http:
        big = http.post("/v1/chunks", json={"documents": ["word " * 20000]})
        assert big.status_code == 413 and "over the limit" in big.json()["error"]["message"]
        bad = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert bad.status_code == 400 and "JSON" in bad.json()["error"]["message"]


def test_serve_refuses_a_model_that_fails_the_check(monkeypatch, capsys):
    """``pic serve`` runs ``pic check`` first: a broken runner exits 1 before uvicorn starts; ``--skip-check``
    goes on to serve (uvicorn.Server.run replaced: nothing is served)."""
    import uvicorn as uvicorn_module

    from pic.cli import main

    real_load = pic.load

    def broken_load(*args, **kwargs):
        return break_attention_scale(real_load(*args, **kwargs))

    served = []
    monkeypatch.setattr(pic, "load", broken_load)
    monkeypatch.setattr(uvicorn_module.Server, "run", lambda server, sockets=None: served.append(server.config))
    port = str(free_port())
    assert main(["serve", "--port", port]) == 1 and not served
    assert "refusing to serve" in capsys.readouterr().err
    assert main(["serve", "--port", port, "--skip-check"]) == 0 and served[0].host == "127.0.0.1"


SIMPLE_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:"
    "{% endif %}"
)


def test_serve_flags_size_the_pool_pick_the_policy_and_a_chat_template(monkeypatch, tmp_path):
    """Issue 21, item 11: ``--kv-pool-tokens``, ``--policy``, ``--chat-template FILE`` (and issue 43's
    ``--prefill-order``, ``--compile-share``) reach the engine; the
    embedded model has no chat template of its own, so its chat route works only through the file."""
    import uvicorn as uvicorn_module
    from fastapi.testclient import TestClient

    from pic.cli import main

    template = tmp_path / "chat.jinja"
    template.write_text(SIMPLE_TEMPLATE)
    apps = []
    monkeypatch.setattr(uvicorn_module.Server, "run", lambda server, sockets=None: apps.append(server.config.app))
    argv = ["serve", "--port", str(free_port()), "--kv-pool-tokens", "1000", "--policy", "mepic"]
    argv += ["--chat-template", str(template), "--prefill-order", "arrival", "--compile-share", "0.5"]
    assert main(argv) == 0
    engine = apps[0].state.engine.engine
    assert engine.kv_stats().num_blocks == 63  # 1000 tokens, rounded up to blocks of 16
    assert (engine.config.prefill_order.value, engine.config.compile_share) == ("arrival", 0.5)
    assert engine.default_policy.name == "mepic" and engine.tokenizer.chat_template == SIMPLE_TEMPLATE
    docs = ["Tom had a big red ball. " * 3, "Lily loved to sing songs. " * 3]
    with TestClient(apps[0]) as http:
        ids = http.post("/v1/chunks", json={"documents": docs}).json()["cache_ids"]
        body = {"model": "stories260K", "messages": [{"role": "user", "content": "Tell me"}], "max_tokens": 4}
        answer = http.post("/v1/chat/completions", json={**body, "pic": {"cache_ids": ids}})
        assert answer.status_code == 200, answer.text
    prefix, query = "user: ", "Tell me\nassistant:"
    expected = engine.link(ids, query, prefix=prefix, policy="mepic")
    with expected:
        assert answer.json()["usage"]["recomputed_tokens"] == expected.num_recomputed
        assert expected.num_recomputed < engine.link(ids, query, prefix=prefix, policy="legolink:16").num_recomputed
    engine.close()


def test_serve_decode_weights_flag_reaches_the_engine_and_the_check(monkeypatch, capsys):
    """``--decode-weights int8`` builds the engine with int8 decode weights, and the start-up check says that only
    the first token is held to transformers; another value is an argparse error before any model loads."""
    import uvicorn as uvicorn_module

    from pic.cli import main
    from pic.config import DecodeWeights

    apps = []
    monkeypatch.setattr(uvicorn_module.Server, "run", lambda server, sockets=None: apps.append(server.config.app))
    assert main(["serve", "--port", str(free_port()), "--decode-weights", "int8"]) == 0
    engine = apps[0].state.engine.engine
    assert engine.config.decode_weights is DecodeWeights.INT8
    assert "PASS" in capsys.readouterr().out.split("int8 decode weights")[0]
    engine.close()
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--decode-weights", "int4"])
    assert exit_.value.code == 2 and "invalid choice: 'int4'" in capsys.readouterr().err


def test_serve_refuses_a_chat_template_that_fails_on_messages(monkeypatch, tmp_path, capsys):
    """A template that parses but raises on messages, or drops the documents' place, stops the start."""
    import uvicorn as uvicorn_module

    from pic.cli import main

    apps = []
    monkeypatch.setattr(uvicorn_module.Server, "run", lambda server, sockets=None: apps.append(server.config.app))
    for text in ("{{ raise_exception('no') }}", "{% if add_generation_prompt %}assistant:{% endif %}"):
        template = tmp_path / "chat.jinja"
        template.write_text(text)
        argv = ["serve", "--port", str(free_port()), "--skip-check", "--chat-template", str(template)]
        assert main(argv) == 1 and not apps
        assert "pic: error: --chat-template: " in capsys.readouterr().err


@pytest.mark.parametrize(
    ("route", "body", "named"),
    [
        ("/v1/completions", '{"model":"stories260K","prompt":"One \\ud800 day","max_tokens":4}', "prompt holds"),
        ("/v1/completions", '{"model":"stories260K","prompt":"\\udfff","stream":true}', "prompt holds"),
        ("/v1/completions", '{"model":"stories260K","prompt":"x","pic":{"prefix":"\\ud800"}}', "prefix holds"),
        (
            "/v1/chat/completions",
            '{"model":"stories260K","messages":[{"role":"user","content":"Hi \\ud800"}]}',
            "messages[0].content holds",
        ),
        ("/v1/chunks", '{"documents":["ok","lone \\ud800"]}', "document 1 holds"),
    ],
    ids=["completion", "stream", "prefix", "chat", "chunks"],
)
def test_lone_surrogates_are_a_400_naming_the_field(server, route, body, named):
    """Issue 21, item 1: a JSON ``\ud800`` escape was a 500 text/plain and a reset keep-alive connection."""
    with _http(server) as http:
        response = http.post(route, content=body.encode(), headers={"content-type": "application/json"})
        assert response.status_code == 400, response.text
        message = response.json()["error"]["message"]
        assert named in message and ("'\\ud800'" in message or "'\\udfff'" in message), message
        assert http.get("/health").status_code == 200  # the same connection serves on


def test_metrics_in_prometheus_text(server, client):
    ids = _compile(server, DOCS)
    client.completions.create(
        model="stories260K", prompt=QUERY, max_tokens=4, temperature=0, extra_body={"pic": {"cache_ids": ids}}
    )
    with _http(server) as http:
        text = http.get("/metrics").text
        assert http.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[0] != "#"}
    assert values['pic_http_requests_total{route="/v1/completions",status="200"}'] >= 1
    assert values["pic_ttft_seconds_count"] >= 1 and values['pic_link_seconds_bucket{le="+Inf"}'] >= 1
    assert values['pic_tokens_total{kind="reused"}'] > 0 and values['pic_tokens_total{kind="recomputed"}'] > 0
    states = ("empty", "evictable", "held_chunk", "private")
    assert sum(values[f'pic_kv_blocks{{state="{state}"}}'] for state in states) == server[1].kv_stats().num_blocks
    assert values["pic_kv_pool_blocks"] == server[1].kv_stats().num_blocks
    assert values['pic_kv_blocks{state="evictable"}'] > 0  # the compiled chunks no request holds
    assert 'pic_store_misses_total{tier="device"}' in values and 'pic_store_bytes{tier="device"}' in values
    core = server[2].state.engine.engine.stepper()
    assert values["pic_engine_steps_total"] <= core.num_steps and values["pic_engine_steps_total"] >= 4


def _serve_process(redis_url: str, port: int) -> subprocess.Popen:
    args = [sys.executable, "-m", "pic", "serve", "--port", str(port), "--redis-url", redis_url, "--api-key", KEY]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_two_servers_share_chunks_through_redis(redis_url, server):
    """Two ``pic serve`` processes on one real redis-server: what one compiles, the other links (its pool
    never saw the chunks), with the text this process's engine gives."""
    ports = [free_port(), free_port()]
    procs = [_serve_process(redis_url, port) for port in ports]
    try:
        for proc, port in zip(procs, ports, strict=True):
            wait_healthy(proc, port)
        headers = {"Authorization": f"Bearer {KEY}"}
        made = httpx.post(f"http://127.0.0.1:{ports[0]}/v1/chunks", json={"documents": list(DOCS)}, headers=headers)
        ids = made.json()["cache_ids"]
        info = httpx.get(f"http://127.0.0.1:{ports[1]}/v1/chunks/{ids[0]}", headers=headers).json()
        assert info["tiers"] == ["redis"]  # the second server holds it only in the shared tier
        other = openai.OpenAI(base_url=f"http://127.0.0.1:{ports[1]}/v1", api_key=KEY, max_retries=0)
        linking = "auto:0.05,min_gain=1.0"  # auto without its floor: the toy's short prompt linked, its chunks reused
        out = other.completions.create(
            model="stories260K", prompt=QUERY, max_tokens=10, temperature=0,
            extra_body={"pic": {"cache_ids": ids, "policy": linking}},
        )  # fmt: skip
        here = server[1].link(_compile(server, DOCS), QUERY, policy=linking).generate(max_new_tokens=10)
        assert out.choices[0].text == here.text and out.usage.model_extra["reused_tokens"] > 0
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)


def test_chat_completion_equals_link_chat(server, client):
    """The documents go where link_chat puts them (the first user message); text, stream and usage agree."""
    engine = server[1]
    ids = _compile(server, DOCS)
    messages = [
        {"role": "system", "content": "Answer from the stories."},
        {"role": "user", "content": "Who had a ball?"},
    ]
    expected = engine.link_chat(ids, messages).generate(max_new_tokens=12)
    extra = {"pic": {"cache_ids": ids}}
    out = client.chat.completions.create(
        model="stories260K", messages=messages, max_tokens=12, temperature=0, extra_body=extra
    )
    assert out.choices[0].message.content == expected.text and out.choices[0].message.role == "assistant"
    assert out.usage.model_extra["reused_tokens"] == expected.stats.num_reused_tokens
    stream = client.chat.completions.create(
        model="stories260K", messages=messages, max_completion_tokens=12, temperature=0, stream=True, extra_body=extra
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream) == expected.text
    # A {documents} marker moves them, here to the end of the user message: another prompt.
    moved = [messages[0], {"role": "user", "content": "Who had a ball? {documents}"}]
    out = client.chat.completions.create(
        model="stories260K", messages=moved, max_tokens=12, temperature=0, extra_body=extra
    )
    assert out.choices[0].message.content == engine.link_chat(ids, moved).generate(max_new_tokens=12).text
    with _http(server) as http:
        twice = [{"role": "user", "content": "{documents} and {documents}"}]
        response = http.post(
            "/v1/chat/completions", json={"model": "stories260K", "messages": twice, "pic": extra["pic"]}
        )
        assert response.status_code == 400 and "{documents}" in response.json()["error"]["message"]
        response = http.post("/v1/chat/completions", json={"model": "stories260K", "messages": [{"role": "user"}]})
        assert response.status_code == 422 and "content" in response.json()["error"]["message"]


def test_chat_documents_compile_in_context_and_relevance_reaches_the_policy(server, client):
    """Inline chat documents are compiled after the chat's system turn (``link_chat(documents=...)``), as
    ``POST /v1/chunks`` with ``system`` compiles them; ``pic.relevance`` ranks the chunks for ``regions``."""
    engine = server[1]
    messages = [{"role": "system", "content": "Answer from the stories."}, {"role": "user", "content": "Who sang?"}]
    context = engine.chat_context(messages)
    with _http(server) as http:
        by_system = http.post("/v1/chunks", json={"documents": list(DOCS), "system": "Answer from the stories."})
        by_context = http.post("/v1/chunks", json={"documents": list(DOCS), "context": context})
        both = http.post("/v1/chunks", json={"documents": list(DOCS), "context": context, "system": "x"})
    assert (
        by_system.json()["cache_ids"] == by_context.json()["cache_ids"] == engine.compile(list(DOCS), context=context)
    )
    assert both.status_code == 422 and "context or system" in both.json()["error"]["message"]
    for relevance in ([0.0, 0.0, 1.0], [1.0, 0.0, 0.0]):
        pic_options = {"documents": list(DOCS), "policy": "regions:0.3,window=4", "relevance": relevance}
        expected = engine.link_chat(
            [], messages, documents=list(DOCS), policy="regions:0.3,window=4", relevance=relevance
        ).generate(max_new_tokens=10)
        out = client.chat.completions.create(
            model="stories260K", messages=messages, max_tokens=10, temperature=0, extra_body={"pic": pic_options}
        )
        assert out.choices[0].message.content == expected.text
        assert out.usage.model_extra["recomputed_tokens"] == expected.stats.num_recomputed_tokens
    with _http(server) as http:
        body = {"model": "stories260K", "messages": messages, "pic": {"documents": list(DOCS), "relevance": [1.0]}}
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 400 and "relevance has 1 scores for 3 cache ids" in response.text


def test_describing_a_redis_only_chunk_reads_its_metadata_not_its_kv(redis_server, redis_url):
    """``GET /v1/chunks/{id}`` of a chunk only Redis holds: Redis sends its metadata record, not its KV
    (counted by the Redis server itself), and nothing is promoted into the pool."""
    from fastapi.testclient import TestClient

    engine = pic.PIC(model("stories260K"), chat_tokenizer(CHATML), store=pic.StoreConfig(redis_url=redis_url))
    [cid] = engine.compile([[(7 * i) % 500 + 3 for i in range(400)]])
    with engine.paused() as core:
        assert core.pool.drop(cid)  # evicted from the pool: only Redis holds it now
    assert engine.store.lookup(cid) == ("redis",)
    kv_bytes = 401 * engine.spec.kv_bytes_per_token  # its BOS and 400 tokens
    redis = redis_server.client()
    with TestClient(build_app(engine, model_name="stories260K")) as http:
        before = redis.info("stats")["total_net_output_bytes"]
        body = http.get(f"/v1/chunks/{cid}").json()
        sent = redis.info("stats")["total_net_output_bytes"] - before
    assert body == {"id": cid, "tiers": ["redis"], "num_tokens": 401, "bytes": kv_bytes}
    assert kv_bytes > 500_000 and sent < kv_bytes / 100, sent  # the metadata and the INFO reply only
    assert engine.store.lookup(cid) == ("redis",)  # nothing was promoted


def _count_tokenized(tokenizer) -> list[int]:
    """The length of every text ``tokenizer`` is called on from now on (its class swapped for a subclass that
    counts: the engine calls it through ``SharedTokenizer``)."""
    lengths: list[int] = []
    base = type(tokenizer)

    def call(self, text=None, *args, **kwargs):
        texts = [text] if isinstance(text, str) else text if isinstance(text, list) else []
        lengths.extend(len(t) for t in texts if isinstance(t, str))
        return base.__call__(self, text, *args, **kwargs)

    tokenizer.__class__ = type(f"Counted{base.__name__}", (base,), {"__call__": call})
    return lengths


def test_a_huge_prompt_is_refused_without_tokenizing_and_the_server_stays_responsive():
    """Issue 21, item 2: a 7 MB prompt (under the 8 MiB body limit) once took 13-28 s to refuse, blocked the
    event loop (``/health`` 9.7 s) and grew the server by ~400 MB. Now text longer than any prompt that fits
    the context can hold is refused before tokenizing, and tokenizing runs off the event loop."""
    from fastapi.testclient import TestClient

    tokenizer = chat_tokenizer(CHATML)
    tokenized = _count_tokenized(tokenizer)
    engine = pic.PIC(model("stories260K"), tokenizer)
    huge = {"model": "stories260K", "prompt": "one two " * 875_000, "max_tokens": 4}  # 7 MB
    with TestClient(build_app(engine, model_name="stories260K")) as http:
        refused = http.post("/v1/completions", json=huge)
        assert refused.status_code == 400 and "refused without tokenizing" in refused.json()["error"]["message"]
        assert max(tokenized, default=0) < 100_000, tokenized  # the tokenizer never saw it (that took 13-28 s)
        chunks = http.post("/v1/chunks", json={"documents": ["word " * 200_000]})
        assert chunks.status_code == 400 and "document 0 has 1000000 characters" in chunks.json()["error"]["message"]
        assert http.get("/health").status_code == 200
    with pytest.raises(pic.ContextLengthError, match="refused without tokenizing"):
        engine.link([], "x " * 1_000_000)


def _fuzz_value(rng: random.Random, depth: int = 0) -> object:
    """A random JSON-ish value: wrong types, odd numbers, long or broken strings, nested junk."""
    choices = [
        lambda: None, lambda: rng.choice([True, False]), lambda: rng.randint(-(2**70), 2**70),
        lambda: rng.choice([0, -1, 1, 2**63, 2**64, 4.0, -0.0, 1e308, 1e-308]),
        lambda: rng.choice(["", " ", "x", "One day", "\ud800", "a\udfffb", "\x00", "é" * 50, "{documents}"]),
        lambda: "".join(chr(rng.randrange(0x20, 0x3000)) for _ in range(rng.randint(0, 40))),
        lambda: "word " * rng.randint(0, 3000),
        lambda: [_fuzz_value(rng, depth + 1) for _ in range(rng.randint(0, 4))] if depth < 2 else [],
        lambda: {rng.choice(["role", "content", "x", "cache_ids"]): _fuzz_value(rng, depth + 1)} if depth < 2 else {},
    ]  # fmt: skip
    return rng.choice(choices)()


FUZZ_FIELDS = (
    "model", "prompt", "messages", "documents", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "top_k", "seed", "stop", "n", "stream", "stream_options", "logprobs", "echo", "tools", "pic", "policy", "user",
)  # fmt: skip


def _fuzz_request(rng: random.Random, ids: list[str]) -> tuple[str, bytes]:
    """A route and a malformed body: random fields with random values over a mostly valid base, or raw bytes."""
    route = rng.choice(["/v1/completions", "/v1/chat/completions", "/v1/chunks"])
    if rng.random() < 0.1:  # not JSON at all, or broken encodings
        return route, rng.choice([b"", b"{", b"[]", b"null", b'"x"', b"\xff\xfe{}", b'{"prompt": "\xc3"}', b"{" * 300])
    # A valid body of the route (a field of another route is an unknown field: a 400 of its own).
    sampling = {"model": "stories260K", "max_tokens": 2, "temperature": 0}
    base = {
        "/v1/completions": {**sampling, "prompt": "One day"},
        "/v1/chat/completions": {**sampling, "messages": [{"role": "user", "content": "hi"}]},
        "/v1/chunks": {"documents": ["A short story."]},
    }[route]
    if rng.random() < 0.5:
        base["pic"] = {"cache_ids": ids[:1], rng.choice(["policy", "prefix", "documents", "bogus"]): _fuzz_value(rng)}
    for field in rng.sample(FUZZ_FIELDS, rng.randint(1, 4)):
        base[field] = _fuzz_value(rng)
    text = json.dumps(base, allow_nan=rng.random() < 0.5)
    return route, text.encode("utf-8", "surrogatepass")


def test_fuzzed_malformed_requests_never_get_a_500_or_break_the_server(server):
    """Issue 21: 600 seeded malformed requests (types, encodings, sizes, unknown fields, lone surrogates) over
    one keep-alive connection: never a 500, never a hang or a reset connection; the server stays healthy and
    its KV pool ends as it began."""
    engine = server[1]
    ids = _compile(server, DOCS)
    baseline = engine.kv_stats().num_used_blocks
    rng = random.Random(21)
    statuses: collections.Counter[int] = collections.Counter()
    with _http(server) as http:
        for i in range(600):
            route, body = _fuzz_request(rng, ids)
            response = http.post(route, content=body, headers={"content-type": "application/json"}, timeout=60)
            statuses[response.status_code] += 1
            assert response.status_code < 500, (i, route, body[:300], response.text[:300])
            if response.status_code >= 400:
                assert "error" in response.json(), (i, response.text[:300])
        assert http.get("/health").status_code == 200
    assert engine.kv_stats().num_used_blocks == baseline
    assert sum(n for code, n in statuses.items() if code >= 400) > 300, statuses  # mostly refused, as meant


def test_the_order_a_request_asks_runs_and_the_usage_reports_it(server, client):
    """``pic.order``: given keeps ``cache_ids`` then ``documents`` as sent, relevance follows ``pic.relevance``;
    the usage says which ran (``pic_order``, ``pic_chunk_order``) and the text is ``link``'s in that order; an
    unknown order is a 400 naming it."""
    engine = server[1]
    ids = _compile(server, DOCS)
    for order, relevance in (("given", None), ("relevance", [0.9, 0.1, 0.5])):
        options = {"cache_ids": ids, "order": order} | ({"relevance": relevance} if relevance else {})
        expected = engine.link(ids, QUERY, order=order, relevance=relevance).generate(max_new_tokens=8)
        out = client.completions.create(
            model="stories260K", prompt=QUERY, max_tokens=8, temperature=0, extra_body={"pic": options}
        )
        usage = out.usage.model_extra
        assert out.choices[0].text == expected.text
        assert usage["pic_order"] == order
        assert usage["pic_chunk_order"] == ([0, 1, 2] if order == "given" else [1, 2, 0])
        assert usage["pic_policy"] == expected.stats.policy and expected.stats.policy is not None
        assert usage["pic_recomputed_chunks"] == list(expected.stats.recomputed_whole)
    with _http(server) as http:
        body = {"model": "stories260K", "prompt": QUERY, "pic": {"cache_ids": ids, "order": "shuffled"}}
        response = http.post("/v1/completions", json=body)
    assert response.status_code == 422 and "shuffled" in response.text and "order" in response.text
