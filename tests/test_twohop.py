"""The ``twohop`` workload (``pic eval accuracy --workload twohop``): bridge questions whose answer needs two documents,
a person's (naming the town) and the town's (holding the fact), with another person and town competing; and what the
accuracy report says of a ranking on it (``gold_last``)."""

from __future__ import annotations

import math

import pytest

from pic.errors import InvalidInputError
from pic.evaluation.accuracy import Outcome, _summarize
from pic.evaluation.answers import AnswerScore
from pic.evaluation.fidelity import LinkMeasurement
from pic.evaluation.qa import QAKind
from pic.evaluation.twohop import TOWNS, twohop_workload


@pytest.mark.parametrize("question_first", [True, False])
def test_each_case_needs_the_persons_document_and_the_towns(question_first):
    workload = twohop_workload(num_cases=20, question_first=question_first, seed=5)
    assert len(workload.cases) == 20 and workload.description["num_documents"] == 4
    for case in workload.cases:
        assert case.kind is QAKind.TWOHOP and case.question_first is question_first and len(case.documents) == 4
        person, town = (case.documents[i] for i in case.gold)
        name = case.question.split(" was born")[0].split("where ")[1]
        birthplace = person.split(" was born in ")[1].split()[0]
        assert name in person and name not in town and birthplace in TOWNS  # the bridge: the person names the town
        assert town.startswith(f"{birthplace} is a small town") and case.answers[0] in town  # the fact is the town's
        others = [d for i, d in enumerate(case.documents) if i not in case.gold]
        assert all(name not in d for d in others) and all(case.answers[0] not in d for d in others)
        # the competing pair: another person born in another town, which states a fact of the same form
        assert sum(" was born in " in d for d in others) == 1 and sum("is a small town" in d for d in others) == 1
        assert all(d.endswith("\n") and "\n" not in d[:-1] for d in case.documents)  # one line each
    assert {c.answer_prefix.split()[1] for c in workload.cases} == {"population", "town"}  # both kinds of question


def test_the_same_arguments_give_the_same_cases_and_bad_ones_are_refused():
    assert twohop_workload(num_cases=5, seed=1) == twohop_workload(num_cases=5, seed=1)
    assert twohop_workload(num_cases=5, seed=1) != twohop_workload(num_cases=5, seed=2)
    with pytest.raises(InvalidInputError, match="details 9 to 3"):
        twohop_workload(min_details=9, max_details=3)
    with pytest.raises(InvalidInputError, match="num_cases=0"):
        twohop_workload(num_cases=0)


def _outcome(order: tuple[int, ...], correct: bool) -> Outcome:
    link = LinkMeasurement(**{field: 1.0 for field in LinkMeasurement.__dataclass_fields__})  # (times: not 0)
    return Outcome(link=link, reply="", score=AnswerScore(correct, False, 0.0), order=order)


def test_gold_last_is_the_share_of_cases_whose_gold_documents_ran_last():
    cases = twohop_workload(num_cases=3, seed=0).cases
    gold = [case.gold for case in cases]
    rest = [tuple(i for i in range(4) if i not in g) for g in gold]
    orders = [rest[0] + gold[0][::-1], rest[1] + gold[1], gold[2] + rest[2]]  # last (either way), last, first
    measured = [_outcome(order, True) for order in orders]
    full = [_outcome((0, 1, 2, 3), True) for _ in cases]
    score = _summarize("x", measured, full, list(cases))
    assert math.isclose(score.gold_last, 2 / 3)
    assert math.isclose(_summarize("full", full, full, list(cases)).gold_last, sum(set(g) == {2, 3} for g in gold) / 3)
