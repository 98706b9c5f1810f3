"""What a fuzzer found in ``pic serve`` (issue: HTTP strictness): misplaced fields silently ignored, vanishing
temperatures sampling token 0, an ``/openapi.json`` that did not match the server, 405s without ``Allow``.
(The read deadlines: tests/test_serve_deadlines.py.)"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

import pic
from pic.serve.app import build_app
from tests.models import QUERY, model
from tests.serving import serving
from tests.test_chat import CHATML, chat_tokenizer

KEY = "strict-key"
MODEL = "stories260K"


def served_app(**options):
    """stories260K (with a chat template) in ``pic serve``'s app, behind ``KEY``."""
    engine = pic.PIC(model(MODEL), chat_tokenizer(CHATML))
    return engine, build_app(engine, model_name=MODEL, api_key=KEY, **options)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, pic.PIC]]:
    engine, app = served_app()
    with serving(app) as url:
        yield url, engine


def _http(server) -> httpx.Client:
    return httpx.Client(base_url=server[0], headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": QUERY, "max_tokens": 4}


@pytest.mark.parametrize(
    ("route", "body", "param", "named"),
    [
        ("/v1/completions", {**COMPLETION, "documents": ["x"]}, "documents", 'go under "pic": {"documents": [...]}'),
        ("/v1/chat/completions", {**CHAT, "cache_ids": ["x"]}, "cache_ids", '"pic": {"cache_ids": [...]}'),
        ("/v1/completions", {**COMPLETION, "policy": "mepic"}, "policy", '"pic": {"policy": "..."}'),
        ("/v1/completions", {**COMPLETION, "temprature": 0}, "temprature", "not a parameter of /v1/completions"),
        ("/v1/completions", {**COMPLETION, "messages": []}, "messages", "go to /v1/chat/completions"),
        ("/v1/chat/completions", {**CHAT, "prompt": "x"}, "prompt", "a prompt goes to /v1/completions"),
    ],
)
def test_an_unknown_top_level_field_is_a_400_naming_its_place(server, route, body, param, named):
    """A top-level ``documents`` was silently ignored: the answer never saw the documents."""
    with _http(server) as http:
        response = http.post(route, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert f"unknown field {param!r}" in error["message"] and named in error["message"], error
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_openai_parameters_that_clients_send_are_accepted(server):
    """What the ``openai`` client and LangChain's ``ChatOpenAI`` send (``user``, ``metadata``, ``store``,
    ``n``, ``stream_options``, ``logprobs: false`` ...) is accepted and ignored; a value that asks for something
    the server does not do stays a 400."""
    client = openai.OpenAI(base_url=f"{server[0]}/v1", api_key=KEY, max_retries=0)
    harmless = {
        "user": "u-1", "metadata": {"team": "a"}, "store": False, "service_tier": "auto", "n": 1,
        "parallel_tool_calls": False, "prompt_cache_key": "k", "safety_identifier": "s", "logprobs": False,
        "modalities": ["text"], "frequency_penalty": 0.0, "presence_penalty": 0.0,
    }  # fmt: skip
    greedy = client.chat.completions.create(messages=CHAT["messages"], model=MODEL, max_tokens=6, temperature=0)
    out = client.chat.completions.create(
        messages=CHAT["messages"], model=MODEL, max_tokens=6, temperature=0, **harmless
    )
    assert out.choices[0].message.content == greedy.choices[0].message.content
    stream = client.chat.completions.create(
        messages=CHAT["messages"], model=MODEL, max_completion_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}, user="u-1",
    )  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == greedy.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 6
    # LangChain's ChatOpenAI: its default parameters, a message with a name
    langchain = {
        "model": MODEL, "stream": False, "n": 1, "temperature": 0.7, "max_completion_tokens": 4, "logprobs": False,
        "messages": [{"role": "user", "content": "Tell me a story.", "name": "bob"}],
    }  # fmt: skip
    with _http(server) as http:
        assert http.post("/v1/chat/completions", json=langchain).status_code == 200
        completion = http.post("/v1/completions", json={**COMPLETION, "user": "u", "echo": False, "best_of": 1})
        assert completion.status_code == 200, completion.text
        asked = http.post("/v1/completions", json={**COMPLETION, "presence_penalty": False, "modalities": ["audio"]})
        assert asked.status_code == 400 and "presence_penalty=False, modalities=['audio']" in asked.text


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 5e-324}, {"temperature": 1e-45}, {"temperature": 1e-40}, {"top_p": 1e-300, "top_k": 1}],
    ids=["temperature-5e-324", "temperature-1e-45", "temperature-1e-40", "top_p-1e-300"],
)
def test_a_vanishing_temperature_or_top_p_is_greedy(server, sampling):
    """float32 made these 0 (or the logits over them inf): every token was id 0. They are greedy now."""
    engine = server[1]
    expected = engine.link([], QUERY).generate(max_new_tokens=8)
    with _http(server) as http:
        response = http.post("/v1/completions", json={**COMPLETION, "max_tokens": 8, "seed": 1, **sampling})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == expected.text


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("PUT", "/v1/completions", "POST"),
        ("GET", "/v1/chat/completions", "POST"),
        ("POST", "/health", "GET"),
        ("OPTIONS", "/v1/chunks/abc", "DELETE, GET"),
        ("PATCH", "/v1/chunks", "POST"),
    ],
)
def test_a_405_names_the_allowed_methods(server, method, path, allow):
    """A 405 without ``Allow`` (and one naming only GET where DELETE works too) broke HTTP's contract."""
    with _http(server) as http:
        response = http.request(method, path)
    assert response.status_code == 405
    assert response.headers["allow"] == allow
    assert response.json()["error"]["code"] == 405


