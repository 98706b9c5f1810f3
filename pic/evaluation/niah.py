"""RULER's needle-in-a-haystack tasks for ``pic eval accuracy --workload niah``.

Each case is one haystack of real English prose (the prose of CPython's reference topics,
``pic.evaluation.haystack``: a contiguous window of its sentences from a seeded offset) with "needles"
inserted at sentence boundaries, cut at sentence boundaries into chunks, the documents, one line each.
The needles and questions are RULER's (Hsieh et al., 2024, "RULER: What's the real context size of your
long-context language models?"):

- ``single``: one needle, "One of the special magic numbers for wasteful-ax is: 4821937."; the question
  asks for the key's number.
- ``multikey``: that needle and 3 distractor needles of the same form with other keys and numbers.
- ``multivalue``: 4 needles with the same key and different numbers; the question asks for all of them.

A needle's depth (0: the haystack's start, 1: its end) is drawn uniformly; the workload's description
records the asked needles' depths per case. Sizes are in approximate tokens, counted as characters / 4
(``CHARS_PER_TOKEN``), so the workload is the same for every model and needs no tokenizer: real counts
differ by model (SmolLM2 reads this prose at about 4.9 characters a token: 2000 make about 1670). A chunk
is cut once it holds ``chunk_tokens * 4`` characters, so it may exceed that by one sentence; the haystack
(needles included) holds at least ``haystack_tokens * 4`` characters less a sentence. Everything is drawn
from a seeded ``random.Random``: the same arguments give the same cases on every machine with the same
Python version.
"""

from __future__ import annotations

import random

from pic.errors import InvalidInputError
from pic.evaluation import haystack
from pic.evaluation.qa import QACase, QAKind, QAWorkload

CHARS_PER_TOKEN = 4
NUM_NEEDLES = 4  # multikey: the needle and 3 distractors; multivalue: 4 numbers for one key
NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION = "What is the special magic number for {key} mentioned in the provided text?"
ANSWER_PREFIX = "The special magic number for {key} mentioned in the provided text is"
QUESTION_ALL = "What are all the special magic numbers for {key} mentioned in the provided text?"
ANSWER_PREFIX_ALL = "The special magic numbers for {key} mentioned in the provided text are"
KINDS = {"single": QAKind.NIAH_SINGLE, "multikey": QAKind.NIAH_MULTIKEY, "multivalue": QAKind.NIAH_MULTIVALUE}
MIXED = ("single", "multikey", "single", "multikey", "multivalue")  # ``kind="mixed"`` cycles these
ADJECTIVES = (
    "wasteful", "quiet", "bright", "ancient", "clumsy", "gentle", "hollow", "eager", "fragile", "grumpy",
    "humble", "jolly", "lively", "modern", "nervous", "polite", "rapid", "shiny", "tender", "vivid",
    "wooden", "brave", "dusty", "fancy",
)  # fmt: skip
NOUNS = (
    "ax", "kettle", "lantern", "meadow", "pebble", "violin", "harbor", "blanket", "cabinet", "feather",
    "garden", "helmet", "island", "ladder", "mirror", "needle", "orchard", "pillow", "saddle", "teapot",
    "umbrella", "wagon", "basket", "candle",
)  # fmt: skip


def niah_workload(
    *,
    num_cases: int,
    kind: str = "mixed",
    haystack_tokens: int = 2000,
    chunk_tokens: int = 256,
    question_first: bool = True,
    seed: int = 0,
) -> QAWorkload:
    """``num_cases`` needle-in-a-haystack questions of ``kind`` (``single``, ``multikey``, ``multivalue``, or
    ``mixed``: those in turn, single, multikey, single, multikey, multivalue), each over a haystack of about
    ``haystack_tokens`` tokens in chunks of about ``chunk_tokens`` (tokens counted as 4 characters: see the
    module's docstring); ``question_first`` asks the question before the documents too (RULER asks it after
    only).

    Raises:
        InvalidInputError: an unknown kind, fewer than 1 case, a haystack under 200 tokens or over the prose
            available, or chunks under 32 tokens or longer than the haystack.
    """
    corpus = haystack.sentences()
    available = sum(len(s) + 1 for s in corpus) // CHARS_PER_TOKEN
    if kind not in (*KINDS, "mixed"):
        raise InvalidInputError(f"kind={kind!r}: must be one of {', '.join([*KINDS, 'mixed'])}")
    if num_cases < 1:
        raise InvalidInputError(f"num_cases={num_cases}: must be at least 1")
    if not 200 <= haystack_tokens <= available:
        raise InvalidInputError(f"haystack_tokens={haystack_tokens}: must be within 200 to {available}")
    if not 32 <= chunk_tokens <= haystack_tokens:
        raise InvalidInputError(f"chunk_tokens={chunk_tokens}: must be within 32 to haystack_tokens={haystack_tokens}")
    rng = random.Random(seed)
    kinds = [MIXED[i % len(MIXED)] if kind == "mixed" else kind for i in range(num_cases)]
    built = [
        _case(rng, corpus, k, haystack_tokens * CHARS_PER_TOKEN, chunk_tokens * CHARS_PER_TOKEN, question_first)
        for k in kinds
    ]
    description = {
        "source": "pic.evaluation.niah_workload",
        "num_cases": num_cases,
        "kind": kind,
        "haystack_tokens": haystack_tokens,
        "chunk_tokens": chunk_tokens,
        "chars_per_token": CHARS_PER_TOKEN,
        "question_first": question_first,
        "seed": seed,
        "haystack": haystack.source(),
        "num_by_kind": {KINDS[k].value: kinds.count(k) for k in KINDS},
        "depths": [depths for _, depths in built],  # per case, the asked needles' depths in haystack order
    }
    return QAWorkload(cases=tuple(case for case, _ in built), description=description)


