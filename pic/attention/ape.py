"""APE's attention over a linked request's chunks: a temperature and a scale on the context part.

APE (Yang, Chen and Chen, ICLR 2025, arXiv 2502.05431) links chunks encoded in parallel after a shared
prefix without recomputing any of them. At query time every query and generated token attends to the
*context* (every chunk token, pooled) and to the *rest* (prefix, query, generated tokens) separately, and
merges the two by their log-sum-exps, the context's sharpened by a temperature ``T`` and its weight scaled
by ``S`` (APE's code, ``ape/ape_llama.py``: ``lse_context * S * T`` against ``lse_other``)::

    lse_C = logsumexp_{j in C}(s_j / T)     lse_O = logsumexp_{j in O}(s_j)
    w_C = sigmoid(S * T * lse_C - lse_O)
    out = w_C * softmax_C(s / T) V_C + (1 - w_C) * softmax_O(s) V_O

which is one softmax over the scores with the context's replaced by ``s_j / T + (S * T - 1) * lse_C``: that
is how it is computed here (float32), under the request's exact causal mask. ``T = S = 1`` is plain
attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ContextScaling:
    """APE's attention parameters for one request.

    Attributes:
        temperature: ``T``: context scores are divided by it (``< 1`` sharpens).
        scale: ``S``: the context's log-sum-exp is multiplied by ``S * T`` before the merge (``< 1`` lowers its
            share, offsetting the rise that ``T < 1`` gives it).
    """

    temperature: float
    scale: float


def ape_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None,
    context: torch.Tensor,
    scalings: list[ContextScaling | None],
    *,
    scaling: float,
) -> torch.Tensor:
    """Attention with APE's context scaling, for the sequences that have one (``None``: plain attention).

    Args:
        q: ``[b, Hq, n, D]`` rotated queries.
        k, v: ``[b, Hkv, S, D]`` rotated keys and values (GQA: query head ``h`` reads KV head ``h // group``).
        allowed: ``[b, n, S]`` bool, where a query may attend (``None``: everywhere).
        context: ``[b, S]`` bool, the chunk slots (APE's context).
        scalings: per sequence, its ``ContextScaling`` or ``None``.
        scaling: the softmax scale.

    Returns:
        ``[b, Hq, n, D]`` in ``q``'s dtype.
    """
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1).float(), v.repeat_interleave(group, dim=1).float()
    scores = (q.float() @ k.transpose(-1, -2)) * scaling  # [b, Hq, n, S]
    mask = torch.ones_like(scores, dtype=torch.bool) if allowed is None else allowed[:, None].expand_as(scores)
    temperature = torch.tensor([1.0 if s is None else s.temperature for s in scalings], device=q.device)
    exponent = torch.tensor([1.0 if s is None else s.scale * s.temperature for s in scalings], device=q.device)
    ctx = context[:, None, None, :] & mask  # [b, Hq, n, S]
    tempered = scores / temperature[:, None, None, None]
    lse = tempered.masked_fill(~ctx, float("-inf")).logsumexp(-1, keepdim=True)  # [b, Hq, n, 1]
    bias = torch.where(lse.isfinite(), (exponent[:, None, None, None] - 1) * lse, torch.zeros_like(lse))
    logits = torch.where(context[:, None, None, :], tempered + bias, scores).masked_fill(~mask, float("-inf"))
    return (logits.softmax(-1) @ v).to(q.dtype)
