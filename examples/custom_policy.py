"""A custom recompute policy in a few lines: recompute the last k tokens of every chunk.

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


pic.load()
ids = pic.compile(["Tom had a big red ball.", "Lily loved to sing.", "The bird could not fly yet."])
for policy in ("naive", "lastk:4", LastK(k=6), "full"):
    out = pic.link(ids, "One day, Tom and Lily", policy=policy).generate(max_new_tokens=24)
    print(
        f"{str(policy):>8} recomputed {out.stats.num_recomputed_tokens:2d}/{out.stats.num_prompt_tokens}: {out.text!r}"
    )
