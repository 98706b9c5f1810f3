"""``python -m pic demo``: compile a few documents, link them under each policy, compare with Full Recompute.

A chat model (one whose tokenizer has a chat template, such as ``--model smollm2``) gets a RAG chat: the
documents compiled in the chat's context and linked where the template puts them, a question answered under
every policy (the engine's default first) beside Full Recompute, and each one's time to first token beside
transformers' own prefill of the same prompt. The embedded stories260K, which has no template, continues a
story instead.
"""

from __future__ import annotations

import itertools
import statistics
import time

import torch

from pic import policies
from pic.engine import PIC, Linked, SamplingParams
from pic.model.loading import EMBEDDED_MODEL

STORIES = (
    "Tom had a big red ball. He liked to kick it in the park with his dog, Max.",
    "Lily loved to sing. Every morning she sang a happy song for her mom and dad.",
    "A little bird fell from its nest. It was sad because it could not fly yet.",
)
QUERY = "One day, Tom and Lily found the little bird. They"
STORY_CONTEXT = "Here are three stories."  # what the stories are compiled after for a policy that needs a context

DOCUMENTS = (  # one line each: see docs/chat.md on separators and byte-level BPE tokenizers
    "The river Elbe rises in the Krkonose mountains of the Czech Republic. It flows north-west through Germany "
    "for about 1,100 kilometres and reaches the North Sea near the town of Cuxhaven.\n",
    "Hamburg, Germany's largest port, lies on the Elbe about 110 kilometres from the sea. Container ships from "
    "all over the world sail up the river to its docks every day.\n",
    "The Danube is the second-longest river in Europe. It rises in the Black Forest, flows through ten "
    "countries, among them Austria, Hungary and Serbia, and ends in the Black Sea.\n",
    "Dresden is known for its baroque old town on the banks of the Elbe. Its Frauenkirche, destroyed in 1945, "
    "was rebuilt from its own stones and reopened in 2005.\n",
)
QUESTION = "Into which sea does the Elbe flow?"


def run_demo(engine: PIC | None = None, *, max_new_tokens: int = 48) -> None:
    """Print, per policy, the generation, TTFT and recomputed tokens for the stories in two orders.

    Args:
        engine: the model (default: the embedded stories260K).

    Raises:
        InvalidInputError: a bad ``max_new_tokens`` (before anything is loaded or printed).
    """
    SamplingParams(max_new_tokens=max_new_tokens)
    engine = engine or PIC.from_pretrained(EMBEDDED_MODEL)
    spec = engine.spec
    choice = engine.dtype_choice
    print(f"model: {spec.architecture} ({engine.model_name}) on {spec.device}, {choice.name} ({choice.reason})")
    if getattr(engine.tokenizer, "chat_template", None):
        return _chat_demo(engine, max_new_tokens)
    ids = engine.compile(list(STORIES))
    for story, cid in zip(STORIES, ids, strict=True):
        print(f"  compiled {cid}  {story}")  # the whole id: link() takes nothing shorter
    print(f"query: {QUERY!r}\n")
    for order_name, order in (("stories 1,2,3", [0, 1, 2]), ("stories 3,2,1", [2, 1, 0])):
        print(f"== linked {order_name} + query ==")
        references = {}  # Full Recompute of the same prompt, per prefix
        for name in policies.available():
            context = STORY_CONTEXT if policies.resolve(name).needs_context else None  # APE
            policy_ids = engine.compile(list(STORIES), policy=name, context=context)  # LegoLink-0: its own way
            # a chunk compiled in context links only after that context: APE's prompt starts with it
            prefix = context or ""
            if prefix not in references:
                full = engine.link([ids[i] for i in order], QUERY, prefix=prefix, policy="full")
                references[prefix] = full.generate(max_new_tokens)
            reference = references[prefix]
            linked = engine.link([policy_ids[i] for i in order], QUERY, prefix=prefix, policy=name)
            out = linked.generate(max_new_tokens)
            same = _common_prefix(out.token_ids, reference.token_ids)
            label = _label(name, linked, order)
            print(
                f"{label:<18} recomputed {_recomputed(linked)}, TTFT {out.ttft_s * 1e3:6.1f} ms, "
                f"first {same}/{len(reference.token_ids)} tokens equal Full Recompute"
            )
            print(f"        {out.text.strip()!r}")
        print()


