"""``SharedTokenizer``: the engine's tokenizer is used by callers' threads and the engine's own at once."""

from __future__ import annotations

import threading
import time

import pic
from pic.compile import SharedTokenizer


class _Reentrancy:
    """A tokenizer that notices two threads inside it at once (as a Rust tokenizer does: "Already borrowed")."""

    bos_token_id = 1

    def __init__(self) -> None:
        self.inside, self.overlaps = 0, 0

    def encode(self, text: str) -> list[int]:
        self.inside += 1
        self.overlaps += self.inside > 1
        time.sleep(0.001)
        self.inside -= 1
        return [len(text)]


def _hammer(tokenizer: object) -> None:
    threads = [threading.Thread(target=lambda: [tokenizer.encode("x") for _ in range(50)]) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def test_calls_never_overlap_and_attributes_pass_through():
    raw = _Reentrancy()
    _hammer(raw)
    assert raw.overlaps > 0  # the test can fail: unguarded, the threads do meet inside
    shared = SharedTokenizer(_Reentrancy())
    _hammer(shared)
    assert shared.wrapped.overlaps == 0 and shared.bos_token_id == 1
    shared.chat_template = "{{ x }}"  # writes reach the tokenizer itself
    assert shared.wrapped.chat_template == "{{ x }}"


def test_the_engine_wraps_its_tokenizer_once():
    engine = pic.load()
    assert isinstance(engine.tokenizer, SharedTokenizer)
    again = pic.PIC(engine.model, engine.tokenizer)
    assert again.tokenizer is engine.tokenizer
