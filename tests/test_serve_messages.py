"""What ``pic serve``'s errors say, in the client's words rather than Python's or pydantic's (issue 51, items 2 and
5): a string where a list goes, a missing field, a chat on a model without a chat template, malformed JSON, the
path of a bad list item, a refused ``tools`` value. Each against a real server, with httpx or the ``openai``
client."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

import pic
from pic.serve.app import build_app
from tests.models import QUERY, model, tokenizer
from tests.serving import serving
from tests.test_serve_strict import KEY, MODEL, served_app

MESSAGES = [{"role": "user", "content": "Tell me a story."}]
CHAT = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": QUERY, "max_tokens": 4}


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, pic.PIC]]:
    engine, app = served_app()
    with serving(app) as url:
        yield url, engine


def _http(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


@pytest.mark.parametrize(
    ("route", "body", "field"),
    [
        ("/v1/chat/completions", {**CHAT, "pic": {"documents": "The Elbe flows north."}}, "pic.documents"),
        ("/v1/chat/completions", {**CHAT, "pic": {"cache_ids": "0123abcd"}}, "pic.cache_ids"),
        ("/v1/completions", {**COMPLETION, "pic": {"documents": "The Elbe flows north."}}, "pic.documents"),
        ("/v1/completions", {**COMPLETION, "pic": {"cache_ids": "0123abcd"}}, "pic.cache_ids"),
        ("/v1/chunks", {"documents": "The Elbe flows north."}, "documents"),
    ],
)
def test_a_string_where_a_list_goes_is_a_4xx_naming_the_field(server, route, body, field):
    """Item 2 over HTTP: the field named by its path, in words (not pydantic's "Input should be a valid list"),
    saying to pass a list; nothing compiled."""
    before = sorted(server[1].store.ids())
    with _http(server[0]) as http:
        error = _error(http.post(route, json=body), 422)
    assert error["param"] == field, error
    assert error["message"].startswith(f"{field} is a string ("), error
    assert "not a list: pass a list ([" in error["message"] and "valid list" not in error["message"], error
    assert sorted(server[1].store.ids()) == before


def test_a_missing_field_is_named_without_echoing_the_body(server):
    """Item 5a: a body without ``model`` answered ``model={'messages': [...] (242 characters): Field required``,
    the body echoed as the model's value."""
    with _http(server[0]) as http:
        chat = _error(http.post("/v1/chat/completions", json={"messages": MESSAGES * 5}), 422)
        completion = _error(http.post("/v1/completions", json={"prompt": "x" * 500}), 422)
    assert chat["message"] == "model: a required field is missing" and chat["param"] == "model", chat
    assert completion["message"] == "model: a required field is missing", completion


def test_chat_on_a_model_without_a_chat_template_says_what_a_client_can_do():
    """Item 5b: the library's error pointed at ``PIC.link``, which no client of the server can call."""
    engine = pic.PIC(model(MODEL), tokenizer())  # stories260K's own tokenizer: no chat template
    with serving(build_app(engine, model_name=MODEL)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
        completion = client.completions.create(model=MODEL, prompt=QUERY, max_tokens=4)
    message = refused.value.body["message"]
    assert "has no chat template" in message and "--chat-template FILE" in message, message
    assert "/v1/completions" in message and "PIC.link" not in message, message
    assert completion.choices[0].text  # the route it points at serves


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded", "application/json"])
def test_malformed_json_says_where_whatever_its_content_type(server, content_type):
    """Item 5c: ``curl -d '{...,}'`` (no content-type, or the form type curl -d sends) was told its content-type
    was wrong, with no position; the body was read as JSON, and the JSON is what is wrong."""
    body = b'{"model": "stories260K",\n "prompt": "x",}'  # a trailing comma on line 2
    headers = {} if content_type is None else {"content-type": content_type}
    with _http(server[0]) as http:
        error = _error(http.post("/v1/completions", content=body, headers=headers), 400)
    with pytest.raises(json.JSONDecodeError) as parsed:  # where Python's json stops: line 2, column 16
        json.loads(body)
    where = f"line {parsed.value.lineno}, column {parsed.value.colno} (char {parsed.value.pos})"
    assert parsed.value.lineno == 2 and error["message"] == (
        f"the request body is malformed JSON: Expecting property name enclosed in double quotes at {where}"
    ), error


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/chunks", {"documents": ["a", 0]}, "pic.documents[1]"),
        ("/v1/chat/completions", {**CHAT, "pic": {"documents": ["a", 0]}}, "pic.documents[1]"),
        ("/v1/completions", {**COMPLETION, "pic": {"cache_ids": ["a", "b", 7]}}, "pic.cache_ids[2]"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ],
)
def test_a_bad_list_item_is_named_by_its_path(server, route, body, param):
    """Item 5d: a non-string document had ``"param": "0"``, the last part of its path."""
    param = param.removeprefix("pic.") if route == "/v1/chunks" else param  # /v1/chunks' documents are top-level
    with _http(server[0]) as http:
        error = _error(http.post(route, json=body), 422)
    assert error["param"] == param and error["message"].startswith(f"{param}="), error


def test_a_refused_tools_value_keeps_its_whole_message(server):
    """Item 5e: ``tools=[{'type': 'function', 'function': {'name: not supported`` was cut mid-value; a long
    value is now said by its kind and size, and the message is whole."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with _http(server[0]) as http:
        long = _error(http.post("/v1/chat/completions", json={**CHAT, "tools": tools}), 400)
        short = _error(http.post("/v1/completions", json={**COMPLETION, "logprobs": 5, "echo": True}), 400)
    assert long["message"] == "tools=[...] (1 item): not supported by this server (leave it out)", long
    assert long["param"] == "tools"
    assert short["message"] == "logprobs=5, echo=True: not supported by this server (leave them out)", short
