"""A RAG-like QA workload of paragraph documents: ``pic eval accuracy --workload profiles``.

Each document is one paragraph about one (made-up) person, 150 to 500 tokens: one fact (what they do,
or their favourite flower, fruit or colour) among sentences about their days, habits and
friends. Every document of a case states the same kind of fact about its own person, so the other
documents hold competing answers of the same form; the question asks that fact about one person, named,
so the answer is in exactly one document. Unlike ``pic.evaluation.qa``'s documents (a few filler sentences
around one planted fact, about 50 tokens), these read as a retriever's passages do: long, on one subject,
and every sentence about it.

Everything is drawn from a seeded ``random.Random``: the same arguments give the same cases everywhere.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from dataclasses import dataclass

from pic.errors import InvalidInputError
from pic.evaluation.qa import QACase, QAKind, QAWorkload

FIRST_NAMES = (
    "Alice", "Bruno", "Clara", "Daniel", "Elena", "Felix", "Greta", "Henry", "Ines", "Jonas", "Kira", "Lukas",
    "Marta", "Nils", "Olga", "Pedro", "Rita", "Simon", "Tessa", "Viktor", "Wanda", "Yusuf", "Zoe", "Anton",
)  # fmt: skip
LAST_NAMES = (
    "Moreau", "Lindqvist", "Okafor", "Brennan", "Castillo", "Novak", "Hartmann", "Ferreira", "Kowalski",
    "Tanaka", "Rossi", "Dubois", "Jensen", "Petrov", "Walsh", "Costa", "Fischer", "Larsen",
)  # fmt: skip
JOBS = (
    "dentist", "carpenter", "pilot", "librarian", "chemist", "baker", "architect", "nurse", "plumber",
    "journalist", "gardener", "pharmacist", "electrician", "photographer", "surveyor", "translator",
)  # fmt: skip
COLOURS = ("green", "orange", "purple", "yellow", "blue", "red", "grey", "pink", "brown", "white")
FLOWERS = ("tulip", "rose", "daisy", "orchid", "sunflower", "poppy", "lavender", "peony", "marigold", "magnolia")
FRUITS = ("mango", "cherry", "banana", "plum", "apricot", "pear", "peach", "fig", "melon", "grape", "lemon", "papaya")

# Sentences about a person that state nothing asked: "{n}" is the full name, "{f}" the first name.
DETAILS = (
    "{n} usually wakes up early and makes a pot of strong tea before anyone else is awake.",
    "On weekends {f} likes to walk along the river and stop at a small cafe near the old bridge.",
    "Friends describe {f} as patient, curious and very hard to surprise.",
    "{f} has been learning to cook dishes from other countries and tries a new recipe every month.",
    "In the evenings {f} often reads history books, especially about ships and explorers.",
    "{n} keeps a small notebook for ideas and carries it everywhere.",
    "Every summer {f} spends two weeks camping in the mountains with a few old friends.",
    "{f} once ran a half marathon and still jogs three times a week.",
    "Neighbours know {f} for the tomatoes and herbs that grow on the balcony.",
    "{n} volunteers at the local library on the first Saturday of each month.",
    "{f} enjoys board games and hosts a game night for colleagues every other Friday.",
    "During the winter {f} prefers to stay at home with a warm blanket and a good film.",
    "{f} collects old postcards and has more than three hundred of them in a wooden box.",
    "{n} took painting lessons last year and now paints small landscapes.",
    "Most mornings {f} cycles to work, even when it rains.",
    "{f} speaks three languages and is slowly learning a fourth one.",
    "At family dinners {f} is the one who tells the longest stories.",
    "{f} repaired an old bicycle last spring and now rides it everywhere in town.",
    "{n} likes quiet music and listens to the radio while cooking.",
    "{f} has a habit of writing letters by hand to friends who live far away.",
    "A few years ago {f} planted an apple tree in the garden of a friend.",
    "{f} does not like crowded places and avoids the market on Saturdays.",
    "{n} takes photographs of doors and windows on every trip.",
    "When {f} travels, the first thing to do is always to find a good bakery.",
    "{f} has kept in touch with most classmates from school.",
    "On rainy days {f} bakes bread and shares it with the neighbours.",
    "{n} is saving money for a long trip by train across the continent.",
    "{f} enjoys swimming in the lake near the town when the water is warm enough.",
    "Colleagues say that {f} always remembers their birthdays.",
    "{f} tried to learn to knit as a teenager but gave up after a few months.",
)


@dataclass(frozen=True)
class Person:
    name: str
    first: str
    flower: str
    job: str
    fruit: str
    colour: str

    def facts(self) -> list[str]:
        """The sentences stating this person's askable facts."""
        n = self.name
        return [
            f"The favourite flower of {n} is the {self.flower}.",
            f"{n} works as {_article(self.job)} {self.job}.",
            f"The favourite fruit of {n} is the {self.fruit}.",
            f"The favourite colour of {n} is {self.colour}.",
        ]


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


