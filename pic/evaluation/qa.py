"""A generated multi-document QA workload for ``pic eval accuracy``, and how answers are scored.

Each case is a chat: a system prompt, then a user message holding the question, the documents and the
question again (small models find the answer far more often when they know the question before reading),
and the start of the assistant's reply written into the prompt (``"The pass key is"``), so the first
generated token is the answer and the next-token distribution at the end of the prompt is the answer's.
Documents are a few neutral filler sentences; the facts are planted in them:

- ``passkey``: one document holds "The pass key is 4821."; the others hold no key.
- ``fact``: every document holds one "<name> lives in <city>." (names and cities distinct); the question
  asks for one name's city, so the other documents hold competing answers of the same form.
- ``two-docs``: two documents hold the pass keys of two named places; the question asks for both, so
  the answer needs both documents.

Everything is drawn from a seeded ``random.Random``: the same arguments give the same cases everywhere.
"""

from __future__ import annotations

import dataclasses
import enum
import random
from dataclasses import dataclass

from pic.errors import InvalidInputError

SYSTEM_PROMPT = "Answer the question using the documents."

FILLER = (
    "The grass is green and the sky is blue.",
    "The river flows past the old mill.",
    "Birds sing in the tall trees every morning.",
    "The market opens early on Saturdays.",
    "A cold wind blows from the hills.",
    "The library has thousands of books.",
    "Children play football in the park.",
    "The baker sells fresh bread each day.",
    "Clouds drift slowly over the town.",
    "The train to the city leaves at noon.",
    "Farmers harvest wheat in late summer.",
    "The museum shows paintings from many countries.",
    "A small boat is tied to the pier.",
    "The road winds through the quiet valley.",
    "Snow covers the mountains in winter.",
    "The cafe on the corner serves good coffee.",
    "An old clock hangs above the station door.",
    "The garden is full of roses in June.",
    "Fishermen return to the harbour at dawn.",
    "The school has a new science lab.",
    "Lanterns light the street at night.",
    "The bridge was built two hundred years ago.",
    "A cat sleeps on the warm windowsill.",
    "The choir practises every Thursday evening.",
    "Tourists take photos of the castle walls.",
    "The forest path is covered with leaves.",
    "A bakery smell fills the narrow lane.",
    "The lake freezes over in January.",
    "Workers repaint the fence every spring.",
    "The orchard grows apples and pears.",
)
NAMES = (
    "Alice", "Bob", "Carlos", "Diana", "Emma", "Frank", "Grace", "Hugo", "Irene", "Jack", "Karen", "Leo",
    "Maria", "Nina", "Oscar", "Paul", "Rosa", "Sam", "Tara", "Victor",
)  # fmt: skip
CITIES = (
    "Paris", "London", "Tokyo", "Madrid", "Berlin", "Rome", "Cairo", "Lima", "Oslo", "Dublin", "Vienna",
    "Prague", "Lisbon", "Athens", "Moscow", "Sydney", "Toronto", "Chicago", "Nairobi", "Seoul",
)  # fmt: skip
PLACES = (
    ("north gate", "south gate"),
    ("east tower", "west tower"),
    ("front door", "back door"),
    ("old bridge", "new bridge"),
    ("blue room", "red room"),
)


class QAKind(str, enum.Enum):
    PASSKEY = "passkey"
    FACT = "fact"
    TWO_DOCS = "two-docs"
    PROFILE = "profile"  # pic.evaluation.profiles: one fact about one person, in paragraph documents
    TWOHOP = "twohop"  # pic.evaluation.twohop: a person's paragraph names a town, the town's holds the answer
    NIAH_SINGLE = "niah-single"  # pic.evaluation.niah: one needle in a haystack of prose
    NIAH_MULTIKEY = "niah-multikey"  # the needle among 3 distractor needles with other keys
    NIAH_MULTIVALUE = "niah-multivalue"  # 4 needles with the same key: all 4 values asked
    MUSIQUE = "musique"  # pic.evaluation.musique: MuSiQue's multi-hop questions over retrieved passages


