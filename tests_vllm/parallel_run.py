"""One vLLM engine with PicConnector at a tensor-parallel size, run as a process of its own (``test_parallel.py``):
``python -m tests_vllm.parallel_run JOB.json OUT.json``.

The job names the model folder, the connector's store, ``tensor_parallel_size`` and the requests, each a
``{"prompt": ..., "extra_args": ...}`` or ``{"link_compiled": ...}`` (a naive link of the chunk the last compile
request stored, built here: its id is known only once vLLM returns it). The output: per request its greedy
tokens, its first token's top log-probabilities, the connector's report and the seconds ``generate`` took
(with ``"max_tokens": 1``, the request's time to its first token). vLLM's multiprocessing starts its
workers by spawning, so this module runs under ``if __name__ == "__main__"``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def run(job: dict) -> list[dict]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from pic.vllm.client import link_prompt

    size = job["tensor_parallel_size"]
    config = KVTransferConfig(
        kv_connector="PicConnector", kv_connector_module_path="pic.vllm.connector", kv_role="kv_both",
        kv_connector_extra_config={"store": job["store"]},
    )  # fmt: skip
    llm = LLM(model=job["model"], dtype="float32", enforce_eager=True, max_model_len=1024, kv_cache_memory_bytes=2**28,
              kv_transfer_config=config, tensor_parallel_size=size,
              distributed_executor_backend="mp" if size > 1 else None)  # fmt: skip
    outputs, compiled = [], None
    for request in job["requests"]:
        if "link_compiled" in request:
            spec = request["link_compiled"]
            linked = link_prompt([(compiled, spec["doc"])], spec["query"], prefix_ids=spec["prefix"], policy="naive",
                                 order="given")  # fmt: skip
            request = {"prompt": linked.tokens_prompt(), "extra_args": linked.extra_args()}
        llm.reset_prefix_cache()  # what a request gets, it got from pic (or computed)
        params = SamplingParams(max_tokens=request.get("max_tokens", 6), temperature=0.0, logprobs=5,
                                extra_args=request.get("extra_args"))  # fmt: skip
        start = time.perf_counter()
        out = llm.generate(request["prompt"], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - start
        report = (out.kv_transfer_params or {}).get("pic", {})
        compiled = report.get("cache_id", compiled)
        first = out.outputs[0].logprobs[0]
        outputs.append({
            "tokens": list(out.outputs[0].token_ids), "report": report, "seconds": seconds,
            "first": {str(token): top.logprob for token, top in first.items()},
        })  # fmt: skip
    return outputs


if __name__ == "__main__":
    job_file, out_file = sys.argv[1:3]
    Path(out_file).write_text(json.dumps(run(json.loads(Path(job_file).read_text()))))