def test_openapi_declares_what_the_server_answers(server):
    """Each route's statuses with OpenAI's error shape, the event stream, /metrics as text, strict integers."""
    with _http(server) as http:
        raw = http.get("/openapi.json").text
    spec = json.loads(raw)
    paths, schemas = spec["paths"], spec["components"]["schemas"]
    statuses = {path: {m: sorted(op["responses"]) for m, op in ops.items()} for path, ops in paths.items()}
    work = ["200", "400", "401", "404", "408", "413", "422", "500", "503"]
    assert statuses["/v1/completions"]["post"] == work
    assert statuses["/v1/chat/completions"]["post"] == work
    assert statuses["/v1/chunks"]["post"] == ["200", "400", "401", "408", "413", "422", "500", "503"]
    assert statuses["/v1/chunks/{cache_id}"] == {
        m: ["200", "401", "404", "408", "413", "500", "503"] for m in ("get", "delete")
    }
    assert statuses["/health"]["get"] == ["200", "408", "413"]
    for ops in paths.values():
        for op in ops.values():
            for status, answer in op["responses"].items():
                if status != "200":
                    assert answer["content"] == {
                        "application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}
                    }
    assert schemas["ErrorDetail"]["required"] == ["message", "type", "param", "code"]
    assert set(paths["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert set(paths["/v1/completions"]["post"]["responses"]["200"]["content"]) == {
        "application/json",
        "text/event-stream",
    }
    body = schemas["CompletionBody"]
    assert body["additionalProperties"] is False and "documents" not in body["properties"]
    assert body["properties"]["logprobs"]["enum"] == [None, False, 0] and "user" in body["properties"]
    seed = body["properties"]["seed"]["anyOf"][0]
    assert seed["type"] == "integer" and '"exclusiveMaximum": 18446744073709551616' in raw.replace(":18", ": 18")
    assert body["properties"]["max_tokens"]["anyOf"][0] == {"type": "integer", "minimum": 0}  # 0: no token
    assert spec["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    assert "security" not in paths["/health"]["get"] and paths["/v1/models"]["get"]["security"] == [{"bearer": []}]
    assert "HTTPValidationError" not in schemas


def test_a_server_fault_is_a_json_500(server, monkeypatch):
    """A bug outside the engine's requests (here the store's describe) answers OpenAI's error body, not
    uvicorn's text/plain "Internal Server Error" the schema does not declare."""
    engine = server[1]

    def broken(cache_id, **_):
        raise RuntimeError("injected")

    monkeypatch.setattr(engine.store, "describe", broken)
    with _http(server) as http:
        response = http.get("/v1/chunks/abc")
    assert response.status_code == 500
    assert response.json()["error"] == {
        "message": "the request failed: RuntimeError: injected", "type": "server_error", "param": None, "code": 500,
    }  # fmt: skip
