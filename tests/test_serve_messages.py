"""What ``pic serve``'s errors say, in the client's words rather than Python's or pydantic's (issue 51, items 2 and
5): a string where a list goes, a missing field, a chat on a model without a chat template, malformed JSON, the
path of a bad list item, a refused ``tools`` value. Each against a real server, with httpx or the ``openai``
client."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import httpx
import openai
import pytest

import pic
from pic.serve.app import build_app
from tests.models import QUERY, model, tokenizer
from tests.serving import free_port, serving
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


# Issue 67, items 6, 8, 9, 10 and 13 (the server's parts).


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--kv-pool-tokens", "10"], "argument --kv-pool-tokens: 10 tokens may not hold the start-up check"),
        (["--dtype", "bf16"], "argument --dtype: dtype 'bf16' is not one of float32, float16, bfloat16, auto"),
        (["--device", "gpu"], "argument --device: device 'gpu' is not a torch device"),
        (
            ["--device", "cpu", "--decode-weights", "int8", "--dtype", "float16"],
            "--decode-weights int8 needs a float32",
        ),
        (["--disk-path", "{file}/chunks", "--disk-bytes", "1G"], "argument --disk-path: "),
    ],
)
def test_a_bad_serve_flag_is_an_argparse_error_naming_it_before_the_model_loads(flags, named, tmp_path):
    """Item 6: ``--kv-pool-tokens 10`` failed after the load (exit 1) naming ``PICConfig.kv_pool_tokens``;
    ``--dtype bf16`` exited 1. Each is a usage error naming the flag (exit 2) before the model loads: the model named
    does not exist, and a load would have said so (exit 1, "cannot load model") first."""
    file = tmp_path / "a-file"
    file.write_text("not a folder")
    flags = [flag.format(file=file) for flag in flags]
    argv = [sys.executable, "-m", "pic", "serve", "--port", str(free_port()), "--model", str(tmp_path / "no-model")]
    done = subprocess.run([*argv, *flags], capture_output=True, text=True, timeout=600)  # a bound, not a measurement
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "pic serve: error: " in done.stderr and named in done.stderr, done.stderr
    assert "cannot load model" not in done.stderr and "PICConfig" not in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and done.stdout == "", done.stdout


def test_the_pool_floor_holds_the_start_up_check_of_the_served_model():
    """Item 6's floor is no guess: a pool of that size passes the start-up check of the served model, and the
    flag's floor is above what that model's check needs (its tokens are fewer than the texts' characters)."""
    from pic.check import check
    from pic.serve.model_flags import CHECK_NEW_TOKENS, check_pool_tokens

    floor = check_pool_tokens(pic.PICConfig().block_size)
    engine = pic.PIC(model(MODEL), tokenizer(), config=pic.PICConfig(kv_pool_tokens=floor))
    try:
        assert check(engine, num_new_tokens=CHECK_NEW_TOKENS).passed
    finally:
        engine.close()


def test_a_pool_the_start_up_check_does_not_fit_is_said_naming_the_flag(monkeypatch, capsys):
    """Item 6, after the load: a pool over the floor that the check still does not fit (a tokenizer finer than bytes;
    here the floor lowered) is an error naming ``--kv-pool-tokens``, not ``PICConfig.kv_pool_tokens`` alone."""
    import uvicorn as uvicorn_module

    from pic.cli import main
    from pic.serve import model_flags

    monkeypatch.setattr(model_flags, "check_pool_tokens", lambda block_size: 0)
    monkeypatch.setattr(uvicorn_module.Server, "run", lambda server, sockets=None: pytest.fail("served"))
    assert main(["serve", "--port", str(free_port()), "--kv-pool-tokens", "32"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pic: error: --kv-pool-tokens 32: the start-up check does not fit (KV pool too small"), err
    assert "pass a larger --kv-pool-tokens" in err, err


def _chat(http: httpx.Client, messages: list[dict]) -> dict:
    answer = http.post("/v1/chat/completions", json={**CHAT, "messages": messages, "temperature": 0, "max_tokens": 6})
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_text_content_parts_are_read_in_every_role_as_vllm_joins_them(server):
    """Item 8: ``"content": [{"type": "text", "text": ...}]`` (what the ``openai`` and LangChain clients send) got a
    422 "Input should be a valid string". The text parts are the message's text joined by a newline, as vLLM joins
    them, in system, user and assistant messages alike: the same prompt, and the same greedy answer, as the string."""
    as_strings = [
        {"role": "system", "content": "Be brief.\nTell stories."},
        {"role": "user", "content": "Tell me\na story."},
        {"role": "assistant", "content": "Once upon a time."},
        {"role": "user", "content": "Another\none."},
    ]
    as_parts = [
        {"role": m["role"], "content": [{"type": "text", "text": t} for t in m["content"].split("\n")]}
        for m in as_strings
    ]
    with _http(server[0]) as http:
        strings, parts = _chat(http, as_strings), _chat(http, as_parts)
    assert parts["usage"]["prompt_tokens"] == strings["usage"]["prompt_tokens"]
    assert parts["choices"][0]["message"] == strings["choices"][0]["message"]
    client = openai.OpenAI(base_url=f"{server[0]}/v1", api_key=KEY, max_retries=0)
    reply = client.chat.completions.create(model=MODEL, messages=as_parts, max_tokens=6, temperature=0)
    assert reply.choices[0].message.content == strings["choices"][0]["message"]["content"]


@pytest.mark.parametrize(
    ("part", "kind"),
    [
        ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "image_url"),
        ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "input_audio"),
    ],
)
def test_a_content_part_of_another_type_is_refused_by_its_type(server, part, kind):
    """Item 8: a part this server cannot read is a 400 naming its type and where it is, not text silently dropped."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text"}, part]}]
    messages[1]["content"][0]["text"] = "What is in the picture?"
    with _http(server[0]) as http:
        error = _error(http.post("/v1/chat/completions", json={**CHAT, "messages": messages}), 400)
    assert error["param"] == "messages[1].content[1]", error
    assert error["message"].startswith(f"messages[1].content[1] is a content part of type {kind!r}: "), error
    assert "reads text parts only" in error["message"], error


def test_a_content_part_that_is_not_a_text_part_is_named(server):
    """Item 8: a part without its text (or not an object) is a 422 naming the message's content and the part."""
    bad = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text"}]}]
    with _http(server[0]) as http:
        error = _error(http.post("/v1/chat/completions", json={**CHAT, "messages": bad}), 422)
    assert error["param"] == "messages[0].content", error
    assert "content part 1 is not a text part" in error["message"], error


def test_the_schema_says_content_is_a_string_or_text_parts(server):
    """Item 8: ``/openapi.json`` says what the route reads, so a generated client sends parts too."""
    with _http(server[0]) as http:
        schema = http.get("/openapi.json").json()
    content = schema["components"]["schemas"]["ChatMessage"]["properties"]["content"]
    assert content["anyOf"][0] == {"type": "string"}, content
    part = content["anyOf"][1]["items"]
    assert part["properties"]["type"] == {"const": "text"} and part["required"] == ["type", "text"], content


def test_a_body_that_is_not_utf8_is_named_with_the_byte(server):
    """Item 9: invalid UTF-8 answered "There was an error parsing the body"; it names UTF-8 and the byte offset."""
    head = b'{"model": "stories260K", "prompt": "Tom'
    body = head + b'\xff\xfe"}'
    with _http(server[0]) as http:
        error = _error(http.post("/v1/completions", content=body, headers={"content-type": "application/json"}), 400)
    assert error["message"].startswith(f"the request body is not valid UTF-8 at byte {len(head)} (0xff)"), error


def test_a_body_over_the_limit_names_the_flag(server):
    """Item 10: a 9 MB body's 413 named the limit but not ``--max-body-bytes``, which sets it."""
    body = json.dumps({**COMPLETION, "prompt": "x" * (9 << 20)}).encode()
    with _http(server[0]) as http:
        error = _error(http.post("/v1/completions", content=body, headers={"content-type": "application/json"}), 413)
    assert f"over the limit of {8 << 20} bytes" in error["message"] and "--max-body-bytes" in error["message"], error


def _requests_by_route(http: httpx.Client) -> dict[str, float]:
    """``pic_http_requests_total`` summed over statuses, by route."""
    counts: dict[str, float] = {}
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("pic_http_requests_total{"):
            route = line.split('route="', 1)[1].split('"', 1)[0]
            counts[route] = counts.get(route, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def test_the_schema_and_docs_pages_are_counted_under_their_own_paths(server):
    """Item 13: ``/openapi.json`` and ``/docs`` were counted as ``route="unmatched"`` in ``/metrics``."""
    with _http(server[0]) as http:
        before = _requests_by_route(http)
        for path in ("/openapi.json", "/docs", "/redoc"):
            assert http.get(path).status_code == 200
        after = _requests_by_route(http)
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert after.get(path, 0) - before.get(path, 0) == 1, (path, after)
    assert after.get("unmatched", 0) == before.get("unmatched", 0), after


def test_a_completion_links_a_chunk_compiled_for_a_chat_only_after_that_chat_context(server):
    """Item 13: chunks compiled for a chat's context (``POST /v1/chunks`` with ``system``) were linked by
    ``/v1/completions`` without a word. One rule for every route (docs/security.md): a chunk compiled in context links
    only after that context; a completion without it is refused naming the chunk, as a chat with another system
    prompt is, and one whose ``pic.prefix`` is that context links it."""
    url, engine = server
    system = "Answer in one word."
    with _http(url) as http:
        compiled = http.post("/v1/chunks", json={"documents": ["The Elbe flows north to the sea."], "system": system})
        assert compiled.status_code == 200, compiled.text
        (cid,) = compiled.json()["cache_ids"]
        plain = _error(http.post("/v1/completions", json={**COMPLETION, "pic": {"cache_ids": [cid]}}), 400)
        other = [{"role": "system", "content": "Be verbose."}, *MESSAGES]
        chat = _error(
            http.post("/v1/chat/completions", json={**CHAT, "messages": other, "pic": {"cache_ids": [cid]}}), 400
        )
        context = engine.chat_context([{"role": "system", "content": system}])
        after = http.post("/v1/completions", json={**COMPLETION, "pic": {"cache_ids": [cid], "prefix": context}})
        same = http.post(
            "/v1/chat/completions",
            json={**CHAT, "messages": [{"role": "system", "content": system}, *MESSAGES], "pic": {"cache_ids": [cid]}},
        )
    for error in (plain, chat):
        assert error["message"].startswith(f"chunk {cid} was compiled after a context of "), error
        assert "links only after that context" in error["message"], error
    assert after.status_code == 200 and same.status_code == 200, (after.text, same.text)
