"""Request bodies of the OpenAI-compatible routes, validated (pydantic) before anything reaches the engine.

Values are taken as JSON types, strictly (``"max_tokens": "4"``, ``true`` or ``4.0`` is refused, as the Python
API refuses them). Unknown fields are ignored, as OpenAI's clients send some this server has no use for
(``user`` ...); OpenAI parameters it does not honour are refused with a 400 naming them when they ask for
something (``logprobs: 5``, ``frequency_penalty: 0.5``), and accepted at their neutral value (``null``, 0,
``false``), so that a request never silently gets less than it asked for.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

# OpenAI parameters this server does not implement, with the values that ask for nothing.
UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "frequency_penalty": (None, 0),
    "presence_penalty": (None, 0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage and no choices (OpenAI's)."""

    include_usage: bool = False


class PicOptions(_Body):
    """The ``pic`` extra field: what to link before the prompt.

    Attributes:
        cache_ids: compiled chunks (``POST /v1/chunks``), linked in this order.
        documents: texts compiled (and cached) on the way, linked after ``cache_ids``; in a chat, compiled in
            the chat's context (after its system turn: ``PIC.chat_context``).
        policy: the recompute policy (``"regions"``, ``"legolink:16"`` ...); default: the engine's.
        prefix: text before the chunks (recomputed).
        relevance: one score per chunk (``cache_ids``, then ``documents``), higher for the more relevant (a
            retriever's scores); a policy that ranks chunks (``regions``) uses them.
    """

    model_config = ConfigDict(extra="forbid")

    cache_ids: list[str] = Field(default_factory=list, max_length=4096)
    documents: list[str] = Field(default_factory=list, max_length=1024)
    policy: str | None = None
    prefix: str = ""
    relevance: list[float] | None = Field(default=None, max_length=5120)


class Sampling(_Body):
    """OpenAI's sampling fields (their defaults: temperature 1, top_p 1), and ``top_k`` (0: off)."""

    model: str
    max_tokens: int | None = Field(default=16, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    pic: PicOptions = Field(default_factory=PicOptions)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            asked = [key for key, neutral in UNSUPPORTED.items() if key in data and data[key] not in neutral]
            if asked:
                raise PydanticCustomError(
                    "unsupported_parameter",
                    "{names}: not supported by this server (leave them out)",
                    {"names": ", ".join(f"{key}={data[key]!r:.40}" for key in asked)},
                )
        return data

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
        if value == "" or (isinstance(value, list) and "" in value):
            raise ValueError("stop strings must be non-empty")
        return value


class CompletionBody(Sampling):
    prompt: str


class ChunksBody(_Body):
    """``POST /v1/chunks``: documents to compile (``policy``: the one they will be linked with, when it
    needs its own compile options). Compiled in context when asked: after ``context`` (text whose KV is
    dropped), or after the chat template's system turn with ``system`` as the system prompt (``""``: no system
    message), as chat requests compile their inline documents."""

    model_config = ConfigDict(extra="forbid")

    documents: list[str] = Field(min_length=1, max_length=1024)
    policy: str | None = None
    context: str | None = Field(default=None, min_length=1)
    system: str | None = None

    @field_validator("system")
    @classmethod
    def _one_context(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("context") is not None:
            raise ValueError("give context or system, not both")
        return value


class ChatMessage(_Body):
    role: str
    content: str


class ChatBody(Sampling):
    """``POST /v1/chat/completions``: the documents go where ``pic.link_chat`` puts them (the start of the first
    user message, or a ``{documents}`` marker); ``pic.prefix`` does not apply."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @field_validator("pic")
    @classmethod
    def _no_prefix(cls, value: PicOptions) -> PicOptions:
        if value.prefix:
            raise ValueError("pic.prefix does not apply to chat: the chat template writes the text before the chunks")
        return value
