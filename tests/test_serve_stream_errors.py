"""A request that fails after its first token (issue 32): the client is told, not handed cut text.

The failure is injected into the engine's forward (``core.runner.forward`` of ``PIC.paused``) after a set
number of calls, so the request streams a few tokens and then fails the way a real forward error does: the
engine ends it with ``RequestOutput.error`` and goes on serving.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Iterator

import httpx
import openai
import pytest

import pic
from pic.errors import KVPoolExhaustedError
from pic.serve.app import build_app
from tests.models import QUERY, model
from tests.serving import serving
from tests.test_chat import CHATML, chat_tokenizer

# The failing forward's number: the prefill and two decodes run (three tokens), the third decode fails.
_GOOD_FORWARDS = 3
# Each injected failure, and the status, OpenAI error type and message it reaches the client with: a bug
# (any exception but a PicError) is the server's 500, naming the exception; a PicError has its own status.
_FAILURES = [
    pytest.param(RuntimeError("injected"), 500, "server_error", "the request failed: RuntimeError: injected", id="bug"),
    pytest.param(KVPoolExhaustedError("injected"), 503, "server_busy", "injected", id="pic-error"),
]


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, pic.PIC]]:
    """stories260K behind a real uvicorn server (no EOS: a generation runs until it fails or hits its
    ``max_tokens``); yields ``(base_url, engine)``."""
    engine = pic.PIC(model("stories260K"), chat_tokenizer(CHATML), config=pic.PICConfig(eos_token_ids=()))
    with serving(build_app(engine, model_name="stories260K")) as url:
        yield url, engine


@contextlib.contextmanager
def _forward_fails(engine: pic.PIC, error: Exception, *, after: int = _GOOD_FORWARDS) -> Iterator[None]:
    """Within the block, the engine's forwards after the first ``after`` raise ``error`` (set and undone
    while the engine is paused: no step sees half of it)."""
    calls = itertools.count()
    with engine.paused() as core:
        runner = core.runner
        forward = runner.forward

        def failing(seqs):
            if next(calls) >= after:
                raise error
            return forward(seqs)

        runner.forward = failing
    try:
        yield
    finally:
        with engine.paused():
            del runner.forward  # the class's method again


def _events(response: httpx.Response) -> list[str]:
    """The data of each server-sent event of ``response``, in order."""
    return [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]


@pytest.mark.parametrize(("error", "status", "kind", "message"), _FAILURES)
def test_a_stream_that_fails_after_its_first_token_ends_with_an_error_event_not_done(
    served, error, status, kind, message
):
    url, engine = served
    body = {"model": "stories260K", "prompt": QUERY, "max_tokens": 8, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}  # a failed stream sends no usage either
    with _forward_fails(engine, error), httpx.Client(base_url=url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200  # the failure came after the headers
            events = _events(response)
    assert "[DONE]" not in events  # no pretending it succeeded
    *chunks, last = [json.loads(event) for event in events]
    assert any(chunk["choices"][0]["text"] for chunk in chunks)  # it had streamed text before failing
    assert all("error" not in chunk and chunk["choices"][0]["finish_reason"] is None for chunk in chunks)
    assert last == {"error": {"message": message, "type": kind, "param": None, "code": status}}


def test_the_openai_client_raises_on_a_chat_stream_that_fails_midway(served):
    url, engine = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    pieces = []
    with _forward_fails(engine, RuntimeError("injected")), pytest.raises(openai.APIError) as failed:
        stream = client.chat.completions.create(
            model="stories260K", messages=[{"role": "user", "content": QUERY}], max_tokens=8, temperature=0,
            stream=True,
        )  # fmt: skip
        for chunk in stream:
            pieces.append(chunk.choices[0].delta.content or "")
    assert "".join(pieces)  # the text it had sent, which the exception says is cut
    # The error event itself (a connection cut short, also an APIError, has no body).
    message = "the request failed: RuntimeError: injected"
    assert failed.value.message == message
    assert failed.value.body == {"message": message, "type": "server_error", "param": None, "code": 500}


@pytest.mark.parametrize(("error", "status", "kind", "message"), _FAILURES)
def test_a_completion_that_fails_midway_gets_its_error_status(served, error, status, kind, message):
    url, engine = served
    body = {"model": "stories260K", "prompt": QUERY, "max_tokens": 8, "temperature": 0}
    with _forward_fails(engine, error), httpx.Client(base_url=url, timeout=60) as http:
        response = http.post("/v1/completions", json=body)
    assert response.status_code == status
    assert response.json() == {"error": {"message": message, "type": kind, "param": None, "code": status}}
