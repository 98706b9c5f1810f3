"""Query-aware picks from the 2026 literature: a probe runs the query over the linked KV, its attention scores the
chunk tokens, and the top ``ratio`` of them are recomputed with the query in a second pass (``pic.link.probe``).

ProphetKV, InfoFlow KV and FusionRAG differ in what they read of the probe: which layers, and how the attention of
many heads and query tokens becomes one score per token. Each is faithful to its paper (and to the authors' code
where it is public), with the deviations named in its docstring. What they share: the probe's query is the link's
whole query (the chat template's tokens and the reply's start included: pic does not know which of its tokens are
the user's question), and the choice is one global top ``ratio`` of the chunk tokens, the same set in every layer.
"""

from __future__ import annotations

import math

import torch
from pydantic import Field

from pic.errors import PolicyError
from pic.link.layout import Layout
from pic.link.policies.base import Policy
from pic.link.policies.scoring import smooth, top_chunk_tokens, with_heads
from pic.link.probe import Probe


class ProbePicks(Policy):
    """A probe, then the top ``ratio`` of the chunk tokens by ``score``; subclasses say which layers the probe
    scores (``probe_layers``) and how (``score``). ``heads`` adds the first ``heads`` tokens of every chunk that does
    not start the prompt (LegoLink's sinks; in none of the papers)."""

    ratio: float = Field(default=0.2, ge=0.0, le=1.0)
    heads: int = Field(default=0, ge=0)

    def select(self, layout: Layout) -> torch.Tensor:
        return torch.zeros(layout.num_tokens, dtype=torch.bool)  # the probe: prefix and query only

    def score(self, probe: Probe) -> torch.Tensor:
        """``[T]`` float32: the probe's score of each prompt token (only chunk tokens are ranked)."""
        raise NotImplementedError

    def after_probe(self, probe: Probe) -> torch.Tensor:
        return with_heads(top_chunk_tokens(self.score(probe), probe.layout, self.ratio), probe.layout, self.heads)


class ProphetKV(ProbePicks):
    """ProphetKV (arXiv 2602.02579, ICML 2026).

    Stage 1 (the probe): the prefix and query run through every layer over the chunks' KV as compiled; at
    each layer the query's attention over the chunk tokens is taken (one softmax over the chunk tokens,
    averaged over heads and query tokens: ``Probe.mass``). Stage 2: those scores are averaged over the
    layers, the top ``ratio`` of the chunk tokens (one global choice) are recomputed through every layer
    with the query. ``ratio=1.0`` is Full Recompute, ``ratio=0`` the probe followed by Naive's pass.

    Options for sweeps (defaults: the paper): ``first_layer`` / ``num_layers``, the layers averaged (the
    paper: all; the probe scores only those and the query leaves it after the last); ``smoothing``, a moving
    average over ``smoothing`` tokens before the choice (A³'s; the paper: none).

    Deviations: the paper does not say how heads are merged (its appendix averages them, as here). Its probe runs
    only the user's question; pic's runs the whole query and the prefix too, whose KV has to be computed anyway and
    is exact (the second pass keeps it).
    """

    name = "prophetkv"
    ratio: float = Field(default=0.2, ge=0.0, le=1.0)
    first_layer: int = Field(default=0, ge=0)
    num_layers: int | None = Field(default=None, ge=1)
    smoothing: int = Field(default=1, ge=1, le=64)
    heads: int = Field(default=0, ge=0)

    def check_model(self, *, num_layers: int) -> None:
        if self.first_layer >= num_layers:
            raise PolicyError(f"policy {self.spec!r}: first_layer={self.first_layer} but the model has {num_layers}")

    def probe_layers(self, num_layers: int) -> range:
        end = num_layers if self.num_layers is None else min(self.first_layer + self.num_layers, num_layers)
        return range(self.first_layer, end)

    def score(self, probe: Probe) -> torch.Tensor:
        return smooth(probe.mass[probe.layers.start : probe.layers.stop].mean(0), self.smoothing)


class InfoFlow(ProbePicks):
    """InfoFlow KV (arXiv 2603.05353, ICML 2026; the authors' code, github.com/tx467/InfoFlow-KV).

    The probe runs the query over the linked KV with every key rotated at its linked position (pic always does:
    the paper's "inference-consistent RoPE geometry"). At each layer of an upper-middle band, the query's attention
    weights (the softmax over every key, the query's own included) are averaged over heads, and each token's score
    is the L2 norm of its column over the query tokens (``Probe.norm``); the band's scores are averaged, and the top
    ``ratio`` (0.15) of the chunk tokens are recomputed in every layer. The probe stops after the band.

    ``start`` / ``stop``: the band as fractions of the depth, layers ``floor(start * L)`` to ``ceil(stop * L) - 1``.
    The code reads layers 22-25 of Llama-3.1-8B (32 layers: 0.69-0.81 of the depth) and of Qwen3-14B (40 layers:
    0.55-0.65); the default, 0.6-0.8, lies between.

    Deviations: the code's probe is the bare question, pic's the whole query (the module docstring); the code leaves
    its first chunk out of the choice (it is exact there, at the prompt's start), pic chooses among every chunk (one
    after a prefix is not exact); the code recomputes layer 0 for every token, pic only the chosen ones (layer 0
    for all would cost 1/L of a Full Recompute); the band is a share of the depth, not fixed layer numbers.
    """

    name = "infoflow"
    ratio: float = Field(default=0.15, ge=0.0, le=1.0)
    start: float = Field(default=0.6, ge=0.0, lt=1.0)
    stop: float = Field(default=0.8, gt=0.0, le=1.0)
    heads: int = Field(default=0, ge=0)

    def probe_layers(self, num_layers: int) -> range:
        first = min(math.floor(self.start * num_layers), num_layers - 1)
        return range(first, max(math.ceil(self.stop * num_layers), first + 1))

    def score(self, probe: Probe) -> torch.Tensor:
        return probe.norm[probe.layers.start : probe.layers.stop].mean(0)


class FusionRAG(ProbePicks):
    """FusionRAG's query-guided selection (arXiv 2601.12904, SIGMOD 2026, section 3.2).

    The question is prefilled over the reused KV; at the final layer its queries are multiplied by the chunks' keys,
    and each token's column of attention weights is summed over the query tokens (and heads): ``Probe.attention``
    at the last layer. The top ``ratio`` (0.15) of the chunk tokens, one global choice, are recomputed in every
    layer with the question.

    Deviations: the paper's offline step (each chunk prefilled again after its ten most similar chunks, which its
    ablation credits with most of the gain) is not done: pic compiles chunks alone, or in a chat's context
    (``compile(..., context=)``). The paper does not say how heads are merged; here they are averaged. Its probe is
    the question, pic's the whole query (the module docstring).
    """

    name = "fusionrag"
    ratio: float = Field(default=0.15, ge=0.0, le=1.0)
    heads: int = Field(default=0, ge=0)

    def probe_layers(self, num_layers: int) -> range:
        return range(num_layers - 1, num_layers)

    def score(self, probe: Probe) -> torch.Tensor:
        return probe.attention[probe.layers.start]
