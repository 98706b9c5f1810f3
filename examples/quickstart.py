"""Compile three documents once, then link them in two orders with different questions.

python examples/quickstart.py                      # the embedded stories260K model, CPU
python examples/quickstart.py Qwen/Qwen2.5-0.5B-Instruct
"""

import sys

import pic

engine = pic.load(*sys.argv[1:2])
docs = [
    "Tom had a big red ball. He liked to kick it in the park with his dog, Max.",
    "Lily loved to sing. Every morning she sang a happy song for her mom and dad.",
    "A little bird fell from its nest. It was sad because it could not fly yet.",
]
ids = pic.compile(docs)  # each document prefilled alone, once; ids are content hashes
print("cache ids:", ", ".join(ids))  # whole ids: link() takes nothing shorter

for order, query in ((ids, "One day, Tom"), (ids[::-1], "Then Lily")):
    linked = pic.link(order, query)  # auto: the most relevant last, recomputed whole (or Full Recompute if too short)
    print(f"\n{linked}")
    for piece in linked.stream(max_new_tokens=40):
        print(piece, end="", flush=True)
    print()

exact = pic.link(ids, "One day, Tom", policy="full").generate(max_new_tokens=40)
print(f"\nFull Recompute ({exact.stats.num_recomputed_tokens} tokens recomputed, TTFT {exact.ttft_s * 1e3:.1f} ms):")
print(exact.text)
