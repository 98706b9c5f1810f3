"""What a new user still tripped on (issue 58, items 2, 3 and 5-10), and a trial of 20 mistakes a new user makes,
each of which must get a message naming the fix.

Each item's test failed on a8ee9f6 with the message the issue quotes; the trial runs the Python API, the HTTP API
(``pic serve``'s app, with httpx's TestClient and the ``openai`` client on a real server) and the command line.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from fastapi.testclient import TestClient

import pic
from pic.cli import main
from tests.serving import serving
from tests.test_serve_strict import KEY, MODEL, served_app

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["Tom had a big red ball. He liked to kick it in the park.", "Lily loved to sing a happy song."]
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 2}


@pytest.fixture(scope="module")
def engine() -> Iterator[pic.PIC]:
    with pic.PIC.from_pretrained(pic.EMBEDDED_MODEL) as engine:
        yield engine


@pytest.fixture(scope="module")
def ids(engine) -> list[str]:
    return engine.compile(DOCS)


@pytest.fixture(scope="module")
def app():
    engine, app = served_app()
    yield app
    engine.close()


@pytest.fixture(scope="module")
def client(app) -> TestClient:
    return TestClient(app, headers={"Authorization": f"Bearer {KEY}"})


def _raised(call: Callable[[], object]) -> pic.PicError:
    with pytest.raises(pic.PicError) as raised:
        call()
    return raised.value


def _refused(response, status: int) -> str:
    assert response.status_code == status, response.text
    return response.json()["error"]["message"]


# -- the items -----------------------------------------------------------------------------------------


def test_item_2_a_pic_eval_spec_in_python_says_what_it_means_there(engine, ids):
    """``naive@context`` is ``pic eval``'s way to say "naive over chunks compiled in context": in Python the
    message says how (a8ee9f6: ``unknown policy 'naive@context'`` and the registered names, nothing else)."""
    message = str(_raised(lambda: engine.link(ids, "Tom", policy="naive@context")))
    assert "pic eval" in message and "context=" in message and "policy='naive'" in message, message
    message = str(_raised(lambda: engine.link(ids, "Tom", policy="auto:0.05@context/relevance")))
    assert "policy='auto:0.05', order='relevance'" in message, message
    assert "did you mean 'legolink'" in str(_raised(lambda: engine.link(ids, "Tom", policy="legolnk:16")))
    guide = re.sub(r"```.*?```", "", (ROOT / "docs" / "policies.md").read_text(), flags=re.S)
    first = guide.index("@context`")  # the page's first such spec says what the notation is
    assert "pic eval" in guide[first - 300 : first + 300], guide[first - 300 : first + 300]


def _policy_rows(page: Path, header: str) -> set[str]:
    """The policy names in the first column of the table under ``header`` (a line that starts it)."""
    lines = page.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(line.split("|")[1])
    return {m.group(1) for row in rows for m in re.finditer(r"`\"?([a-z0-9]+)", row)}


def _is_pics(name: str) -> bool:
    """Whether policy ``name`` is one of pic's own (another test may have registered its own in this process)."""
    try:
        return type(pic.policies.resolve(name)).__module__.startswith("pic.")
    except pic.PicError:  # someone's policy that needs an argument
        return False


def test_item_3_every_built_in_policy_is_in_the_policy_tables():
    """``suffix`` was in ``pic demo``'s output and every "registered:" list but in no policy table (a8ee9f6)."""
    built_in = {name for name in pic.policies.available() if _is_pics(name)}
    readme = _policy_rows(ROOT / "README.md", "| spec | recomputes |")
    guide = _policy_rows(ROOT / "docs" / "policies.md", "| spec | object |")
    assert not built_in - readme, f"README's policy table lacks {sorted(built_in - readme)}"
    assert not built_in - guide, f"docs/policies.md's table lacks {sorted(built_in - guide)}"


def test_item_5_the_hint_for_messages_is_a_message_that_works(client):
    """``"messages": "hi"`` was told ``['hi']``, which is a second 422; the hint is now a message object, and
    sending it as shown works."""
    message = _refused(client.post("/v1/chat/completions", json={**CHAT, "messages": "hi"}), 422)
    shown = json.loads(re.search(r"pass a list \((\[.*\]) for one\)", message).group(1))
    assert shown == [{"role": "user", "content": "hi"}], message
    assert client.post("/v1/chat/completions", json={**CHAT, "messages": shown}).status_code == 200
    message = _refused(client.post("/v1/chat/completions", json={**CHAT, "messages": ["hi"]}), 422)
    assert '{"role": "user", "content": "hi"}' in message, message


def test_item_6_an_unknown_key_under_pic_gets_a_did_you_mean_and_the_fields(client):
    message = _refused(client.post("/v1/chat/completions", json={**CHAT, "pic": {"docs": ["The Elbe."]}}), 422)
    assert "did you mean 'documents'" in message and "cache_ids, documents, policy" in message, message
    message = _refused(client.post("/v1/chunks", json={"documents": ["x"], "polcy": "naive"}), 422)
    assert "did you mean 'policy'" in message, message


