"""A caller's own mistakes reach the caller once, as a ``PicError``: not printed to stderr beside it, and every way in
(``link``, ``submit``, ``Stepper.add_request``) checks its input the same; what the store and a compile report name,
the same type."""

from __future__ import annotations

import logging
import queue

import pytest

import pic
from tests.conftest import make_engine

DOC = "Tom had a red ball. He liked to play with it in the park every day."


@pytest.fixture
def engine() -> pic.PIC:
    return make_engine("stories260K")


def test_a_callers_error_is_raised_and_not_logged_too(engine, caplog, capfd):
    """An unknown id and an over-long prompt: the caller gets the error, and neither the ``pic`` logger (above
    debug) nor stderr repeats it. A fault that is not the caller's is still logged (the scheduler's other branch)."""
    with caplog.at_level(logging.DEBUG, logger="pic"):
        with pytest.raises(pic.UnknownCacheIdError):
            engine.link(["ab" * 16], "One day,")
        with pytest.raises(pic.ContextLengthError):
            engine.link([], "hello " * 5000)
        engine.link(engine.compile([DOC]), "One day,").generate(max_new_tokens=2)  # (drains the engine's thread)
    failed = [r for r in caplog.records if "failed" in r.getMessage()]
    assert failed and all(r.levelno == logging.DEBUG for r in failed), [r.getMessage() for r in failed]
    assert "failed" not in capfd.readouterr().err


@pytest.mark.parametrize("way", ["submit", "add_request"])
def test_every_way_in_refuses_what_is_not_a_request(engine, way):
    """``submit`` and ``Stepper.add_request`` take a ``pic.Request``; a text (the mistake one makes first) is an
    ``InvalidInputError`` naming it, not an ``AttributeError`` from inside, and nothing is queued."""
    add = engine.submit if way == "submit" else engine.stepper().add_request
    kwargs = {"sink": queue.SimpleQueue()} if way == "submit" else {}
    with pytest.raises(pic.InvalidInputError, match=r"request is 'Once upon a time'; expected a pic.Request"):
        add("Once upon a time", **kwargs)
    assert not engine.stepper().has_unfinished()
    assert engine.kv_stats().num_available_blocks == engine.kv_stats().num_blocks


def test_lookup_and_the_compile_report_name_tiers_alike(engine):
    """``store.lookup`` and ``CompileReport.tiers`` hold the same thing, a tuple of tier names fastest first."""
    report = engine.compile_report([DOC])
    assert engine.store.lookup(report.ids[0]) == report.tiers[0] == ("device",)
    assert engine.store.lookup("ab" * 16) == ()


def test_a_compile_too_big_for_the_pool_is_named_in_words(engine):
    """The pool's refusal of a compile call counts its new chunks in grammatical words."""
    small = make_engine("stories260K", kv_pool_tokens=32)
    with pytest.raises(pic.StoreFullError, match=r"this compile call \(1 new chunk\) needs \d+ blocks"):
        small.compile([DOC * 4])
