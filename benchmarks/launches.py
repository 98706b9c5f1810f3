"""Operations per layer of a link's pass and of a decode step (on a GPU each is about one kernel launch).

    python benchmarks/launches.py                       # the embedded model, float32 and bfloat16
    python benchmarks/launches.py --model smollm2 --out benchmarks/results/launches.json

Counts what the engine's thread dispatches inside each layer (``pic.model.op_count``: views and metadata left out),
for a naive link's pass over the query, a Full Recompute pass over the whole prompt, and the steady decode steps
after them. ``ops`` counts ``pic::rms_norm`` as one (one kernel on CUDA); ``kernels`` counts what its CPU
implementation runs (transformers' operations). Counts, not times: the same on a loaded machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from collections import Counter
from pathlib import Path

import torch

import pic
from pic.model.op_count import ForwardOps, link_ops

DOCS = ["Once upon a time there was a cat who liked the sun.", "The dog ran to the park and played with a red ball."]
QUERY = "What did the dog do?"


def summary(forward: ForwardOps) -> dict:
    by_name = sum(forward.layers, Counter())
    num_layers = len(forward.layers)
    return {
        "rows": forward.num_rows,
        "ops_per_layer": forward.per_layer(),
        "kernels_per_layer": forward.per_layer(kernels=True),
        "by_name": {name: round(n / num_layers, 2) for name, n in by_name.most_common()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="pic.load's name (default: the embedded stories260K)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    rows = []
    for dtype in args.dtypes.split(","):
        config = pic.PICConfig(eos_token_ids=())  # every step decodes: no end of generation before the count
        engine = pic.load(args.model or pic.EMBEDDED_MODEL, dtype=dtype, config=config)
        ids = engine.compile(DOCS)
        for policy in ("naive", "full"):
            for kind, forward in link_ops(engine, ids, QUERY, policy).items():
                rows.append({"dtype": dtype, "policy": policy, "forward": kind, **summary(forward)})
        engine.close()
    print("| dtype | policy | forward | rows | ops per layer | kernels per layer (pic's operators expanded) |")
    print("|---|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['dtype']} | {r['policy']} | {r['forward']} | {r['rows']} | {r['ops_per_layer']} | "
              f"{r['kernels_per_layer']} |")  # fmt: skip
    if args.out:  # an earlier commit's counts ("before", which docs/gpu.md's table shows) are kept
        kept = json.loads(args.out.read_text()).get("before") if args.out.exists() else None
        result = {"commit": commit, "model": args.model or "stories260K", "rows": rows}
        result |= {"before": kept} if kept is not None else {}
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