def test_item_7_a_link_longer_than_the_context_names_the_fix(engine, ids):
    """a8ee9f6: ``linked prompt has 1360 tokens, more than the 512-token context``, and nothing about what to do."""
    long = engine.compile(["Tom had a big red ball. " * 40, "Lily sang. " * 60])
    error = _raised(lambda: engine.link([*long, *ids], "Tom"))
    message = str(error)
    assert isinstance(error, pic.ContextLengthError) and "fewer or shorter chunks" in message, message
    assert f"the largest: {long[0][:12]}" in message, message  # the largest chunk first
    error = _raised(lambda: engine.link(ids, "Tom had a big red ball. " * 100))
    assert "the query and prefix alone" in str(error), error


@pytest.mark.parametrize("stop", [5, 5.0, {"stop": "x"}])
def test_item_8_a_stop_of_the_wrong_type_says_what_it_takes(engine, ids, stop):
    """a8ee9f6: ``stop=5: Input should be a valid tuple`` (pydantic's words; users pass a string or a list)."""
    with engine.link(ids, "Tom") as linked:
        message = str(_raised(lambda: linked.generate(max_new_tokens=2, stop=stop)))
    assert "a string or a list of strings" in message and "tuple" not in message, message


def test_item_9_one_temperature_rule_said_in_python_and_over_http(engine, ids, client):
    """OpenAI's range is 0 to 2: ``temperature=5`` was taken in Python and a 422 over HTTP (a8ee9f6)."""
    with engine.link(ids, "Tom") as linked:
        python = str(_raised(lambda: linked.generate(max_new_tokens=2, temperature=5)))
        assert linked.generate(max_new_tokens=2, temperature=2.0, seed=1).stats.num_generated_tokens == 2
    http = _refused(client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "temperature": 5}), 422)
    words = "temperature=5: Input should be less than or equal to 2"
    assert words in python and words in http, (python, http)


def test_item_10_no_transformers_warning_before_pics_own_error(engine, capfd, caplog):
    """transformers' "Token indices sequence length is longer than the specified maximum" came before pic's
    ``ContextLengthError`` for a long document (a8ee9f6)."""
    error = _raised(lambda: engine.compile(["Tom had a big red ball. " * 120]))
    assert isinstance(error, pic.ContextLengthError) and "split it" in str(error)
    printed = capfd.readouterr()
    said = printed.err + printed.out + caplog.text
    assert "Token indices sequence length" not in said, said


def test_item_10_progress_to_a_file_is_whole_lines(engine, capsys):
    """A progress bar on a file (a server's log) was a pile of carriage-return redraws (a8ee9f6); there it is a
    line at its start, one per quarter and one at its end."""
    engine.compile([f"Story {i}: Tom had a ball." for i in range(12)], progress=True)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("pic compile")]
    assert "\r" not in err and 2 <= len(lines) <= 6 and "12/12" in lines[-1], repr(err)


def test_item_10_a_conversion_to_a_file_is_whole_lines():
    """The bar a GGUF conversion shows (``Stages``: its clock redrawn every ``tick_s``) on a file is a line per step,
    not a carriage-return redraw per tick."""
    import io
    import time

    from pic.model.stages import Stages

    log = io.StringIO()
    with Stages("converting x", total=2, tick_s=0.02, file=log) as stages:
        stages.begin("reading")
        time.sleep(0.1)  # five ticks
        stages.begin("saving")
    text = log.getvalue()
    # the start, each step with its name, the end: not a line per tick
    assert "\r" not in text and text.count("\n") == 4 and "step 1/2 done [00:00], saving" in text, repr(text)


def test_item_10_a_wrong_route_names_the_nearest(client):
    message = _refused(client.post("/v1/chat/completion", json=CHAT), 404)
    assert "did you mean POST /v1/chat/completions" in message, message


def test_item_10_a_wrong_base_url_in_the_openai_client_names_the_route(app):
    """The ``openai`` client with ``/v1/chat`` as its base URL posts to ``/v1/chat/chat/completions``."""
    with serving(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1/chat", api_key=KEY, max_retries=0)
        with pytest.raises(openai.NotFoundError) as raised:
            client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=2)
    assert "did you mean POST /v1/chat/completions" in str(raised.value), raised.value