def _chat_demo(engine: PIC, max_new_tokens: int) -> None:
    """A RAG chat: the documents compiled in the chat's context (``link_chat(documents=...)``) and linked in two
    orders under every policy, the engine's default first, answers beside Full Recompute's, TTFT beside a
    transformers prefill of the same prompt (median of 3)."""
    messages = [
        {"role": "system", "content": "Answer the question using the documents."},
        {"role": "user", "content": f"Question: {QUESTION}\n\n{{documents}}Question: {QUESTION}"},
    ]
    context = engine.chat_context(messages)
    ids = engine.compile(list(DOCUMENTS), context=context)
    print(f"compiled in the chat's context {context!r}:")
    for doc, cid in zip(DOCUMENTS, ids, strict=True):
        print(f"  {cid}  {doc.strip()[:72]}...")
    print(f"question: {QUESTION!r} (asked before and after the documents)\n")
    default = engine.default_policy.name
    names = ["full", default, *(p for p in policies.available() if p not in ("full", default))]
    for order_name, order in (("documents 1,2,3,4", [0, 1, 2, 3]), ("documents 4,3,2,1", [3, 2, 1, 0])):
        docs = [DOCUMENTS[i] for i in order]
        full = engine.link_chat([], messages, documents=docs, policy="full")
        prefill_s = _transformers_prefill_s(engine, full.input_ids)
        reference = full.generate(max_new_tokens)
        print(f"== {order_name}: {len(full.input_ids)} prompt tokens; transformers prefill {prefill_s * 1e3:.0f} ms ==")
        for name in names:
            if name == "full":
                linked, out = full, reference
            else:  # LegoLink-0 compiles its own way
                linked = engine.link_chat([], messages, documents=docs, policy=name)
                out = linked.generate(max_new_tokens)
            same = "same as Full Recompute" if out.text == reference.text else "differs from Full Recompute"
            label = _label(name, linked, order, default=default)
            print(
                f"{label:<28} recomputed {_recomputed(linked)}, TTFT {out.ttft_s * 1e3:5.0f} ms "
                f"({prefill_s / out.ttft_s:4.1f}x the prefill), {same}"
            )
            print(f"        {out.text.strip()!r}")
        print()


def _label(name: str, linked, order: list[int], *, default: str | None = None) -> str:
    """``[spec]``, marked when it is the default, and the policy it ran when it chose another (``auto``) and the
    documents' order when it moved them (``auto``: by relevance), numbered as the demo numbers them (``order``:
    the documents' indices as linked)."""
    asked = policies.resolve(name)
    label = f"[{asked.spec}]" + (" (default)" if name == default else "")
    if linked.policy != asked:
        label += f" -> {linked.policy.spec}"
    if linked.order.moved:
        label += " order " + ",".join(str(order[i] + 1) for i in linked.order.indices)
    return label


def _transformers_prefill_s(engine: PIC, input_ids: torch.Tensor) -> float:
    """Median seconds of transformers' own forward over the prompt (the last position's logits only)."""
    model, ids = engine.model, input_ids.to(engine.spec.device)[None]
    times = []
    for _ in range(3):
        start = time.perf_counter()
        with torch.no_grad():
            model(ids, logits_to_keep=1)
        if engine.spec.device.type == "cuda":
            torch.cuda.synchronize(engine.spec.device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _recomputed(linked: Linked) -> str:
    """``"32/120 tokens"``, with the per-layer counts when they vary (CacheBlend)."""
    by_layer = linked.recomputed_by_layer
    runs = [(count, len(list(group))) for count, group in itertools.groupby(by_layer)]  # (tokens, layers)
    per_layer = "" if len(runs) == 1 else " (" + ", then ".join(f"{n} in {k} layers" for n, k in runs) + ")"
    return f"{linked.num_recomputed:3d}/{len(linked.input_ids)} tokens{per_layer}"


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
