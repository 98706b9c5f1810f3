"""The module-level API and the demo, as a user runs them."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import threading
import time

import pytest

import pic
from tests.conftest import make_engine


def test_module_level_api_uses_the_default_engine():
    engine = pic.load()  # the embedded stories260K, offline
    assert pic.default_engine() is engine and engine.spec.architecture == "LlamaForCausalLM"
    ids = pic.compile(["Tom had a red ball.", "Lily liked to sing."])
    start = time.perf_counter()
    linked = pic.link(ids[::-1], "One day,", policy=pic.policies.Naive())
    out = linked.generate(max_new_tokens=16)
    assert out.text and len(out.token_ids) == 16
    assert linked.link_s <= out.ttft_s <= time.perf_counter() - start
    assert list(pic.link(ids, "One day,", prefix="A story.").stream(max_new_tokens=8))


def test_one_engine_class():
    assert pic.PIC is pic.Engine is pic.engine.Engine


@pytest.mark.parametrize("name", ["compile", "link", "link_chat"])
def test_module_functions_show_the_methods_signature(name):
    """``pic.link`` and its kin are ``PIC``'s methods on the default engine: the same parameters (names, kinds,
    defaults, annotations) and return, without ``self``, and the method's docstring."""
    function, method = getattr(pic, name), getattr(pic.PIC, name)
    expected = inspect.signature(method)
    expected = expected.replace(parameters=list(expected.parameters.values())[1:])
    assert inspect.signature(function) == expected
    assert function.__name__ == name and inspect.getdoc(method) in inspect.getdoc(function)


@pytest.mark.parametrize("progress", [False, True])
def test_load_is_quiet_unless_asked(capfd, progress):
    pic.load(progress=progress)
    assert ("Loading weights" in capfd.readouterr().err) is progress


def test_threads_share_an_engine():
    """Four threads compiling, linking and streaming on one engine get what one thread gets alone."""
    engine = make_engine("stories260K")
    docs = [f"Tom had {n} red balls. He gave one to Lily." for n in range(8)]
    queries = ["One day, Tom", "Lily said", "Then they", "The end of the day"]

    def run(i: int) -> tuple[list[int], str]:
        ids = engine.compile(docs[i : i + 4])[::-1]
        linked = engine.link(ids, queries[i], policy=["naive", "legolink:4", "mepic", "full"][i])
        pieces = list(linked.stream(max_new_tokens=24))
        return engine.link(ids, queries[i]).generate(max_new_tokens=24).token_ids, "".join(pieces)

    alone = [run(i) for i in range(4)]
    engine = make_engine("stories260K")  # a fresh engine: nothing compiled
    together: dict[int, tuple[list[int], str]] = {}
    threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, run(i))) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert [together.get(i) for i in range(4)] == alone
    assert engine.kv_stats().num_available_blocks == engine.kv_stats().num_blocks


def test_demo_runs_offline():
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pic", "demo", "--max-new-tokens", "24"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert sum(line.lstrip().startswith("[naive]") for line in lines) == 2
    assert sum(line.lstrip().startswith("[full]") for line in lines) == 2
    generations = [lines[i + 1].strip() for i, line in enumerate(lines) if line.lstrip().startswith("[")]
    assert all(len(g) > 20 and sum(c.isalpha() for c in g) > 10 for g in generations), generations