class ReplyParse(str, enum.Enum):
    """What of a reply is scored. ``AS_GENERATED``: all of it (the generated workloads end it with stop strings).
    ``CACHEBLEND``: what CacheBlend's ``parse_generation`` keeps, for a workload that has no stop strings: the
    first line after any leading newlines, and just "Yes" or "No" when that is the line's first word."""

    AS_GENERATED = "as-generated"
    CACHEBLEND = "cacheblend"


@dataclass(frozen=True)
class QACase:
    """One question over several documents.

    Attributes:
        documents: the chunks' texts, each one line. (Not a blank line: a byte-level BPE such as SmolLM2's
            tokenizes "\n\n" before a letter as two tokens in running text but as one at a chunk's end,
            so the linked prompt would differ from the plain chat prompt by a token per document.)
        question: asked before and after the documents.
        answers: every one must appear in the reply for it to count as correct.
        reference: the reply that answers exactly (for exact match and F1).
        answer_prefix: the start of the assistant's reply, part of the prompt.
        stop: where the reply ends (a single answer ends at its sentence's end).
        gold: indices of the documents that hold the answer (empty: not known, as in CacheBlend's MuSiQue file).
        question_first: the question is asked before the documents too (see ``messages``).
        aliases: other acceptable forms of the reference (MuSiQue's answer aliases): a reply that holds one is
            correct too, and its exact match and F1 are the best over the reference and these.
        system: the system message; ``None``: none (the chat template's own default, where it has one), for a
            prompt that, like CacheBlend's, puts its instructions in the user message.
        user: the whole user message, ``{documents}`` where the chunks go; ``None``: the question after the
            documents and, with ``question_first``, before them too.
        reply_parse: what of the reply is scored (``ReplyParse``).
    """

    kind: QAKind
    documents: tuple[str, ...]
    question: str
    answers: tuple[str, ...]
    reference: str
    answer_prefix: str
    stop: tuple[str, ...]
    gold: tuple[int, ...]
    question_first: bool = True
    aliases: tuple[str, ...] = ()
    system: str | None = SYSTEM_PROMPT
    user: str | None = None
    reply_parse: ReplyParse = ReplyParse.AS_GENERATED

    def messages(self) -> list[dict[str, str]]:
        """The chat, with ``{documents}`` where the chunks go (``PIC.chat_segments``): ``user`` when the case
        has one, else the question after the documents and, with ``question_first``, before them too. Asked
        first, the question is in the prefix that Full Recompute's document tokens attend to; a cached chunk
        was compiled without it, so only its recomputed tokens can see it."""
        if self.user is not None:
            user = self.user
        else:
            question = f"Question: {self.question}"
            before = f"{question}\n\n" if self.question_first else ""
            user = f"{before}{{documents}}{question}"
        system = [] if self.system is None else [{"role": "system", "content": self.system}]
        return [*system, {"role": "user", "content": user}]

    def reordered(self, order: list[int]) -> QACase:
        """The same case with its documents in ``order`` (``order[i]`` is the old index of new document ``i``)."""
        where = {old: new for new, old in enumerate(order)}
        documents = tuple(self.documents[i] for i in order)
        return dataclasses.replace(self, documents=documents, gold=tuple(where[g] for g in self.gold))


@dataclass(frozen=True)
class QAWorkload:
    cases: tuple[QACase, ...]
    description: dict[str, object]


