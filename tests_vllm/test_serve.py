"""``vllm serve`` with PicConnector, driven by the ``openai`` client as a user would: a completion by cache ids
(``kv_transfer_params`` and ``cache_salt`` pass through vLLM's OpenAI server) links; one without pic's
fields is vLLM's own."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from pic.vllm.client import chat_link_prompt, link_report
from tests_vllm.conftest import DOCS, MESSAGES

pytestmark = pytest.mark.vllm
STARTUP_S = 300  # vLLM's server loads in ~30 s here; a machine under load may take several times that


@pytest.fixture(scope="module")
def server(engine, store, tmp_path_factory):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = {
        "kv_connector": "PicConnector", "kv_connector_module_path": "pic.vllm.connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"store": store},
    }  # fmt: skip
    log = (tmp_path_factory.mktemp("serve") / "vllm.log").open("w")
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(engine.model.name_or_path),
        "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "4096",
        "--kv-cache-memory-bytes", str(2**30), "--served-model-name", "smollm2",
        "--kv-transfer-config", json.dumps(config),
    ]  # fmt: skip
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + STARTUP_S
    import httpx

    while True:
        try:
            if httpx.get(f"{url}/models", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"vllm serve did not start (exit {proc.poll()}); see {log.name}")
        time.sleep(1)
    yield url
    proc.terminate()
    proc.wait(timeout=60)


def test_a_completion_by_cache_ids_links_through_vllms_openai_server(server, engine):
    from openai import OpenAI

    ids = engine.compile(list(DOCS))
    chunks = [
        (cid, engine.tokenizer(d, add_special_tokens=False)["input_ids"]) for cid, d in zip(ids, DOCS, strict=True)
    ]
    client = OpenAI(base_url=server, api_key="none")

    def ask(prompt):
        return client.completions.create(
            model="smollm2", prompt=prompt.prompt_token_ids, max_tokens=8, temperature=0.0,
            extra_body=prompt.openai_extra_body(),
        )  # fmt: skip

    ask(chat_link_prompt(engine.tokenizer, chunks, MESSAGES, policy="naive", order="given"))  # stores the prefix
    prompt = chat_link_prompt(engine.tokenizer, chunks[::-1], MESSAGES, policy="naive", order="given")
    reply = ask(prompt)  # the documents in another order: vLLM's own cache has only the prefix's blocks
    report = link_report(reply.model_extra["kv_transfer_params"])
    assert report["num_loaded"] == report["num_prefix"] + report["num_chunk_tokens"]
    assert "Baltic" in reply.choices[0].text or "brackish" in reply.choices[0].text.lower()
    plain = client.completions.create(model="smollm2", prompt=prompt.prompt_token_ids, max_tokens=8, temperature=0.0)
    assert not (plain.model_extra or {}).get("kv_transfer_params")  # not pic's: vLLM's own prefill
