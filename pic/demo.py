"""``python -m pic demo``: compile a few stories, link them under each policy, compare with Full Recompute."""

from __future__ import annotations

import os

from pic import policies
from pic.api import PIC
from pic.link import Linked, SamplingParams
from pic.model.loading import EMBEDDED_MODEL

STORIES = (
    "Tom had a big red ball. He liked to kick it in the park with his dog, Max.",
    "Lily loved to sing. Every morning she sang a happy song for her mom and dad.",
    "A little bird fell from its nest. It was sad because it could not fly yet.",
)
QUERY = "One day, Tom and Lily found the little bird. They"


def run_demo(
    model: str | os.PathLike = EMBEDDED_MODEL,
    *,
    device: str | None = None,
    dtype: str | None = None,
    max_new_tokens: int = 48,
) -> None:
    """Print, per policy, the generation, TTFT and recomputed tokens for the stories in two orders.

    Raises:
        InvalidInputError: a bad ``max_new_tokens`` (before anything is loaded or printed).
    """
    SamplingParams(max_new_tokens=max_new_tokens)
    embedded = os.path.abspath(model) == str(EMBEDDED_MODEL)
    engine = PIC.from_pretrained(model, device=device, dtype=dtype)
    spec = engine.spec
    print(
        f"model: {spec.architecture} ({'embedded stories260K' if embedded else model}) on {spec.device}, {spec.dtype}"
    )
    ids = engine.compile(list(STORIES))
    for story, cid in zip(STORIES, ids, strict=True):
        print(f"  compiled {cid[:12]}  {story}")
    print(f"query: {QUERY!r}\n")
    for order_name, order in (("stories 1,2,3", [0, 1, 2]), ("stories 3,2,1", [2, 1, 0])):
        print(f"== linked {order_name} + query ==")
        reference = engine.link([ids[i] for i in order], QUERY, policy="full").generate(max_new_tokens)
        for name in policies.available():
            policy_ids = engine.compile(list(STORIES), policy=name)  # LegoLink-0 compiles its own way
            linked = engine.link([policy_ids[i] for i in order], QUERY, policy=name)
            out = linked.generate(max_new_tokens)
            same = _common_prefix(out.token_ids, reference.token_ids)
            label = f"[{linked.policy.spec}]"
            print(
                f"{label:<18} recomputed {_recomputed(linked)}, TTFT {out.ttft_s * 1e3:6.1f} ms, "
                f"first {same}/{len(reference.token_ids)} tokens equal Full Recompute"
            )
            print(f"        {out.text.strip()!r}")
        print()


def _recomputed(linked: Linked) -> str:
    """``"32/120 tokens"``, with the per-layer counts when they vary (CacheBlend)."""
    by_layer = linked.recomputed_by_layer
    per_layer = "" if len(set(by_layer)) == 1 else f" (by layer {','.join(map(str, by_layer))})"
    return f"{linked.num_recomputed:3d}/{len(linked.input_ids)} tokens{per_layer}"


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
