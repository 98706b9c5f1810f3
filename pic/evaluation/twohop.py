"""Bridge questions over two documents: ``pic eval accuracy --workload twohop``.

Each case holds four paragraphs: two about (made-up) people, each born in a (made-up) town, and two about those
towns, each stating one fact of the same kind (its population, or what it is known for). The question names one
person and asks the fact of the town where they were born ("What is the population of the town where Elena Novak
was born?"): the person's paragraph names the town (the bridge), the town's paragraph holds the answer, and the
other person and town hold a competing answer of the same form. No single document answers it, which is what
multi-hop sets (2WikiMQA, MuSiQue, HotpotQA) test and what the other generated workloads do not: there a cached
chunk that never saw the others still holds its answer whole.

``gold`` is ``(the person's paragraph, the town's paragraph)``: a link whose order puts both last, next to the
query, has them where ``auto`` recomputes. A retriever's words (BM25) find the person's paragraph (the question
names them) but not the town's, which shares only "town" and "population" with both towns' paragraphs: the
ranking's hit rate on the gold pair is what this workload measures beside the answers.

Everything is drawn from a seeded ``random.Random``: the same arguments give the same cases everywhere.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from pic.errors import InvalidInputError
from pic.evaluation.profiles import DETAILS, FIRST_NAMES, LAST_NAMES
from pic.evaluation.qa import QACase, QAKind, QAWorkload

TOWNS = (
    "Velden", "Korvik", "Ashmere", "Brannock", "Dunholt", "Elsworth", "Farrowby", "Gellin", "Harwick", "Istrel",
    "Jorvale", "Kelmsby", "Lorran", "Marden", "Norwick", "Oakhurst", "Pellmar", "Quenby", "Rothley", "Selwick",
)  # fmt: skip
PRODUCTS = ("glass", "cheese", "clocks", "wool", "pottery", "honey", "lace", "cider", "paper", "bells", "rope", "salt")

# Sentences about a town that state nothing asked: "{t}" is its name.
TOWN_DETAILS = (
    "{t} lies in a green valley between two low hills.",
    "A narrow river runs through the middle of {t}.",
    "The old market square of {t} is surrounded by tall houses with red roofs.",
    "Every spring {t} holds a small festival with music and dancing in the streets.",
    "The railway station of {t} was rebuilt some years ago.",
    "Visitors to {t} often stop at the stone church on the hill.",
    "Many streets in {t} are still paved with cobblestones.",
    "{t} has a small museum about the history of the region.",
    "In winter the roads around {t} are often covered with snow.",
    "A long footpath connects {t} with the next village.",
    "The town hall of {t} has a clock tower that can be seen from far away.",
    "Several cafes and bakeries line the main street of {t}.",
    "The park in the centre of {t} has a pond with ducks and a few old oak trees.",
    "Farmers from the villages around {t} sell vegetables on its square every week.",
    "{t} has two schools and a public library.",
    "An old castle stands in ruins just outside {t}.",
    "The people of {t} are proud of their football club.",
    "A weekly newspaper is printed in {t}.",
    "Buses leave {t} for the coast twice a day.",
    "The bridge over the river in {t} is made of grey stone.",
)


@dataclass(frozen=True)
class Town:
    name: str
    population: int
    product: str


# (question, answer prefix, answer) for a person's birthplace: the population, then what it is known for.
QUESTIONS: tuple[Callable[[str, Town], tuple[str, str, str]], ...] = (
    lambda person, town: (
        f"What is the population of the town where {person} was born?",
        f"The population of the town where {person} was born is",
        str(town.population),
    ),
    lambda person, town: (
        f"What is the town where {person} was born known for?",
        f"The town where {person} was born is known for its",
        town.product,
    ),
)


def twohop_workload(
    *,
    num_cases: int = 200,
    min_details: int = 6,
    max_details: int = 14,
    question_first: bool = True,
    seed: int = 0,
) -> QAWorkload:
    """``num_cases`` bridge questions, each over four paragraphs (two people, two towns; shuffled), each paragraph
    ``min_details`` to ``max_details`` detail sentences around its one fact; the questions alternate between the
    town's population and what it is known for.

    Raises:
        InvalidInputError: a bad range of details or no cases.
    """
    limit = min(len(DETAILS), len(TOWN_DETAILS))
    if num_cases < 1 or not 0 <= min_details <= max_details <= limit:
        raise InvalidInputError(
            f"bad twohop workload shape: num_cases={num_cases}, details {min_details} to {max_details} "
            f"(within 0 to {limit})"
        )
    rng = random.Random(seed)
    cases = tuple(_case(rng, min_details, max_details, i % len(QUESTIONS), question_first) for i in range(num_cases))
    description = {
        "source": "pic.evaluation.twohop_workload",
        "num_cases": num_cases,
        "num_documents": 4,
        "details_per_document": [min_details, max_details],
        "question_first": question_first,
        "seed": seed,
    }
    return QAWorkload(cases=cases, description=description)


def _case(rng: random.Random, low: int, high: int, question: int, question_first: bool) -> QACase:
    people = [
        f"{first} {last}" for first, last in zip(rng.sample(FIRST_NAMES, 2), rng.sample(LAST_NAMES, 2), strict=True)
    ]
    towns = [
        Town(name, population, product)
        for name, population, product in zip(
            rng.sample(TOWNS, 2), rng.sample(range(12000, 98000, 100), 2), rng.sample(PRODUCTS, 2), strict=True
        )
    ]
    paragraphs = [_person(rng, p, t, rng.randint(low, high)) for p, t in zip(people, towns, strict=True)]
    paragraphs += [_town(rng, t, question, rng.randint(low, high)) for t in towns]
    order = list(range(4))  # person 0, person 1, town 0, town 1 -> shuffled
    rng.shuffle(order)
    where = {old: new for new, old in enumerate(order)}
    asked = rng.randrange(2)
    text, answer_prefix, answer = QUESTIONS[question](people[asked], towns[asked])
    return QACase(
        kind=QAKind.TWOHOP,
        documents=tuple(paragraphs[i] for i in order),
        question=text,
        answers=(answer,),
        reference=answer,
        answer_prefix=answer_prefix,
        stop=(".", "\n"),
        gold=(where[asked], where[2 + asked]),
        question_first=question_first,
    )


def _person(rng: random.Random, person: str, town: Town, num_details: int) -> str:
    first = person.split()[0]
    details = [d.format(n=person, f=first) for d in rng.sample(DETAILS, num_details)]
    sentences = [f"{person} was born in {town.name} and moved away to study at the age of eighteen.", *details]
    rng.shuffle(sentences)
    return " ".join([f"{person} now works in a large office in the capital.", *sentences]) + "\n"


def _town(rng: random.Random, town: Town, question: int, num_details: int) -> str:
    fact = (
        f"{town.name} has a population of {town.population}." if question == 0
        else f"{town.name} is known for its {town.product}."
    )  # fmt: skip
    details = [d.format(t=town.name) for d in rng.sample(TOWN_DETAILS, num_details)]
    sentences = [fact, *details]
    rng.shuffle(sentences)
    return " ".join([f"{town.name} is a small town in the north of the country.", *sentences]) + "\n"
