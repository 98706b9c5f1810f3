"""SmolLM2-135M-Instruct as a chat model: its real ChatML template, byte-level BPE detokenization, batching,
``pic serve`` with the official ``openai`` client, the docs' chat examples, and the accuracy evaluation.

What is checked, with transformers over the same model object as the oracle (float32, CPU):

- ``link_chat`` on the real template is the plain chat prompt: same tokens, same logits, same tokens out;
- the incremental detokenizer on this vocabulary: streamed pieces join to ``Generation.text``, which is
  ``tokenizer.decode`` of the tokens, for generations with split multi-byte characters and random ids;
- batched generation equals one-at-a-time generation, mixing policies, orders and sampling;
- ``pic serve --model smollm2`` answers the official ``openai`` client as ``link_chat`` does in process;
- the docs' chat examples (examples/chat.py, examples/serve_chat.py) are in docs/ verbatim and run;
- the attention sinks that explain the policies' accuracy are there (Naive) and gone (LegoLink), and
  ``pic eval accuracy`` writes its JSON and PNG.
"""

from __future__ import annotations

import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

import pic
from pic.cli import main
from pic.evaluation.accuracy import evaluate_accuracy
from pic.evaluation.qa import qa_workload
from tests.serving import free_port
from tests.smollm2 import (
    DOCS,
    MESSAGES,
    PREFIX,
    QUERY,
    UNICODE,
    assert_matches_transformers,
    encode,
    stream_with_result,
)
from tests.test_detokenizer import byte_ids, run
from tests.test_engine import alone

# 4. link_chat on the real ChatML template.


def inline(messages: list[dict], docs: str) -> list[dict]:
    """The messages of the plain chat prompt: the documents' text where link_chat puts the chunks."""
    out = [dict(m) for m in messages]
    target = next((m for m in out if "{documents}" in m["content"]), None)
    if target is not None:
        target["content"] = target["content"].replace("{documents}", docs)
    else:
        user = next(m for m in out if m["role"] == "user")
        user["content"] = docs + user["content"]
    return out


MARKED = [MESSAGES[0], {"role": "user", "content": "Read these:\n{documents}Into which sea does the Elbe flow?"}]


@pytest.mark.parametrize("messages", [MESSAGES, MARKED], ids=["first-user-message", "marker"])
def test_link_chat_is_the_plain_chat_prompt(smollm2, messages):
    """Documents ending in one newline tokenize alike alone and in the rendered prompt, so the linked prompt is
    exactly the plain chat prompt's tokens, and Full Recompute over it is transformers."""
    docs = [d.removesuffix("\n") for d in DOCS]
    tok = smollm2.tokenizer
    rendered = tok.apply_chat_template(inline(messages, "".join(docs)), tokenize=False, add_generation_prompt=True)
    linked = smollm2.link_chat(smollm2.compile(docs), messages, policy="full")
    assert linked.input_ids.tolist() == encode(smollm2, rendered)
    assert rendered.startswith("<|im_start|>system\nAnswer from the documents.<|im_end|>\n<|im_start|>user\n")
    assert_matches_transformers(smollm2, linked)


def test_link_chat_with_paragraph_separated_documents(smollm2):
    """Documents ending in "\\n\\n", as docs/chat.md advises: the rendered prompt is prefix + documents + query,
    each segment tokenized on its own as ``link`` does, and Full Recompute over those tokens is transformers.

    Not the whole rendered text's tokens: GPT-2's pre-tokenizer, which SmolLM2 uses, splits "\\n\\n" before a
    letter into two "\\n" tokens (198, 198), while a document ending in "\\n\\n" ends in one token (1116).
    """
    tok = smollm2.tokenizer
    rendered = tok.apply_chat_template(inline(MESSAGES, "".join(DOCS)), tokenize=False, add_generation_prompt=True)
    prefix, query = smollm2.chat_segments(MESSAGES)
    assert prefix + "".join(DOCS) + query == rendered
    linked = smollm2.link_chat(smollm2.compile(list(DOCS)), MESSAGES, policy="full")
    segments = [prefix, *DOCS, query]
    assert linked.input_ids.tolist() == [t for s in segments for t in encode(smollm2, s)]
    assert_matches_transformers(smollm2, linked)


# 5. Byte-level BPE detokenization.