def qa_workload(
    *,
    num_cases: int = 200,
    num_documents: int = 4,
    sentences_per_document: int = 5,
    two_docs_share: float = 0.2,
    question_first: bool = True,
    seed: int = 0,
) -> QAWorkload:
    """``num_cases`` cases: ``two_docs_share`` of them two-document questions, the rest alternating
    pass-key and fact questions; each over ``num_documents`` documents of ``sentences_per_document``
    filler sentences plus the planted facts; ``question_first`` asks the question before the documents too.

    Raises:
        InvalidInputError: fewer than 2 documents, or more documents than names or filler allow.
    """
    limit = min(len(NAMES), len(CITIES))
    if not 2 <= num_documents <= limit or not 1 <= sentences_per_document <= len(FILLER) or num_cases < 1:
        raise InvalidInputError(
            f"bad QA workload shape: num_cases={num_cases}, num_documents={num_documents} (2 to {limit}), "
            f"sentences_per_document={sentences_per_document} (1 to {len(FILLER)})"
        )
    if not 0 <= two_docs_share <= 1:
        raise InvalidInputError(f"two_docs_share={two_docs_share}: must be within [0, 1]")
    rng = random.Random(seed)
    num_two = round(num_cases * two_docs_share)
    kinds = [QAKind.TWO_DOCS] * num_two + [(QAKind.PASSKEY, QAKind.FACT)[i % 2] for i in range(num_cases - num_two)]
    rng.shuffle(kinds)
    build = {QAKind.PASSKEY: _passkey, QAKind.FACT: _fact, QAKind.TWO_DOCS: _two_docs}
    cases = tuple(
        dataclasses.replace(build[kind](rng, num_documents, sentences_per_document), question_first=question_first)
        for kind in kinds
    )
    description = {
        "source": "pic.evaluation.qa_workload",
        "num_cases": num_cases,
        "num_documents": num_documents,
        "sentences_per_document": sentences_per_document,
        "two_docs_share": two_docs_share,
        "question_first": question_first,
        "seed": seed,
        "num_by_kind": {kind.value: kinds.count(kind) for kind in QAKind},
    }
    return QAWorkload(cases=cases, description=description)


def _documents(rng: random.Random, num: int, sentences: int, planted: dict[int, str]) -> tuple[str, ...]:
    """``num`` documents of filler; document ``i`` gets ``planted[i]`` at a random place among its sentences."""
    docs = []
    for i in range(num):
        parts = rng.sample(FILLER, sentences)
        if i in planted:
            parts.insert(rng.randrange(len(parts) + 1), planted[i])
        docs.append(" ".join(parts) + "\n")
    return tuple(docs)


def _key(rng: random.Random) -> str:
    return str(rng.randint(1000, 9999))


def _passkey(rng: random.Random, num: int, sentences: int) -> QACase:
    gold, key = rng.randrange(num), _key(rng)
    return QACase(
        kind=QAKind.PASSKEY,
        documents=_documents(rng, num, sentences, {gold: f"The pass key is {key}."}),
        question="What is the pass key?",
        answers=(key,),
        reference=key,
        answer_prefix="The pass key is",
        stop=(".", "\n"),
        gold=(gold,),
    )


def _fact(rng: random.Random, num: int, sentences: int) -> QACase:
    names, cities = rng.sample(NAMES, num), rng.sample(CITIES, num)
    gold = rng.randrange(num)
    planted = {i: f"{name} lives in {city}." for i, (name, city) in enumerate(zip(names, cities, strict=True))}
    return QACase(
        kind=QAKind.FACT,
        documents=_documents(rng, num, sentences, planted),
        question=f"In which city does {names[gold]} live?",
        answers=(cities[gold],),
        reference=cities[gold],
        answer_prefix=f"{names[gold]} lives in",
        stop=(".", "\n"),
        gold=(gold,),
    )


def _two_docs(rng: random.Random, num: int, sentences: int) -> QACase:
    first, second = rng.choice(PLACES)
    (i, j), (a, b) = rng.sample(range(num), 2), (_key(rng), _key(rng))
    planted = {i: f"The pass key of the {first} is {a}.", j: f"The pass key of the {second} is {b}."}
    return QACase(
        kind=QAKind.TWO_DOCS,
        documents=_documents(rng, num, sentences, planted),
        question=f"What are the pass keys of the {first} and the {second}?",
        answers=(a, b),
        reference=f"{a} and the pass key of the {second} is {b}",
        answer_prefix=f"The pass key of the {first} is",
        stop=("\n",),
        gold=(i, j),
    )
