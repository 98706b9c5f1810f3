"""A fleet on one real redis-server: two vLLM engines with PicConnector (two processes, a core each) and pic's own
engine (this process), sharing no disk: Redis is the only way a chunk moves between them.

pic's engine compiles the documents and one vLLM engine compiles another through the connector (compile once,
anywhere); both vLLM engines link all of them, with their prefix caches emptied before each request (as on another
worker), and answer alike, as pic's own engine does. Then one engine is killed (SIGKILL, its whole process group)
while a step of its link has loaded one attention layer of the chunks and not the others, and the other engine,
linking the same prompt at the same time, is unaffected and the store keeps every chunk. Last, the redis-server is
paused (SIGSTOP) for longer than the connector's Redis timeout while an engine links: the request comes back as a
plain prefill with its reason and vLLM's own answer, and once Redis runs again the same link loads every chunk.
Each vLLM engine is a process of its own (``fleet_worker``), started once for the module.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pic.link.chat import split_chat
from pic.vllm.client import chat_link_prompt, compile_prompt
from tests_vllm.conftest import DOCS, MESSAGES

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent
COMPILED_IN_VLLM = "The Danube flows through ten countries, more than any other river.\n\n"
STORE = {"on_redis_error": "miss", "redis_timeout_s": 1.0, "tier_retry_s": 0.5}  # a failing Redis: a miss, 1 s at most
START_TIMEOUT_S = 900.0  # generous: fails a hung start, never a slow one (two engines start at once on two cores)
REPLY_TIMEOUT_S = 300.0
# Top-5 first-token log-probabilities of the two vLLM engines (the same kernels, the same KV loaded from the same
# chunks): measured here, equal (0.0). Against pic's own engine (torch's kernels): 2e-3, as test_connector.py
# (measured here: 2.6e-5).
SAME_ENGINE_TOL = 1e-4
PIC_TOL = 2e-3


class Engine:
    """One vLLM engine of the fleet in a process group of its own, spoken to a JSON line at a time."""

    def __init__(self, name: str, folder: Path, job: dict, cpu: str, env: dict | None = None) -> None:
        self.name = name
        job_file = folder / f"{name}.json"
        job_file.write_text(json.dumps(job))
        self.log_file = folder / f"{name}.log"
        self._log = self.log_file.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests_vllm.fleet_worker", str(job_file)], cwd=ROOT,
            env=os.environ | {"VLLM_CPU_OMP_THREADS_BIND": cpu} | (env or {}), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._log, text=True, start_new_session=True,
        )  # fmt: skip
        self._lines: queue.Queue[dict | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(json.loads(line))
        self._lines.put(None)  # the process ended

    def next(self, timeout_s: float = REPLY_TIMEOUT_S) -> dict:
        try:
            message = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            pytest.fail(f"engine {self.name} gave no answer in {timeout_s:.0f} s; its log ends:\n{self.tail()}")
        if message is None:
            pytest.fail(f"engine {self.name} exited ({self.proc.poll()}); its log ends:\n{self.tail()}")
        return message

    def send(self, prompt: dict, extra_args: dict | None = None, *, max_tokens: int = 12) -> None:
        self.proc.stdin.write(json.dumps({"prompt": prompt, "extra_args": extra_args, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()

    def ask(self, prompt: dict, extra_args: dict | None = None, *, max_tokens: int = 12) -> dict:
        self.send(prompt, extra_args, max_tokens=max_tokens)
        return self.next()

    def link(self, prompt) -> dict:
        return self.ask(prompt.tokens_prompt(), prompt.extra_args())

    def kill(self) -> None:
        """SIGKILL to every process of the engine (its front end and the engine core vLLM spawned)."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=120)

    def group(self) -> list[int]:
        """The live (not zombie) processes of the engine's process group."""
        alive = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == self.proc.pid and fields[0] != "Z":  # (state, ppid, pgrp, ...)
                alive.append(int(stat.parent.name))
        return alive

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # the worker's loop ends; vLLM shuts its engine down
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                pass
        if self.group():
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=120)
        self._log.close()

    def tail(self) -> str:
        return self.log_file.read_text()[-4000:]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    import pic
    from pic.config import StoreConfig
    from tests.redis_server import redis_server

    folder = tmp_path_factory.mktemp("fleet")
    redis = redis_server(folder).start()
    store = {"redis_url": redis.url, **STORE}
    engine = pic.load("smollm2", store=StoreConfig(**store))
    job = {"model": str(engine.model.name_or_path), "store": store}
    hold = folder / "hold"
    engines = {
        "A": Engine("A", folder, job | {"connector": "HoldingPicConnector", "module": "tests_vllm.fleet_worker"}, "0",
                    env={"PIC_FLEET_HOLD": str(hold)}),
        "B": Engine("B", folder, job | {"connector": "PicConnector", "module": "pic.vllm.connector"}, "1"),
    }  # fmt: skip
    try:
        started = time.monotonic()
        for one in engines.values():
            assert one.next(START_TIMEOUT_S)["ready"]
        print(f"two vLLM engines started in {time.monotonic() - started:.1f} s")
        ids = engine.compile(list(DOCS))  # pic's engine compiles three documents into Redis
        document = _tokens(engine, COMPILED_IN_VLLM)
        prompt_ids, params = compile_prompt(document)  # SmolLM2 compiles without a BOS
        compiled = engines["B"].ask({"prompt_token_ids": prompt_ids}, {"kv_transfer_params": params}, max_tokens=1)
        ids.append(compiled["report"]["cache_id"])  # ... and engine B a fourth, through the connector
        chunks = list(zip(ids, [_tokens(engine, doc) for doc in (*DOCS, COMPILED_IN_VLLM)], strict=True))
        naive = chat_link_prompt(engine.tokenizer, chunks, MESSAGES, policy="naive", order="given")
        first = engines["A"].link(naive)  # the first link of the chat's prefix: a plain prefill that stores it
        yield {"redis": redis, "engine": engine, "hold": hold, "chunks": chunks, "naive": naive,
               "compiled": compiled["report"], "first": first["report"], **engines}  # fmt: skip
    finally:
        for one in engines.values():
            one.close()
        engine.close()
        redis.stop()


