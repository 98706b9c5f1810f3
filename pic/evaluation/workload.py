"""Workloads for the fidelity evaluation: cases of chunks and a query, sampled or from JSONL."""

from __future__ import annotations

import inspect
import json
import os
from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pic.compile import TextOrTokens
from pic.engine import PIC
from pic.errors import InvalidInputError
from pic.progress import tqdm

# A workload file is read whole; refuse files that cannot be a reasonable workload.
_MAX_WORKLOAD_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class Case:
    """One linked prompt to evaluate: ``chunks`` are compiled, then linked in order with ``query``."""

    chunks: tuple[TextOrTokens, ...]
    query: TextOrTokens


@dataclass(frozen=True)
class Workload:
    """Cases and a description of where they came from (for reports)."""

    cases: tuple[Case, ...]
    description: dict[str, object]


class _CaseRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    chunks: list[str | list[int]] = Field(min_length=1)
    query: str | list[int]


def load_workload(path: str | os.PathLike) -> Workload:
    """Read a JSONL file of ``{"chunks": [text or token ids, ...], "query": text or token ids}`` lines.

    Raises:
        InvalidInputError: an unreadable or oversized file, a malformed line (named by number), no cases.
    """
    try:
        if os.path.getsize(path) > _MAX_WORKLOAD_BYTES:
            raise InvalidInputError(f"workload {str(path)!r} is larger than {_MAX_WORKLOAD_BYTES} bytes")
        with open(path, encoding="utf-8") as file:
            lines = file.read().splitlines()
    except OSError as exc:
        raise InvalidInputError(f"cannot read workload {str(path)!r}: {exc.strerror}") from None
    cases = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = _CaseRecord.model_validate(json.loads(line))
        except (json.JSONDecodeError, ValidationError) as exc:
            reason = exc.msg if isinstance(exc, json.JSONDecodeError) else exc.errors()[0]["msg"]
            raise InvalidInputError(f"workload {str(path)!r} line {number}: {reason}") from None
        cases.append(Case(chunks=tuple(record.chunks), query=record.query))
    if not cases:
        raise InvalidInputError(f"workload {str(path)!r} has no cases")
    return Workload(cases=tuple(cases), description={"source": str(path), "num_cases": len(cases)})


def sample_workload(
    engine: PIC,
    *,
    num_cases: int = 30,
    num_chunks: int = 3,
    chunk_tokens: tuple[int, int] = (80, 120),
    query_tokens: int = 20,
    seed: int = 0,
    progress: bool = False,
) -> Workload:
    """Cases cut from the model's own text: each samples one passage from BOS (temperature 1, BOS and
    EOS suppressed), splits it into ``num_chunks`` chunks of uniformly drawn lengths in
    ``chunk_tokens`` (inclusive), and takes the next ``query_tokens`` tokens as the query, so the
    query continues the last chunk's text. Deterministic for a given model, seed and device.
    ``progress`` shows a bar over the sampled tokens.
    """
    gen = torch.Generator().manual_seed(seed)
    low, high = chunk_tokens
    if not 1 <= low <= high or num_cases < 1 or num_chunks < 1 or query_tokens < 1:
        raise InvalidInputError(
            f"bad workload shape: num_cases={num_cases}, num_chunks={num_chunks}, "
            f"chunk_tokens={chunk_tokens}, query_tokens={query_tokens}"
        )
    lengths = torch.randint(low, high + 1, (num_cases, num_chunks), generator=gen)
    texts = _sample_text(engine, num_cases, int(lengths.sum(1).max()) + query_tokens, gen, progress=progress)
    cases = []
    for row, text in zip(lengths.tolist(), texts, strict=True):
        bounds = [0, *torch.tensor(row).cumsum(0).tolist()]
        chunks = tuple(text[a:b] for a, b in zip(bounds, bounds[1:], strict=False))
        cases.append(Case(chunks=chunks, query=text[bounds[-1] : bounds[-1] + query_tokens]))
    description = {
        "source": "sampled from the model",
        "num_cases": num_cases,
        "num_chunks": num_chunks,
        "chunk_tokens": list(chunk_tokens),
        "query_tokens": query_tokens,
        "seed": seed,
    }
    return Workload(cases=tuple(cases), description=description)


@torch.no_grad()
def _sample_text(
    engine: PIC, num_texts: int, num_tokens: int, gen: torch.Generator, *, progress: bool
) -> list[list[int]]:
    """``num_texts`` passages of ``num_tokens`` tokens sampled from BOS with the HF model's own cache."""
    model, device = engine.model, engine.spec.device
    banned = [t for t in (engine.bos_token_id, *engine.eos_token_ids) if t is not None]
    start = engine.bos_token_id if engine.bos_token_id is not None else 0
    if num_tokens + 1 > engine.spec.max_context:
        raise InvalidInputError(
            f"a {num_tokens}-token passage does not fit the {engine.spec.max_context}-token context"
        )
    ids = torch.full((num_texts, 1), start, dtype=torch.long, device=device)
    out = model(ids, use_cache=True)
    cache = cache_argument(model)
    tokens = []
    for _ in tqdm(range(num_tokens), desc=f"pic sample {num_texts} passages", unit="token", disable=not progress):
        logits = out.logits[:, -1].float().cpu()
        logits[:, banned] = float("-inf")
        step = torch.multinomial(logits.softmax(-1), 1, generator=gen)  # [num_texts, 1]
        tokens.append(step)
        out = model(step.to(device), use_cache=True, **{cache: getattr(out, cache)})
    return torch.cat(tokens, dim=1).tolist()


def cache_argument(model: torch.nn.Module) -> str:
    """The name of the KV cache in the model's forward and output: ``cache`` from transformers 5.24, which
    deprecates the older ``past_key_values`` (a warning on every step, removal announced for 5.40)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
