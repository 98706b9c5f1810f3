"""Custom recompute policies in a few lines: a static one (the last k tokens of every chunk) and a query-aware
one (the chunk tokens the query attends to most in a probe, as ProphetKV chooses).

python examples/custom_policy.py
"""

import torch

import pic


@pic.policies.register
class LastK(pic.policies.Policy):
    """Recompute the last ``k`` tokens of every chunk (prefix and query are always recomputed)."""

    name = "lastk"  # spec strings: "lastk" (k=8), "lastk:4"
    k: int = 8  # a validated pydantic field: "lastk:many" is a clear pic.PolicyError

    def select(self, layout: pic.policies.Layout) -> torch.Tensor:
        mask = torch.zeros(layout.num_tokens, dtype=torch.bool)  # [T], True = recompute
        for seg in layout.chunks:
            mask[seg.token_start + max(seg.num_tokens - self.k, 0) : seg.token_start + seg.num_tokens] = True
        return mask


@pic.policies.register
class TopMass(pic.policies.Policy):
    """Probe first (the prefix and query over the chunks as compiled), then recompute the chunk tokens that
    the query attended to most in the later half of the layers."""

    name = "topmass"  # "topmass" (ratio 0.2), "topmass:0.5"
    ratio: float = 0.2

    def select(self, layout: pic.policies.Layout) -> torch.Tensor:
        return torch.zeros(layout.num_tokens, dtype=torch.bool)  # the probe runs the prefix and query only

    def after_probe(self, probe: pic.policies.Probe) -> torch.Tensor:
        late = probe.mass[probe.mass.shape[0] // 2 :].mean(0)  # [T]: the query's attention, later layers
        return pic.policies.top_chunk_tokens(late, probe.layout, self.ratio)


pic.load()
ids = pic.compile(["Tom had a big red ball.", "Lily loved to sing.", "The bird could not fly yet."])
for policy in ("naive", "lastk:4", LastK(k=6), "topmass", "topmass:0.5", "full"):
    out = pic.link(ids, "One day, Tom and Lily", policy=policy).generate(max_new_tokens=24)
    print(
        f"{str(policy):>11} recomputed {out.stats.num_recomputed_tokens:2d}/{out.stats.num_prompt_tokens}: {out.text!r}"
    )