def _tokens(engine, text: str) -> list[int]:
    return engine.tokenizer(text, add_special_tokens=False)["input_ids"]


def _reference(fleet) -> dict:
    """Engine B's naive link of the chat, every chunk loaded (the first one asked for)."""
    if "reference" not in fleet:
        fleet["reference"] = fleet["B"].link(fleet["naive"])
    return fleet["reference"]


def _close(a: dict, b: dict) -> float:
    assert a["first"].keys() == b["first"].keys(), (a["first"], b["first"])
    return max(abs(a["first"][t] - b["first"][t]) for t in a["first"])


def _whole(reply: dict) -> bool:
    """Linked, every chunk token and the prefix loaded from pic's store (naive), and vLLM took the claim."""
    report = reply["report"]
    return (report["linked"] and report["num_loaded"] == report["num_prefix"] + report["num_chunk_tokens"] > 0
            and reply["num_cached_tokens"] == report["num_loaded"])  # fmt: skip


def _chunk_keys(fleet) -> set[bytes]:
    """Every chunk key on the server (``pic:<fingerprint>:<id>:meta`` and ``...:part:<i>``), each checked to be
    whole and kept: a chunk's every part, no key left to expire (a writer's parts live with a TTL until its
    metadata lands)."""
    client = fleet["redis"].client()
    keys = {key for key in client.keys("pic:*") if key.endswith(b":meta") or b":part:" in key}
    assert all(client.ttl(key) == -1 for key in keys), {key: client.ttl(key) for key in keys}
    metas = {key for key in keys if key.endswith(b":meta")}
    for cache_id, _ in fleet["chunks"]:
        assert fleet["engine"].store.lookup(cache_id)[-1] == "redis"  # pic's engine finds each document there
        assert any(cache_id.encode() in key for key in metas), cache_id
    return keys


