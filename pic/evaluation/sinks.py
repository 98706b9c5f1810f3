"""Attention sinks: how much attention the query pays to the first token of each linked chunk, per layer.

A model trained on whole sequences learns to park attention on a sequence's first token (the "attention
sink"). A chunk compiled alone starts a sequence of its own, so its cached KV carries a sink at its first
token; linked behind other text, that cached token keeps drawing attention which, in the model's own
forward over the whole prompt (Full Recompute), goes to the prompt's real first token. Recomputing each
later chunk's first tokens (LegoLink, MEPIC) removes those extra sinks; that is what EPIC's LegoLink rests
on. This module measures it on pic's own forward: while a request is linked, an attention observer
(``ModelRunner.observe_attention``) reads every layer's softmax weights from the query tokens over the
request's slots, and sums them on the prompt's first token and on the first token of every later chunk
(every chunk but one at position 0).
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import torch

from pic.attention import AttentionBatch
from pic.attention.torch_backend import attention_weights
from pic.engine import PIC, Linked

T = TypeVar("T")


@dataclass(frozen=True)
class SinkProfile:
    """Mean attention mass from the query tokens (averaged over query tokens and heads), per layer.

    Attributes:
        policy: the policy's spec.
        num_cases: cases averaged.
        prompt_first: ``[num_layers]``, on the prompt's first token.
        chunk_firsts: ``[num_layers]``, on the first tokens of the later chunks, summed over them.
        uniform_chunk_firsts: what ``chunk_firsts`` would be if attention were spread evenly over the
            prompt (later chunks over prompt tokens), the baseline for "abnormally high".
    """

    policy: str
    num_cases: int
    prompt_first: list[float]
    chunk_firsts: list[float]
    uniform_chunk_firsts: float


@dataclass(frozen=True)
class CaseSinks:
    """One case under one policy: ``SinkProfile``'s per-layer masses before averaging over cases."""

    prompt_first: list[float]
    chunk_firsts: list[float]
    uniform_chunk_firsts: float


def measure_sinks(engine: PIC, link: Callable[[T], Linked], rows: Mapping[str, T]) -> dict[str, CaseSinks]:
    """One case under each row (label -> what ``link`` takes): ``link(row)`` runs once to compile and learn the
    layout, then again with the observer on (only a forward running one recompute pass alone is read: the
    link's own; a query-aware policy's second pass, the last, is what counts)."""
    out = {}
    for label, row in rows.items():
        linked = link(row)  # compiles (unobserved) and links once, to learn the layout
        linked.release()
        layout = linked.layout
        later = [seg.token_start for seg in layout.chunks if seg.token_start > 0]
        num_query = layout.query.num_tokens
        per_layer: dict[int, torch.Tensor] = {}
        observe = functools.partial(_observe, per_layer, slots=layout.slots, num_query=num_query)
        with engine.observe_attention(observe):
            link(row).release()
        layers = [per_layer[i] for i in sorted(per_layer)]
        out[label] = CaseSinks(
            prompt_first=[float(m[0]) for m in layers],
            chunk_firsts=[float(m[later].sum()) for m in layers],
            uniform_chunk_firsts=len(later) / layout.num_tokens,
        )
    return out


def _observe(
    per_layer: dict[int, torch.Tensor],
    layer: int,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    plan: AttentionBatch,
    scaling: float,
    window: int | None,
    *,
    slots: torch.Tensor,
    num_query: int,
) -> None:
    """Record ``[T]``: the attention mass of the last ``num_query`` tokens (the query) on each prompt token
    (``slots`` ``[T]``: the tokens' request slots), averaged over them and the heads."""
    if len(plan.prefill_seqs) != 1 or plan.decode_seqs.numel():
        return  # not a lone recompute pass
    seq = plan.prefill_seqs[0]
    weights = attention_weights(q, k_cache, plan, seq, scaling=scaling, sliding_window=window)  # [Hq, n, S]
    mass = weights[:, -num_query:].mean(dim=(0, 1))  # [S] over the request's slots
    per_layer[layer] = mass[slots.to(mass.device)].cpu()


def summarize_sinks(measured: list[dict[str, CaseSinks]]) -> list[SinkProfile]:
    """Per policy, the per-layer means over the cases ``measure_sinks`` measured."""

    def mean_by_layer(rows: list[list[float]]) -> list[float]:
        return [statistics.fmean(layer) for layer in zip(*rows, strict=True)]

    profiles = []
    for spec in measured[0] if measured else []:
        cases = [m[spec] for m in measured]
        profiles.append(
            SinkProfile(
                policy=spec,
                num_cases=len(cases),
                prompt_first=mean_by_layer([c.prompt_first for c in cases]),
                chunk_firsts=mean_by_layer([c.chunk_firsts for c in cases]),
                uniform_chunk_firsts=statistics.fmean(c.uniform_chunk_firsts for c in cases),
            )
        )
    return profiles
