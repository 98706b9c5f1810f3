"""Request bodies of the OpenAI-compatible routes, validated (pydantic) before anything reaches the engine.

Unknown fields are ignored, as OpenAI's clients send some this server has no use for (``user``,
``logprobs=None`` ...); fields it cannot honour are refused with a message naming them (``n`` > 1).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class PicOptions(_Body):
    """The ``pic`` extra field: what to link before the prompt.

    Attributes:
        cache_ids: compiled chunks (``POST /v1/chunks``), linked in this order.
        documents: texts compiled (and cached) on the way, linked after ``cache_ids``.
        policy: the recompute policy (``"mepic"``, ``"legolink:16"`` ...); default: the engine's.
        prefix: text before the chunks (recomputed).
    """

    model_config = ConfigDict(extra="forbid")

    cache_ids: list[str] = Field(default_factory=list, max_length=4096)
    documents: list[str] = Field(default_factory=list, max_length=1024)
    policy: str | None = None
    prefix: str = ""


class Sampling(_Body):
    """OpenAI's sampling fields (their defaults: temperature 1, top_p 1)."""

    max_tokens: int | None = Field(default=16, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    pic: PicOptions = Field(default_factory=PicOptions)

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError("this server generates one choice per request (n=1)")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > 4:
            raise ValueError(f"stop has {len(value)} strings; at most 4")
        return value


class CompletionBody(Sampling):
    model: str | None = None
    prompt: str


class ChunksBody(_Body):
    """``POST /v1/chunks``: documents to compile (``policy``: the one they will be linked with, when it
    needs its own compile options)."""

    model_config = ConfigDict(extra="forbid")

    documents: list[str] = Field(min_length=1, max_length=1024)
    policy: str | None = None


class ChatMessage(_Body):
    role: str
    content: str


class ChatBody(Sampling):
    """``POST /v1/chat/completions``: the documents go where ``pic.link_chat`` puts them (the start of the first
    user message, or a ``{documents}`` marker); ``pic.prefix`` does not apply."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_completion_tokens: int | None = Field(default=None, ge=1)
