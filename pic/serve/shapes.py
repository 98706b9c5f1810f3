"""The JSON bodies the server answers, as pydantic models: only for ``/openapi.json`` (``openapi.py``), so a
client or a fuzzer can check every response against them. The handlers build plain dicts (``replies.py``);
``tests/test_schemathesis.py`` checks that the two agree.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorBody(BaseModel):
    """OpenAI's error body; ``code`` is the HTTP status."""

    error: ErrorDetail


class Health(BaseModel):
    status: Literal["ok"]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class CacheIds(BaseModel):
    """One id per document; ``tiers``: per id, the tiers holding its chunk when the compile returned, fastest first
    (``device`` is the server's KV pool: a tier under ``--on-*-error miss`` that failed is absent until it works
    again, when the server writes the chunk there)."""

    cache_ids: list[str]
    tiers: list[list[str]]


class ChunkEntry(BaseModel):
    id: str
    tiers: list[str]
    num_tokens: int
    bytes: int


class Deleted(BaseModel):
    id: str
    deleted: Literal[True]


class Usage(BaseModel):
    """OpenAI's usage, with the prompt tokens linking reused (cached KV) and recomputed, the order the chunks ran in
    (``pic_chunk_order``: the request's chunk indices in prompt order), the policy that chose the recomputed tokens
    (``pic_policy``: ``auto``'s choice) and the chunks recomputed whole (``pic_recomputed_chunks``)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    reused_tokens: int
    recomputed_tokens: int
    pic_order: Literal["given", "relevance"]
    pic_chunk_order: list[int]
    pic_policy: str
    pic_recomputed_chunks: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None
    finish_reason: Literal["stop", "length"] | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None
    finish_reason: Literal["stop", "length"] | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
