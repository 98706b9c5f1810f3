from __future__ import annotations

import pytest

import pic
from tests.models import FAMILIES, model, tokenizer


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


def make_engine(family: str, **config) -> pic.PIC:
    return pic.PIC(model(family), tokenizer(), config=pic.PICConfig(**config))


@pytest.fixture
def stories() -> pic.PIC:
    return make_engine("stories260K")