def test_item_10_a_misspelled_flag_gets_a_did_you_mean(capsys):
    """a8ee9f6: ``pic: error: unrecognized arguments: --polcy naive``."""
    with pytest.raises(SystemExit) as done:
        main(["serve", "--polcy", "naive"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "pic serve: error:" in err and "--polcy (did you mean --policy?)" in err, err


# -- the trial ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mistake:
    """One mistake: what a new user does (``run``: the message it gets) and what the message must name."""

    what: str
    run: Callable[[dict], str]
    fix: str  # a regular expression the message matches when it names the fix


def _python(call: Callable[[dict], object]) -> Callable[[dict], str]:
    def run(ctx: dict) -> str:
        return str(_raised(lambda: call(ctx)))

    return run


def _http(method: str, path: str, body: dict, status: int) -> Callable[[dict], str]:
    def run(ctx: dict) -> str:
        return _refused(ctx["client"].request(method, path, json=body), status)

    return run


def _cli(*argv: str) -> Callable[[dict], str]:
    def run(ctx: dict) -> str:
        with pytest.raises(SystemExit) as done:
            main(list(argv))
        assert done.value.code == 2
        return ctx["capsys"].readouterr().err

    return run


def _no_engine(ctx: dict) -> object:
    ctx["monkeypatch"].setattr(pic, "_default_engine", None)
    return pic.link(["0" * 32], "Tom")


def _used_twice(ctx: dict) -> object:
    linked = ctx["engine"].link(ctx["ids"], "Tom")
    linked.generate(max_new_tokens=1)
    return linked.generate(max_new_tokens=1)


MISTAKES = [
    Mistake("pic.link before pic.load", _python(_no_engine), r"call pic\.load\(\.\.\.\) first"),
    Mistake("a misspelled policy", _python(lambda c: c["engine"].link(c["ids"], "Tom", policy="legolnk:16")),
            r"did you mean 'legolink'"),
    Mistake("pic eval's spec in Python", _python(lambda c: c["engine"].link(c["ids"], "Tom", policy="naive@context")),
            r"context=.*policy='naive'"),
    Mistake("one cache id where the list goes", _python(lambda c: c["engine"].link(c["ids"][0], "Tom")),
            r"pass a list of cache ids \(\['[0-9a-f]{32}'\] for one\)"),
    Mistake("a cache id cut short as a page prints it", _python(lambda c: c["engine"].link([c["ids"][0][:8]], "Tom")),
            r"a cache id is 32 hex digits, the whole id compile returned"),
    Mistake("bytes as a document", _python(lambda c: c["engine"].compile(b"Tom had a ball.")),
            r"decode it first"),
    Mistake("a misspelled config field", _python(lambda c: pic.PICConfig(blok_size=16)),
            r"did you mean 'block_size'"),
    Mistake("stop=5", _python(lambda c: c["engine"].link(c["ids"], "Tom").generate(stop=5)),
            r"a string or a list of strings"),
    Mistake("temperature=5", _python(lambda c: c["engine"].link(c["ids"], "Tom").generate(temperature=5)),
            r"less than or equal to 2"),
    Mistake("a linked prompt over the context",
            _python(lambda c: c["engine"].link(c["engine"].compile(["Lily sang. " * 60] * 2 + DOCS), "Tom")),
            r"link fewer or shorter chunks .*the largest: [0-9a-f]{32}"),
    Mistake("a document over the context", _python(lambda c: c["engine"].compile(["Tom had a big red ball. " * 120])),
            r"split it into smaller chunks"),
    Mistake("generating twice from one link", _python(_used_twice), r"link it again"),
    Mistake("an order that does not exist", _python(lambda c: c["engine"].link(c["ids"], "Tom", order="last")),
            r"expected one of 'given', 'relevance', 'policy'"),
    Mistake("linking legolink0 over chunks compiled without it",
            _python(lambda c: c["engine"].link(c["ids"], "Tom", policy="legolink0")),
            r"compile\(docs, policy='legolink0:3'\)"),
    Mistake("HTTP: messages as a string", _http("POST", "/v1/chat/completions", {**CHAT, "messages": "hi"}, 422),
            r'\[\{"role": "user", "content": "hi"\}\] for one'),
    Mistake("HTTP: a misspelled key under pic",
            _http("POST", "/v1/chat/completions", {**CHAT, "pic": {"docs": ["x"]}}, 422),
            r"did you mean 'documents'"),
    Mistake("HTTP: documents at the top level",
            _http("POST", "/v1/chat/completions", {**CHAT, "documents": ["x"]}, 400),
            r'go under "pic": \{"documents": \[\.\.\.\]\}'),
    Mistake("HTTP: a wrong route", _http("POST", "/v1/chat/completion", CHAT, 404),
            r"did you mean POST /v1/chat/completions"),
    Mistake("HTTP: temperature 5", _http("POST", "/v1/chat/completions", {**CHAT, "temperature": 5}, 422),
            r"less than or equal to 2"),
    Mistake("pic serve --polcy naive", _cli("serve", "--polcy", "naive"), r"did you mean --policy\?"),
]  # fmt: skip


def test_the_trial_has_twenty_mistakes():
    assert len(MISTAKES) == 20 and len({m.what for m in MISTAKES}) == 20


@pytest.mark.parametrize("mistake", MISTAKES, ids=[m.what for m in MISTAKES])
def test_a_new_users_mistake_gets_a_message_naming_the_fix(mistake, engine, ids, client, capsys, monkeypatch):
    message = mistake.run({"engine": engine, "ids": ids, "client": client, "capsys": capsys,
                           "monkeypatch": monkeypatch})  # fmt: skip
    assert re.search(mistake.fix, message, flags=re.S), f"{mistake.what}: {message}"


if __name__ == "__main__":  # prints the trial's messages, for the note
    sys.exit(pytest.main([__file__, "-q", "-k", "new_users_mistake", "-rA"]))