def test_streamed_multibyte_text_is_the_decoded_tokens(smollm2):
    """The model copies text with 2- to 4-byte characters, several split over byte tokens: the streamed
    pieces join to ``Generation.text``, which is ``tokenizer.decode`` of the generated tokens."""
    tok = smollm2.tokenizer
    ids = smollm2.compile([f"Line: {UNICODE}\n", "Line: Hello world\n", f"Line: {UNICODE}\n"])
    pieces, generation = stream_with_result(smollm2.link(ids, "Line: Grü", policy="full"), max_new_tokens=24)
    text = generation.text
    assert "".join(pieces) == text == tok.decode(generation.token_ids, skip_special_tokens=True)
    assert any(ord(c) > 0x7FF for c in text), text  # 3- or 4-byte characters were generated ...
    assert any("\ufffd" in tok.decode([t]) for t in generation.token_ids)  # ... some spread over tokens
    assert "\ufffd" not in text and not any("\ufffd" in p for p in pieces)


def test_detokenizer_on_random_token_sequences(smollm2):
    """Random sequences of this vocabulary's tokens, with multi-byte characters spelt one byte per token and
    encoded (split at byte boundaries), decode incrementally to exactly the full decode."""
    tok = smollm2.tokenizer
    rng = random.Random(0)
    special = set(tok.all_special_ids)
    candidates = rng.sample(range(len(tok)), 2000)
    whole = [[i] for i in candidates if i not in special and "\ufffd" not in tok.decode([i])]
    words = ("ü", "ß", "—", "東京", "🎉", "🚀", "naïve", "日本語", "Grüße", "😀👍")
    spelled = [byte_ids(tok, w) for w in words] + [encode(smollm2, f" {w}") for w in words]
    assert any(len(s) > 1 and "\ufffd" in tok.decode(s[:1]) for s in spelled)  # characters split over tokens
    for _ in range(200):
        ids = [i for _ in range(rng.randint(1, 20)) for i in rng.choice(whole if rng.random() < 0.6 else spelled)]
        pieces, detok = run(tok, ids)
        assert detok.text == tok.decode(ids, skip_special_tokens=True)
        assert not any("\ufffd" in p for p in pieces)


# 6. Batching.


def test_batched_generation_equals_one_at_a_time(smollm2):
    ids = smollm2.compile(list(DOCS))
    requests = [
        pic.Request(ids, QUERY, policy="full", max_new_tokens=10),
        pic.Request(ids[::-1], QUERY, prefix=PREFIX, policy="naive", max_new_tokens=8),
        pic.Request(ids[1:], "Hamburg", policy="legolink:16", max_new_tokens=12, temperature=0.9, top_p=0.9, seed=1),
        pic.Request([ids[2], ids[0]], QUERY, prefix=PREFIX, policy="mepic", max_new_tokens=10),
        pic.Request(ids, "The port", policy="cacheblend:0.15", max_new_tokens=8, temperature=0.8, seed=2),
    ]
    expected = [alone(smollm2, r) for r in requests]
    core = smollm2.stepper()
    steps_before = core.num_steps
    batched = smollm2.generate_many(requests)
    for want, got in zip(expected, batched, strict=True):
        assert got.token_ids == want.token_ids and got.text == want.text
        assert got.stats.finish_reason == want.stats.finish_reason
        assert got.stats.num_recomputed_tokens == want.stats.num_recomputed_tokens
    assert core.num_steps - steps_before < sum(len(g.token_ids) for g in batched) / 2  # shared forwards


# 7. pic serve, through the official client.

KEY = "KEY"  # the README's serve example uses it


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory) -> Iterator[str]:
    """``pic serve --model smollm2`` in a subprocess (after the fixture converted the model); yields its URL."""
    logs = tmp_path_factory.mktemp("serve")
    port = free_port()
    command = [sys.executable, "-m", "pic", "serve", "--model", "smollm2", "--port", str(port), "--api-key", KEY]
    with open(logs / "stdout", "w+b") as stdout, open(logs / "stderr", "w+b") as stderr:
        process = subprocess.Popen(command, stdout=stdout, stderr=stderr)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 180
            while True:
                if process.poll() is not None:
                    pytest.fail(f"pic serve exited with {process.returncode}: {(logs / 'stderr').read_text()}")
                if time.monotonic() > deadline:
                    pytest.fail(f"pic serve did not answer /health in 180 s: {(logs / 'stderr').read_text()}")
                try:
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            assert (logs / "stdout").read_text().startswith("PASS: ")  # the start-up check ran and passed
            yield url
        finally:
            process.terminate()
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def test_serve_chat_completions_equal_link_chat(smollm2, server):
    docs = [DOCS[0], DOCS[1]]
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        response = http.post("/v1/chunks", json={"documents": docs})
    assert response.status_code == 200, response.text
    ids = response.json()["cache_ids"]
    assert ids == smollm2.compile(docs)  # content addresses: the same in both processes
    expected = smollm2.link_chat(ids, MESSAGES).generate(max_new_tokens=16).text
    assert expected.strip()
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)
    options = dict(
        model="smollm2", messages=MESSAGES, max_tokens=16, temperature=0, extra_body={"pic": {"cache_ids": ids}}
    )
    out = client.chat.completions.create(**options)
    assert out.choices[0].message.content == expected
    stream = client.chat.completions.create(stream=True, **options)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected


