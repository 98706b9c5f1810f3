"""The incremental detokenizer against the reference, ``tokenizer.decode(all_tokens)`` cut at a stop string.

Two tokenizers: stories260K (sentencepiece-style, byte fallback: ``<0xE2>`` tokens, leading-space
stripping) and a byte-level BPE trained here in a few milliseconds (GPT-2/Qwen-style: tokens that
hold part of a character's bytes, or the end of one character and the start of the next).
"""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

import pic
from pic.engine.core.detokenizer import Detokenizer

WORDS = ("é", "—", "日本", "ü", "😀", "naïve", "café")  # multi-byte characters, spelt as byte tokens
CORPUS = "Tom had a big red ball. He liked to kick it — in the park. 日本 café naïve über 😀 Lily loved to sing."


@pytest.fixture(scope="module")
def stories():
    return AutoTokenizer.from_pretrained(str(pic.EMBEDDED_MODEL))


@pytest.fixture(scope="module")
def bpe():
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet, special_tokens=["<|end|>"])
    tokenizer.train_from_iterator([CORPUS] * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|end|>")


@pytest.fixture(params=["stories", "bpe"])
def tok(request):
    return request.getfixturevalue(request.param)


def byte_ids(tok, text: str) -> list[int]:
    """``text`` spelt one byte per token: byte-fallback ``<0xNN>`` tokens, or byte-level BPE's byte chars."""
    if tok.convert_tokens_to_ids("<0x41>") != tok.unk_token_id:
        return tok.convert_tokens_to_ids([f"<0x{b:02X}>" for b in text.encode()])
    ((chars, _),) = tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)
    return tok.convert_tokens_to_ids(list(chars))


def atoms(tok) -> list[list[int]]:
    """Pieces of valid text: every whole-character non-special token, words spelt in bytes, words encoded."""
    special = set(tok.all_special_ids)
    whole = [[i] for i in range(len(tok)) if i not in special and "\ufffd" not in tok.decode([i])]
    whole = [a for a in whole if not tok.convert_ids_to_tokens(a[0]).startswith("<0x")]
    words = [byte_ids(tok, w) for w in WORDS] + [tok.encode(w, add_special_tokens=False) for w in WORDS]
    return whole + words * (len(whole) // (3 * len(words)))  # about a quarter of the atoms are multi-byte


def random_ids(tok, rng: random.Random, n_atoms: int) -> list[int]:
    pool = atoms(tok)
    return [i for _ in range(n_atoms) for i in rng.choice(pool)]


def run(tok, ids: list[int], stop: tuple[str, ...] = ()) -> tuple[list[str], Detokenizer]:
    """Feeds ``ids`` until a stop, checking after each token that the text only grew as the reference does."""
    reference = cut(tok.decode(ids, skip_special_tokens=True), stop)
    detok, pieces = Detokenizer(tok, stop=stop), []
    for i in ids:
        pieces.append(detok.add(i))
        assert reference.startswith("".join(pieces))
        if detok.stopped:
            break
    pieces.append(detok.flush())
    assert detok.text == "".join(pieces)
    return pieces, detok


def cut(text: str, stop: tuple[str, ...]) -> str:
    """``text`` up to where a stop string first completes, cut before the earliest stop string in it."""
    first_end = min((text.find(s) + len(s) for s in stop if s in text), default=len(text))
    text = text[:first_end]
    return text[: min((text.find(s) for s in stop if s in text), default=len(text))]


def test_random_sequences_equal_full_decode(tok):
    rng = random.Random(0)
    for _ in range(200):
        ids = random_ids(tok, rng, rng.randint(1, 30))
        full = tok.decode(ids, skip_special_tokens=True)
        pieces, detok = run(tok, ids)
        assert detok.text == full and not detok.stopped
        assert "\ufffd" not in full and not any("\ufffd" in p for p in pieces)


def test_random_stop_strings_cut_at_first_occurrence(tok):
    rng = random.Random(1)
    for _ in range(100):
        ids = random_ids(tok, rng, rng.randint(2, 30))
        full = tok.decode(ids, skip_special_tokens=True)
        starts = [rng.randrange(len(full)) for _ in range(2)]
        stop = tuple(full[s : s + rng.randint(1, 6)] for s in starts) + ("never there",)
        _, detok = run(tok, ids, stop)
        assert detok.text == cut(full, stop) and detok.stopped
        assert not any(s in detok.text for s in stop)


def test_invalid_utf8_differs_only_in_replaced_bytes(tok):
    """Arbitrary ids, raw bytes included. Where they make invalid UTF-8 the full decode may replace more
    with U+FFFD than the text does (module docstring of ``pic.engine.core.detokenizer``), but nothing else."""
    rng = random.Random(3)
    pool = [i for i in range(len(tok)) if i not in set(tok.all_special_ids)]
    for _ in range(300):
        ids = rng.choices(pool, k=rng.randint(1, 30))
        full = tok.decode(ids, skip_special_tokens=True)
        detok = Detokenizer(tok)
        text = "".join(detok.add(i) for i in ids) + detok.flush()
        if "\ufffd" not in full:
            assert text == full
        else:
            kept = iter(text.replace("\ufffd", ""))
            assert all(c in kept for c in full.replace("\ufffd", ""))  # a subsequence


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        ("Tom had a big red ball.", ("d a b",), "Tom ha"),  # across '▁had', '▁a', '▁big'
        ("Lily loved to sing.", ("il",), "L"),  # inside the one token '▁Lily'
        ("Tom had a big red ball.", ("ball", "big"), "Tom had a "),  # the later-listed occurs first
        ("Tom had a big red ball.", ("ball", "red ball"), "Tom had a big "),  # starts first, same end
        ("Tom had a big red ball.", ("red", "big red ball"), "Tom had a big "),  # "red" completes first
        ("He said — no.", ("—",), "He said "),  # a stop string of three byte tokens
    ],
)
def test_stop_strings(stories, text, stop, expected):
    ids = stories.encode(text, add_special_tokens=False)
    _, detok = run(stories, ids + stories.encode(" The end.", add_special_tokens=False), stop)
    assert detok.stopped and detok.text == expected
    with pytest.raises(RuntimeError):
        detok.add(ids[0])