# (question, answer prefix, answer) for each askable fact of a person.
QUESTIONS: tuple[Callable[[Person], tuple[str, str, str]], ...] = (
    lambda p: (f"What is the favourite flower of {p.name}?", f"The favourite flower of {p.name} is the", p.flower),
    lambda p: (f"What does {p.name} work as?", f"{p.name} works as", p.job),
    lambda p: (f"What is the favourite fruit of {p.name}?", f"The favourite fruit of {p.name} is the", p.fruit),
    lambda p: (f"What is the favourite colour of {p.name}?", f"The favourite colour of {p.name} is", p.colour),
)


def profile_workload(
    *,
    num_cases: int = 200,
    num_documents: int = 3,
    min_details: int = 9,
    max_details: int = 26,
    question_first: bool = True,
    seed: int = 0,
) -> QAWorkload:
    """``num_cases`` questions, each over ``num_documents`` paragraphs about different people.

    Each case asks one kind of fact (the kinds in turn: flower, job, fruit, colour) about one of the
    people; every paragraph states that kind of fact about its own person (the values differ), among
    ``min_details`` to ``max_details`` detail sentences, shuffled after an opening with the name: 150 to 500
    tokens with SmolLM2's tokenizer (measured over the 200 default cases: 150-490, mean 305). One fact per
    paragraph, not five: with five, Full Recompute on SmolLM2 answered far fewer cases (the model mixes up one
    person's facts) than with one (docs/policies.md#paragraph-documents---workload-profiles-120-cases-per-layout).

    Raises:
        InvalidInputError: fewer than 2 documents, more than the names or values allow, or a bad range.
    """
    limit = min(len(LAST_NAMES), len(FLOWERS), len(COLOURS), len(FRUITS))
    if not 2 <= num_documents <= limit or num_cases < 1 or not 0 <= min_details <= max_details <= len(DETAILS):
        raise InvalidInputError(
            f"bad profile workload shape: num_cases={num_cases}, num_documents={num_documents} (2 to {limit}), "
            f"details {min_details} to {max_details} (within 0 to {len(DETAILS)})"
        )
    rng = random.Random(seed)
    cases = tuple(
        _case(rng, num_documents, min_details, max_details, i % len(QUESTIONS), question_first)
        for i in range(num_cases)
    )
    description = {
        "source": "pic.evaluation.profile_workload",
        "num_cases": num_cases,
        "num_documents": num_documents,
        "details_per_document": [min_details, max_details],
        "question_first": question_first,
        "seed": seed,
    }
    return QAWorkload(cases=cases, description=description)


def _people(rng: random.Random, num: int) -> list[Person]:
    firsts, lasts = rng.sample(FIRST_NAMES, num), rng.sample(LAST_NAMES, num)
    flowers, jobs = rng.sample(FLOWERS, num), rng.sample(JOBS, num)
    fruits, colours = rng.sample(FRUITS, num), rng.sample(COLOURS, num)
    return [
        Person(f"{f} {last}", f, flowers[i], jobs[i], fruits[i], colours[i])
        for i, (f, last) in enumerate(zip(firsts, lasts, strict=True))
    ]


def _paragraph(rng: random.Random, person: Person, num_details: int, fact: int) -> str:
    details = [d.format(n=person.name, f=person.first) for d in rng.sample(DETAILS, num_details)]
    sentences = [person.facts()[fact], *details]
    rng.shuffle(sentences)
    opening = f"{person.name} lives in a quiet street not far from the centre of town."
    return " ".join([opening, *sentences]) + "\n"


def _case(rng: random.Random, num: int, low: int, high: int, question: int, question_first: bool) -> QACase:
    people = _people(rng, num)
    documents = tuple(_paragraph(rng, p, rng.randint(low, high), question) for p in people)
    gold = rng.randrange(num)
    text, answer_prefix, answer = QUESTIONS[question](people[gold])
    return dataclasses.replace(
        QACase(
            kind=QAKind.PROFILE,
            documents=documents,
            question=text,
            answers=(answer,),
            reference=answer,
            answer_prefix=answer_prefix,
            stop=(".", "\n"),
            gold=(gold,),
        ),
        question_first=question_first,
    )