# 8. The docs' chat examples, verbatim.

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, **env: str) -> list[str]:
    """``examples/<name>`` (which the docs show verbatim) in a fresh process, offline; its stdout lines."""
    docs = [EXAMPLES.parent / "README.md", *sorted((EXAMPLES.parent / "docs").glob("*.md"))]
    assert (EXAMPLES / name).read_text() in "\n".join(d.read_text() for d in docs), f"the docs lack {name}"
    environment = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **env)
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, env=environment, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_chat_example(smollm2):
    lines = run_example("chat.py")
    assert [line.split(":")[0].strip() for line in lines] == ["default", "full"] * 2, lines
    assert all("North Sea" in line for line in lines if line.strip().startswith("full")), lines
    recomputed = [int(line.split("TTFT")[1].split(", ")[1].split("/")[0]) for line in lines]
    assert recomputed[1] == recomputed[3] and recomputed[0] == recomputed[1], lines  # every token, both policies
    # a prompt this short: the default runs Full Recompute in the caller's order (docs/chat.md says so)
    assert all(line.endswith("ran full, chunks [0, 1, 2], whole [0, 1, 2])") for line in lines), lines
    page = (EXAMPLES.parent / "docs" / "chat.md").read_text()
    shown = page.split("It prints", 1)[1].split("```\n", 2)[1].splitlines()
    times = lambda text: re.sub(r"TTFT \d+ ms", "TTFT _ ms", text)  # noqa: E731
    assert [times(line) for line in shown] == [times(line) for line in lines]  # the page shows what it prints


def test_chat_pages_words_on_the_unfloored_link_are_what_it_runs(smollm2):
    """docs/chat.md names the document the link without the floor recomputes whole (by name and caller's index) and
    how many tokens it recomputes: each read off the page and checked against ``Linked.recomputed_whole`` and
    ``Linked``'s counts on the example's own documents, in both orders."""
    page = (EXAMPLES.parent / "docs" / "chat.md").read_text().replace("\n", " ")
    named = re.search(r"policy=\"(auto:[^\"]+)\"`?\).*?the (\w+) document in both orders \(`whole \[(\d)\]`", page)
    counts = re.search(r"the most relevant document whole, (\d+) of the (\d+) tokens", page)
    assert named and counts, "docs/chat.md no longer says which document the unfloored link recomputes"
    policy, name, index = named.group(1), named.group(2), int(named.group(3))
    head = (EXAMPLES / "chat.py").read_text().split("for order in", 1)[0].replace('pic.load("smollm2")', "engine")
    scope = {"engine": smollm2}
    exec(compile(head, "examples/chat.py", "exec"), scope)  # (the example's documents, messages and ids)
    docs, ids, messages = scope["docs"], scope["ids"], scope["messages"]
    assert docs[index].startswith(name), (name, docs[index])
    for order in (ids, ids[::-1]):
        linked = smollm2.link_chat(order, messages, policy=policy)
        try:
            assert list(linked.recomputed_whole) == [index], (order, linked.recomputed_whole)
            assert (linked.num_recomputed, len(linked.input_ids)) == tuple(map(int, counts.groups()))
        finally:
            linked.release()


def test_serve_chat_example(server):
    content, usage = run_example("serve_chat.py", PIC_BASE_URL=f"{server}/v1")
    assert "North Sea" in content and "reused_tokens=" in usage and "recomputed_tokens=" in usage
    page = (EXAMPLES.parent / "docs" / "serve.md").read_text()
    shown = page.split("It prints (against that server", 1)[1].split("```\n", 2)[1].splitlines()
    assert shown == [content, usage]  # what ran (pic_policy, pic_chunk_order, pic_recomputed_chunks) as the page says


