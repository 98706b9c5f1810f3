"""The probe of a query-aware policy: the query run over the linked KV, its attention recorded layer by layer.

A query-aware policy (ProphetKV) asks the query which cached tokens matter before it chooses: the request's
first pass runs the tokens ``select`` names (usually none cached: the prefix and the query, Naive's pass)
over the chunks' KV as compiled, and records, at the layers the policy reads (``Policy.probe_layers``), how much
attention the query tokens pay to each prompt token. The policy then chooses the chunk tokens to recompute from
that (``Policy.after_probe``), and a second pass recomputes them with the query. The probe's prefix KV is exact
(the prefix precedes every chunk), so the second pass leaves the prefix alone; the query runs again, over the
corrected KV.

A policy that reads only some layers pays for no others: the scores are computed at those layers only, and the
query leaves the probe after the last of them (its KV in the layers above is never read: the second pass
writes it). The prefix runs every layer, as its KV is the request's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pic.attention.scores import query_scores
from pic.kv import RequestKV
from pic.link.layout import Layout
from pic.model.inputs import LayerView

# Scores a probe holds at once (heads x query rows x prompt tokens): longer queries are taken in row tiles.
_MAX_SCORES = 1 << 24


@dataclass(frozen=True)
class Probe:
    """What the query saw in a probe pass, per layer.

    Attributes:
        layout: the linked prompt.
        mass: ``[num_layers, T]`` float32 (CPU): at each layer, the attention each chunk token receives from
            the query tokens with the softmax taken over the chunk tokens only (ProphetKV's ``alpha_l``),
            averaged over heads and query tokens. 0 for prefix and query tokens; each recorded layer's row
            sums to 1.
        attention: ``[num_layers, T]`` float32 (CPU): the attention weights as the model computed them (the
            softmax over every token a query token may attend: prefix, chunks and the query before it),
            averaged over heads and query tokens; each recorded layer's row sums to 1.
        recomputed: ``[T]`` bool (CPU), the tokens the probe pass ran.
        norm: ``[num_layers, T]`` float32 (CPU): InfoFlow's attention norm, the L2 norm over the query tokens of
            ``attention``'s weights averaged over heads (not over query tokens); ``None`` when not recorded.
        layers: the layers recorded (``Policy.probe_layers``); the rows of the others are 0.
    """

    layout: Layout
    mass: torch.Tensor
    attention: torch.Tensor
    recomputed: torch.Tensor
    norm: torch.Tensor | None = None
    layers: range | None = None

    def __post_init__(self) -> None:
        if self.layers is None:
            object.__setattr__(self, "layers", range(self.mass.shape[0]))


class ProbeRecorder:
    """The ``after_layer`` hook of a probe pass: records ``Probe.mass``, ``attention`` and ``norm`` at ``layers``,
    and takes the query out of the pass after the last of them.

    Args:
        layout: the request's linked prompt.
        req: its KV (the query attends over its slots; chunk slots hold the chunks' KV as compiled).
        num_layers: layers of the model.
        layers: the layers to record (default: all).

    Attributes:
        exit: the layer after which the query leaves the pass (``None``: it runs every layer).
    """

    def __init__(self, layout: Layout, req: RequestKV, *, num_layers: int, layers: range | None = None) -> None:
        device = req.cache.device
        self.layers = range(num_layers) if layers is None else layers
        self._num_query = layout.query.num_tokens  # the pass's last tokens: the query is always run, last
        self._k_rows = req.physical(layout.slots.to(device))  # [T] cache rows of every prompt token
        self._positions = layout.positions.to(device)  # [T]
        self._chunk = layout.cached.to(device)  # [T]
        self.mass = torch.zeros(num_layers, layout.num_tokens, device=device)
        self.attention = torch.zeros(num_layers, layout.num_tokens, device=device)
        self.norm = torch.zeros(num_layers, layout.num_tokens, device=device)
        # the query leaves after the last recorded layer (the prefix rows stay: their KV is the request's)
        self.exit = self.layers[-1] if self.layers and self.layers[-1] < num_layers - 1 else None

    def __call__(self, view: LayerView) -> torch.Tensor | None:
        if view.layer not in self.layers:
            return None
        q = view.q[-self._num_query :]  # [nq, Hq, D]
        k = view.k_cache.flatten(0, 1).index_select(0, self._k_rows)  # [T, Hkv, D]
        q_positions = self._positions[-self._num_query :]
        tile = max(1, _MAX_SCORES // (q.shape[1] * k.shape[0]))
        for start in range(0, q.shape[0], tile):
            scores = query_scores(
                q[start : start + tile], q_positions[start : start + tile], k, self._positions,
                rope=view.rope, scaling=view.scaling, sliding_window=view.sliding_window,
            )  # fmt: skip  # [Hq, rows, T]
            weights = scores.softmax(-1)
            self.attention[view.layer] += weights.sum((0, 1))
            self.norm[view.layer] += weights.mean(0).square().sum(0)
            chunk = scores.masked_fill(~self._chunk, float("-inf")).softmax(-1)  # NaN: a row sees no chunk token
            self.mass[view.layer] += chunk.nan_to_num(0.0).sum((0, 1))
        heads_rows = q.shape[1] * q.shape[0]
        self.attention[view.layer] /= heads_rows
        self.mass[view.layer] /= heads_rows
        self.norm[view.layer].sqrt_()
        return self._leave(view) if view.layer == self.exit else None

    def _leave(self, view: LayerView) -> torch.Tensor:
        """``[n']`` bool: every row of the pass but the query's, which leaves it here."""
        keep = torch.ones(view.alive.shape[0], dtype=torch.bool, device=view.alive.device)
        keep[-self._num_query :] = False
        return keep

    def probe(self, layout: Layout, recomputed: torch.Tensor) -> Probe:
        return Probe(
            layout=layout, mass=self.mass.cpu(), attention=self.attention.cpu(), recomputed=recomputed,
            norm=self.norm.cpu(), layers=self.layers,
        )  # fmt: skip