def test_chunks_compiled_once_anywhere_link_alike_in_both_engines(fleet):
    engine, a, b, naive = fleet["engine"], fleet["A"], fleet["B"], fleet["naive"]
    compiled = fleet["compiled"]
    assert compiled["stored"] == compiled["cache_id"], compiled  # engine B compiled the fourth into Redis
    described = engine.store.describe(compiled["cache_id"])  # pic's engine sees it there, by its metadata
    assert described.tiers == ("redis",) and list(described.token_ids) == fleet["chunks"][-1][1]
    assert not fleet["first"]["linked"] and fleet["first"]["stored"], fleet["first"]  # engine A stored the prefix
    ids, chunks = [cid for cid, _ in fleet["chunks"]], fleet["chunks"]
    a.send(naive.tokens_prompt(), naive.extra_args())  # both engines link at once, each on its core
    b.send(naive.tokens_prompt(), naive.extra_args())
    in_a, in_b = a.next(), b.next()
    assert _whole(in_a) and _whole(in_b), (in_a, in_b)
    assert in_a["tokens"] == in_b["tokens"] and _close(in_a, in_b) < SAME_ENGINE_TOL
    import torch

    prefix, query = split_chat(engine.tokenizer, MESSAGES, strip_bos=False)
    with engine.link(ids, query, prefix=prefix, policy="naive") as linked:  # pic's own engine, from the same Redis
        ours = torch.log_softmax(linked.logits[-1].float(), -1)
    assert int(ours.argmax()) == in_b["tokens"][0]
    against_pic = max(abs(lp - ours[int(t)].item()) for t, lp in in_b["first"].items())
    assert against_pic < PIC_TOL
    # pic's default rule, linked whatever the prompt's length: the most relevant document recomputed, last
    relevant = chat_link_prompt(engine.tokenizer, chunks, MESSAGES, policy="auto:0.05,min_gain=1.0")
    a.send(relevant.tokens_prompt(), relevant.extra_args())
    b.send(relevant.tokens_prompt(), relevant.extra_args())
    auto_a, auto_b = a.next(), b.next()
    for reply in (auto_a, auto_b):
        report = reply["report"]
        assert report["linked"] and report["order"] == "relevance" and report["num_recomputed"] > 0, report
        assert report["num_loaded"] == report["num_prefix"] + report["num_chunk_tokens"] - report["num_recomputed"]
    assert auto_a["tokens"] == auto_b["tokens"] and _close(auto_a, auto_b) < SAME_ENGINE_TOL
    fleet.setdefault("reference", in_b)
    print(
        f"naive: {in_b['report']['num_loaded']} of {len(naive.prompt_token_ids)} tokens loaded in each engine, "
        f"top-5 first-token log-probabilities A vs B within {_close(in_a, in_b):.1e}, vs pic's engine within "
        f"{against_pic:.1e}; auto: {auto_b['report']['num_recomputed']} recomputed, A vs B within "
        f"{_close(auto_a, auto_b):.1e}"
    )


def test_an_engine_killed_mid_load_leaves_the_other_and_the_store_whole(fleet):
    a, b, hold = fleet["A"], fleet["B"], fleet["hold"]
    naive, reference = fleet["naive"], _reference(fleet)
    before = _chunk_keys(fleet)
    hold.touch()  # engine A's next load holds after its first layer
    a.send(naive.tokens_prompt(), naive.extra_args())
    b.send(naive.tokens_prompt(), naive.extra_args())  # engine B links the same prompt meanwhile
    held = Path(str(hold) + ".held")
    deadline = time.monotonic() + REPLY_TIMEOUT_S
    while not held.exists() and a.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert held.exists(), f"engine A never reached its load; its log ends:\n{a.tail()}"
    assert held.read_text().startswith("model.layers.0."), held.read_text()  # one layer of 30 written: mid-load
    a.kill()
    assert a.proc.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 120
    while a.group() and time.monotonic() < deadline:  # the engine core it spawned went with it
        time.sleep(0.1)
    assert not a.group(), a.group()
    in_b = b.next()
    assert _whole(in_b), in_b
    assert in_b["tokens"] == reference["tokens"] and _close(in_b, reference) < SAME_ENGINE_TOL
    again = b.link(naive)
    assert _whole(again) and again["tokens"] == reference["tokens"]
    after = _chunk_keys(fleet)
    assert before <= after, before - after  # nothing lost
    print(f"engine A killed after {held.read_text()}; {len(after)} chunk keys in Redis, {len(before)} before")


def test_redis_paused_past_its_timeout_during_a_link_is_a_plain_prefill_and_loses_nothing(fleet):
    b, redis = fleet["B"], fleet["redis"]
    naive, reference = fleet["naive"], _reference(fleet)
    plain = b.ask({"prompt_token_ids": naive.prompt_token_ids})  # vLLM's own prefill of the same prompt
    assert plain["report"] is None and plain["num_cached_tokens"] == 0
    before = _chunk_keys(fleet)
    os.kill(redis._proc.pid, signal.SIGSTOP)  # it takes connections and answers nothing
    try:
        paused_at = time.monotonic()
        during = b.link(naive)  # answered while Redis is still paused
        paused_for = time.monotonic() - paused_at
    finally:
        os.kill(redis._proc.pid, signal.SIGCONT)
    assert paused_for >= STORE["redis_timeout_s"]  # a lower bound: Redis stayed paused past the timeout
    report = during["report"]
    assert report["linked"] is False and "is in no tier of this model (redis); redis:" in report["reason"], report
    assert during["num_cached_tokens"] == 0 and during["tokens"] == plain["tokens"]  # vLLM's own answer
    time.sleep(2 * STORE["tier_retry_s"])  # past tier_retry_s: the breaker lets the next call reach Redis
    after = b.link(naive)
    assert _whole(after) and after["tokens"] == reference["tokens"] and _close(after, reference) < SAME_ENGINE_TOL
    assert before <= _chunk_keys(fleet), "a chunk was lost"
    print(f"redis paused {paused_for:.2f} s; reason: {report['reason']}")