def test_split_character_appears_once_complete(stories):
    prefix = stories.encode("He said", add_special_tokens=False)
    dash, smile = byte_ids(stories, "—"), byte_ids(stories, "😀")
    pieces, detok = run(stories, prefix + dash + smile)
    assert pieces[len(prefix) :] == ["", "", "—", "", "", "", "😀", ""]
    assert detok.text == "He said—😀"


def test_flush_returns_incomplete_bytes_and_held_stop_prefix(stories):
    detok = Detokenizer(stories, stop=("big red",))  # holds back the last 6 characters
    assert [detok.add(i) for i in stories.encode("He had a big", add_special_tokens=False)] == ["", "", "He", " had"]
    assert detok.add(byte_ids(stories, "—")[0]) == ""  # an incomplete character, held back too
    assert detok.flush() == " a big\ufffd" and detok.flush() == "" and detok.text == "He had a big\ufffd"


class CountingTokenizer:
    """Counts the token ids passed to decode(): the work an incremental detokenizer must keep bounded."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids: list[int], **kwargs) -> str:
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, **kwargs)


@pytest.mark.parametrize("invalid", [False, True])
def test_work_per_token_is_bounded(stories, invalid):
    """2,000 tokens decode a bounded window each, not everything so far (which would be ~2M ids)."""
    rng = random.Random(2)
    ids = [byte_ids(stories, "é")[1]] * 2000 if invalid else random_ids(stories, rng, 2000)[:2000]
    counting = CountingTokenizer(stories)
    detok = Detokenizer(counting, stop=("never there",))
    for i in ids:
        detok.add(i)
    detok.flush()
    assert counting.decoded < 20 * len(ids)
    if not invalid:
        assert detok.text == stories.decode(ids, skip_special_tokens=True)
