"""Decode tokens/s side by side on a CPU (``cpu_rag.py``, ``cpu.py``): each engine's prompt is processed once, and
every round times only the decode steps after the first token, so rounds of many variants stay short.

- transformers: its forward one token at a time over a copy of the prompt's ``DynamicCache`` (the loop ``generate``
  runs, without its logits processors), greedy;
- llama.cpp: ``eval`` one token at a time from the prompt's saved state (``save_state``/``load_state``), greedy;
- pic: ``link`` (timed apart) then ``generate``, or ``generate_together`` for a batch of the same request; the rate
  is the tokens after each request's first over the longest ``stats.decode_s``.

Each function returns a callable that runs one round and returns tokens/s (``_gpu.interleaved`` takes them).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import torch

import pic
from pic.engine import generate_together
from pic.evaluation.workload import cache_argument


def hf_rate(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> Callable[[], float]:
    """transformers' decode after ``prompt``: ``new_tokens - 1`` greedy steps over a copy of its prompt cache."""
    name = cache_argument(model)  # transformers 5.24 renamed past_key_values
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
    prompt_cache, first = out.past_key_values, int(out.logits[0, -1].argmax())

    def run() -> float:
        cache, token = copy.deepcopy(prompt_cache), first
        start = time.perf_counter()
        with torch.no_grad():
            for _ in range(new_tokens - 1):
                logits = model(torch.tensor([[token]]), **{name: cache}, use_cache=True).logits
                token = int(logits[0, -1].argmax())
        return (new_tokens - 1) / (time.perf_counter() - start)

    return run


def llama_rate(llm, prompt: list[int], new_tokens: int, greedy: Callable[[object], int]) -> Callable[[], float]:
    """llama.cpp's decode after ``prompt`` (evaluated once, its state saved): ``new_tokens - 1`` greedy ``eval``s."""
    llm.reset()
    llm.eval(prompt)
    state, first = llm.save_state(), greedy(llm)

    def run() -> float:
        llm.load_state(state)
        token = first
        start = time.perf_counter()
        for _ in range(new_tokens - 1):
            llm.eval([token])
            token = greedy(llm)
        return (new_tokens - 1) / (time.perf_counter() - start)

    return run


def pic_rate(link: Callable[[], pic.Linked], batch: int, new_tokens: int) -> Callable[[], float]:
    """pic's decode of ``batch`` copies of the request ``link()`` links (together when more than one)."""

    def run() -> float:
        linked = [link() for _ in range(batch)]
        gens = generate_together(linked, new_tokens) if batch > 1 else [linked[0].generate(new_tokens)]
        tokens = sum(len(g.token_ids) - 1 for g in gens)
        return tokens / max(g.stats.decode_s for g in gens)

    return run
