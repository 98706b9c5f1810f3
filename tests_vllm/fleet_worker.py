"""One vLLM engine of a fleet (``test_fleet.py``), a long-lived process: ``python -m tests_vllm.fleet_worker JOB``.

``JOB`` is JSON: the model folder, the connector's store (a Redis URL only in the fleet test: the engines share no
disk) and the connector class (``PicConnector``, or ``HoldingPicConnector`` below). Once the engine is built the
process writes ``{"ready": true}``; then it reads requests, one JSON object a line, on stdin, and answers each with
one line on its stdout: ``{"prompt": ..., "extra_args": ..., "max_tokens": n}`` -> the greedy tokens, the first
token's top-5 log-probabilities, ``num_cached_tokens`` and the connector's report. vLLM's prefix cache is emptied
before each request: what a request gets, it got from pic's tiers (or computed). vLLM and its libraries log to
stdout, so the answers go on a copy of the original stdout and everything else on stderr.

``HoldingPicConnector`` is ``PicConnector`` with one hook for the test that kills an engine mid-load: while the
file ``PIC_FLEET_HOLD`` names exists, a step that loads chunks writes ``<that file>.held`` after its first attention
layer's load and then holds there (the other layers not yet written) until the process is killed.
vLLM's engine runs in processes it spawns, so this module runs under ``if __name__ == "__main__"``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from pic.vllm.connector import PicConnector


class HoldingPicConnector(PicConnector):
    def wait_for_layer_load(self, layer_name: str) -> None:
        super().wait_for_layer_load(layer_name)
        hold = os.environ.get("PIC_FLEET_HOLD")
        if hold and self._worker._loads and Path(hold).exists():  # a step that loads, and the test asks for a hold
            Path(hold + ".held").write_text(layer_name)
            while True:  # mid-load: this layer written, the later ones not, until SIGKILL
                time.sleep(0.1)


def serve(job: dict, answers) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    config = KVTransferConfig(
        kv_connector=job["connector"], kv_connector_module_path=job["module"], kv_role="kv_both",
        kv_connector_extra_config={"store": job["store"]},
    )  # fmt: skip
    llm = LLM(model=job["model"], dtype="float32", enforce_eager=True, max_model_len=4096,
              kv_cache_memory_bytes=2**30, kv_transfer_config=config)  # fmt: skip
    _answer(answers, {"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        llm.reset_prefix_cache()  # as on another worker of a fleet: nothing of an earlier request is reused
        params = SamplingParams(max_tokens=request.get("max_tokens", 12), temperature=0.0, logprobs=5,
                                extra_args=request.get("extra_args"))  # fmt: skip
        out = llm.generate(request["prompt"], params, use_tqdm=False)[0]
        first = out.outputs[0].logprobs[0]
        _answer(answers, {
            "tokens": list(out.outputs[0].token_ids), "num_cached_tokens": out.num_cached_tokens,
            "report": (out.kv_transfer_params or {}).get("pic"),
            "first": {str(token): top.logprob for token, top in first.items()},
        })  # fmt: skip


def _answer(answers, message: dict) -> None:
    answers.write(json.dumps(message) + "\n")
    answers.flush()


if __name__ == "__main__":
    answers = os.fdopen(os.dup(1), "w")  # the answers' channel: the original stdout
    os.dup2(2, 1)  # what anything else prints (vLLM's logs, its engine's processes) goes to stderr
    sys.stdout = sys.stderr
    serve(json.loads(Path(sys.argv[1]).read_text()), answers)