def _case(
    rng: random.Random, corpus: tuple[str, ...], kind: str, haystack_chars: int, chunk_chars: int, question_first: bool
) -> tuple[QACase, list[float]]:
    """One case and its asked needles' depths."""
    keys = [
        f"{a}-{n}" for a, n in zip(rng.sample(ADJECTIVES, NUM_NEEDLES), rng.sample(NOUNS, NUM_NEEDLES), strict=True)
    ]
    values = [str(v) for v in rng.sample(range(1_000_000, 10_000_000), NUM_NEEDLES)]
    if kind == "single":
        needles = [(keys[0], values[0])]
    elif kind == "multikey":
        needles = list(zip(keys, values, strict=True))
    else:
        needles = [(keys[0], value) for value in values]
    texts = [NEEDLE.format(key=key, value=value) for key, value in needles]
    depths = [rng.random() for _ in needles]
    window = _window(rng, corpus, haystack_chars - sum(len(t) + 1 for t in texts))
    # (sentence, needle index or None): a needle goes before the sentence at round(depth * sentences).
    items: list[tuple[str, int | None]] = [(s, None) for s in window]
    where = {i: round(depths[i] * len(window)) for i in range(len(texts))}
    for i in sorted(where, key=lambda i: (where[i], i), reverse=True):
        items.insert(where[i], (texts[i], i))
    documents, chunk_of = _chunks(items, chunk_chars)
    asked = [i for _, i in items if i is not None and needles[i][0] == keys[0]]  # in haystack order
    answers = tuple(needles[i][1] for i in asked)
    key = keys[0]
    many = kind == "multivalue"
    case = QACase(
        kind=KINDS[kind],
        documents=documents,
        question=(QUESTION_ALL if many else QUESTION).format(key=key),
        answers=answers,
        reference=", ".join(answers),
        answer_prefix=(ANSWER_PREFIX_ALL if many else ANSWER_PREFIX).format(key=key),
        stop=("\n",) if many else (".", "\n"),
        gold=tuple(sorted({chunk_of[i] for i in asked})),
        question_first=question_first,
    )
    return case, [round(depths[i], 4) for i in asked]


def _window(rng: random.Random, corpus: tuple[str, ...], chars: int) -> list[str]:
    """Consecutive sentences of ``corpus`` from a random offset (wrapping round) until they hold ``chars``
    characters, a space after each."""
    start, window, total = rng.randrange(len(corpus)), [], 0
    while total < chars and len(window) < len(corpus):
        sentence = corpus[(start + len(window)) % len(corpus)]
        window.append(sentence)
        total += len(sentence) + 1
    return window


def _chunks(items: list[tuple[str, int | None]], chunk_chars: int) -> tuple[tuple[str, ...], dict[int, int]]:
    """The documents (sentences joined by spaces, cut after the sentence that brings a chunk to ``chunk_chars``
    characters, each ending in a newline) and the document of each needle."""
    documents: list[str] = []
    chunk_of: dict[int, int] = {}
    current: list[str] = []
    for n, (sentence, needle) in enumerate(items):
        current.append(sentence)
        if needle is not None:
            chunk_of[needle] = len(documents)
        if len(" ".join(current)) >= chunk_chars or n == len(items) - 1:
            documents.append(" ".join(current) + "\n")
            current = []
    return tuple(documents), chunk_of
