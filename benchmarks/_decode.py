"""Decode speed for ``ttft.py``: pic's ``link().generate()`` / ``generate_many`` against transformers' ``generate``.

Both run greedy with no EOS, on the same prompts, in turn, round after round; tokens/s counts the tokens after the
first (the first is the prefill's): batch x (new - 1) / (last token's time - first token's time).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from _gpu import sync

import pic

HF = "hf"


class Clock:
    """A ``generate(streamer=...)`` that notes when tokens reach the host: the prompt (put before the prefill),
    then each step's tokens (``generate`` copies them to the host, so the times follow the GPU)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def prompt_ids(docs: list[list[int]], chunks: list[int], query: list[int], bos: int) -> list[int]:
    """The linked prompt, as ``Linked.input_ids`` holds it: each chunk after its BOS, then the query."""
    return [t for c in chunks for t in (bos, *docs[c])] + query


def hf_generate(model: torch.nn.Module, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """``model.generate`` on the batch of prompts: its tokens, TTFT, decode time (first to last token), wall time."""
    clock, batch = Clock(), torch.tensor(prompts, device=args.device)  # [B, T]: equal lengths, no padding
    sync(args.device)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            batch,
            attention_mask=torch.ones_like(batch),
            max_new_tokens=args.new_tokens,
            do_sample=False,
            streamer=clock,
        )
    tokens = out[:, batch.shape[1] :].tolist()  # [B, new] (a host copy: the device is done)
    wall, first = time.perf_counter() - start, clock.times[1]  # times[0]: the prompt
    return {"tokens": tokens, "ttft_s": first - start, "decode_s": clock.times[-1] - first, "wall_s": wall}


def pic_generate(engine: pic.PIC, requests: list[tuple[list[str], list[int]]], args: argparse.Namespace) -> dict:
    """pic on the requests (cache ids, query): one through ``link().generate()``, more through ``generate_many``."""
    policy, new = args.decode_policy, args.new_tokens
    start = time.perf_counter()
    if len(requests) == 1:  # the facade, as a user links and generates one request
        gens = [engine.link(*requests[0], policy=policy).generate(max_new_tokens=new)]
    else:
        reqs = [pic.Request(c, q, policy=policy, max_new_tokens=new) for c, q in requests]
        gens = engine.generate_many(reqs, progress=False)
    wall = time.perf_counter() - start
    firsts = [g.ttft_s for g in gens]  # from the link call (batch 1) or from arrival (all arrive together)
    return {
        "tokens": [g.token_ids for g in gens],
        "ttft_s": max(firsts),
        "first_token_spread_s": max(firsts) - min(firsts),
        "decode_s": max(f + g.stats.decode_s for f, g in zip(firsts, gens, strict=True)) - max(firsts),
        "wall_s": wall,
    }


def decode(engine: pic.PIC, model, ids: list[str], docs: list[list[int]], batch: int, args, *, hf: bool = True) -> dict:
    """pic and transformers in turn at ``batch`` requests: a warm-up round, then ``--decode-repeats`` rounds
    (``hf=False``: pic alone, its ratio to transformers left to the caller)."""
    rng, k = random.Random(args.seed - batch), args.decode_context // args.chunk_tokens
    sets = [[(i * k + j) % len(docs) for j in range(k)] for i in range(batch)]
    queries = [[rng.randrange(3, args.vocab) for _ in range(args.query_tokens)] for _ in range(batch)]
    prompts = [prompt_ids(docs, s, q, engine.bos_token_id) for s, q in zip(sets, queries, strict=True)]
    requests = [([ids[c] for c in s], q) for s, q in zip(sets, queries, strict=True)]
    runs = {"pic": lambda: pic_generate(engine, requests, args), HF: lambda: hf_generate(model, prompts, args)}
    if not hf:
        del runs[HF]
    raw = {name: [] for name in runs}
    for i in range(args.decode_repeats + 1):
        for name, run in runs.items():
            row = run()
            assert all(len(t) == args.new_tokens for t in row["tokens"]), f"{name}: not {args.new_tokens} tokens"
            if i:  # round 0 warms up (and compiles the decode kernel for the split counts it meets)
                raw[name].append(row)
    result = {"batch": batch, "prompt_tokens": len(prompts[0]), "new_tokens": args.new_tokens}
    result |= {name: summarize(rows, batch, args.new_tokens) for name, rows in raw.items()}
    if not hf:
        return result
    result["pic_over_hf_decode_tokens_per_s"] = result["pic"]["decode_tokens_per_s"] / result[HF]["decode_tokens_per_s"]
    pairs = zip(raw["pic"][0]["tokens"], raw[HF][0]["tokens"], strict=True)
    result["tokens_agreeing_with_hf"] = [agreeing(p, h) for p, h in pairs]
    return result


def agreeing(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def summarize(rows: list[dict], batch: int, new_tokens: int) -> dict:
    """Medians over the rounds: decode tokens/s, TTFT, end-to-end tokens/s (prefill included)."""
    decode_s = statistics.median(r["decode_s"] for r in rows)
    summary = {
        "decode_tokens_per_s": batch * (new_tokens - 1) / decode_s,
        "decode_s": decode_s,
        "ttft_s": statistics.median(r["ttft_s"] for r in rows),
        "end_to_end_tokens_per_s": batch * new_tokens / statistics.median(r["wall_s"] for r in rows),
        "rounds_decode_s": [r["decode_s"] for r in rows],
    }
    if "first_token_spread_s" in rows[0]:  # pic's: ~0 when every request's first token came in the same step
        summary["first_token_spread_s"] = max(r["first_token_spread_s"] for r in rows)
    return summary
