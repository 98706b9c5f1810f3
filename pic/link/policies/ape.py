"""APE: no recompute at all; the query's attention over the chunks is tempered and scaled instead."""

from __future__ import annotations

import torch
from pydantic import Field

from pic.attention.ape import ContextScaling
from pic.link.layout import Layout
from pic.link.policies.base import Policy


class APE(Policy):
    """APE, Adaptive Parallel Encoding (Yang, Chen and Chen, ICLR 2025, arXiv 2502.05431).

    Chunks are compiled in context, after a shared prefix whose KV is dropped (``compile(docs, context=...)``:
    the system prompt; chunks compiled otherwise are refused), and linked in *parallel*: each at the
    positions right after the prefix, the query after the longest chunk. Nothing cached is recomputed. Every
    query and generated token attends to the chunks with their scores divided by ``temperature`` and their
    log-sum-exp scaled by ``scale * temperature`` against the rest's (``pic.attention.ape``). The paper's
    defaults are ``temperature = scale = 0.9``; ``temperature = scale = 1`` with ``parallel=False`` is Naive
    over in-context chunks.

    Deviations: APE's code rotates K at encoding time (its chunks then sit at fixed positions); pic keeps K
    before RoPE and rotates it at link time, at the same positions. ``parallel=False`` (an option for
    sweeps) keeps pic's sequential positions. Runs on the torch attention backend only (the Triton kernel
    does not implement the merge).
    """

    name = "ape"
    needs_context = True
    temperature: float = Field(default=0.9, gt=0.0, le=2.0)
    scale: float = Field(default=0.9, gt=0.0, le=2.0)
    parallel: bool = True

    def select(self, layout: Layout) -> torch.Tensor:
        return torch.zeros(layout.num_tokens, dtype=torch.bool)

    def context_scaling(self) -> ContextScaling | None:
        return ContextScaling(temperature=self.temperature, scale=self.scale)

    @property
    def parallel_positions(self) -> bool:
        return self.parallel