# 9. What the accuracy evaluation measures, on the real model.


def test_naive_links_leave_attention_sinks_at_chunk_starts(smollm2):
    """A chunk compiled alone starts a sequence, so its first token is an attention sink in its cached KV.
    Linked under Naive, the query pays those tokens many times what uniform attention would (about half its
    attention in the later layers); in Full Recompute they are ordinary tokens, and LegoLink, recomputing
    each later chunk's head, gives them what Full Recompute gives."""
    workload = qa_workload(num_cases=1, seed=0)
    report = evaluate_accuracy(
        smollm2, workload=workload, policies=["naive", "legolink:16"], max_new_tokens=2, num_sink_cases=1
    )
    full, naive, lego = (statistics.fmean(p.chunk_firsts[10:]) for p in report.sinks)  # layers 10-29
    uniform = report.sinks[0].uniform_chunk_firsts
    assert naive > 0.2 > 10 * uniform > full and lego < 2 * full


def test_cli_eval_accuracy_writes_json_and_png(smollm2, tmp_path, capsys):
    argv = ["eval", "accuracy", "--model", "smollm2", "--cases", "2", "--policies", "naive", "--sink-cases", "1"]
    assert main([*argv, "--max-new-tokens", "4", "--out", str(tmp_path), "--name", "qa"]) == 0
    data = json.loads((tmp_path / "qa.json").read_text())
    assert data["num_cases_evaluated"] == 2 and data["add_bos"] is False and data["model_name"].startswith("SmolLM2")
    assert [s["policy"] for s in data["scores"]] == ["full", "naive"] and len(data["sinks"][0]["chunk_firsts"]) == 30
    assert (tmp_path / "qa.png").read_bytes()[:4] == b"\x89PNG" and "| naive |" in capsys.readouterr().out


def test_link_chat_compiles_documents_in_the_chats_context(smollm2):
    """``chat_context`` is the template up to the documents without the user's text; ``link_chat(documents=...)``
    compiles there (the chunk's KV is transformers' over context + document), and Full Recompute is unchanged."""
    context = smollm2.chat_context(MESSAGES)
    assert context == "<|im_start|>system\nAnswer from the documents.<|im_end|>\n<|im_start|>user\n"
    assert smollm2.chat_context([]).startswith("<|im_start|>system\n")  # the template's own system prompt
    docs = [d.removesuffix("\n") for d in DOCS]
    linked = smollm2.link_chat([], MESSAGES, documents=docs, policy="full")
    chunk = smollm2.store.get(linked.layout.chunks[0].cache_id)
    assert chunk.options.context == tuple(encode(smollm2, context))
    sequence = torch.tensor([[*chunk.options.context, *chunk.token_ids.tolist()]])
    with torch.no_grad():
        cache = smollm2.model(sequence, use_cache=True).past_key_values
    start = len(chunk.options.context)
    for layer in (0, 15, 29):
        assert torch.allclose(chunk.v[layer], cache.layers[layer].values[0, :, start:].transpose(0, 1), atol=1e-4)
    alone = smollm2.link_chat(smollm2.compile(docs), MESSAGES, policy="full")
    assert torch.equal(linked.input_ids, alone.input_ids)
    assert torch.allclose(linked.logits, alone.logits, atol=1e-4, rtol=0)


def test_cli_eval_accuracy_profiles_in_context(smollm2, tmp_path):
    argv = ["eval", "accuracy", "--model", "smollm2", "--workload", "profiles", "--cases", "1", "--sink-cases", "0"]
    argv += ["--policies", "regions@context ape", "--max-new-tokens", "4", "--out", str(tmp_path), "--name", "p"]
    assert main(argv) == 0
    data = json.loads((tmp_path / "p.json").read_text())
    assert [s["policy"] for s in data["scores"]] == ["full", "regions:0.2@context", "ape:0.9"]
    assert data["workload"]["source"] == "pic.evaluation.profile_workload"
    assert set(data["scores"][0]["accuracy_by_kind"]) == {"profile"}
    assert data["scores"][1]["chunk_recompute_fraction"] == pytest.approx(0.2, abs=0.01)  # the budget, filled
