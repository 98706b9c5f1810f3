"""Request bodies of the OpenAI-compatible routes, validated (pydantic) before anything reaches the engine.

Values are taken as JSON types, strictly (``"max_tokens": "4"``, ``true`` or ``4.0`` is refused, as the Python
API refuses them). A top-level field that is neither the route's own nor an OpenAI parameter is a 400 naming
it (``documents`` belongs under ``"pic"``); OpenAI parameters the server has no use for are accepted and
ignored (``user``, ``metadata`` ...: ``openai_params.IGNORED``); those it does not honour are refused with a 400
naming them when they ask for something (``logprobs: 5``, ``frequency_penalty: 0.5``), and accepted at their
neutral value (``null``, 0, ``false``), so that a request never silently gets less than it asked for.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pic.link.order import Order
from pic.sampling import GREEDY_TEMPERATURE, GREEDY_TOP_P
from pic.serve.openai_params import openai_properties, unknown_fields, unsupported_parameters

# What the schema says of an integer field: JSON Schema's "integer" takes 4.0 too; this server does not.
_INT = "a JSON integer, written without a fraction (4.0 is refused, as the Python API refuses it)"
# ``max_tokens`` / ``max_completion_tokens``: 0 is the Python API's ``max_new_tokens=0``, not "no limit".
_MAX = f"0: an empty completion (finish_reason length), as max_new_tokens=0 in Python; {_INT}"
# Documents the schema asks to be non-empty (an empty one has no tokens: a 400).
_NONEMPTY_ITEMS = {"items": {"type": "string", "minLength": 1}}
# ``context`` and ``system`` both given: refused.
_BOTH_CONTEXTS = {
    "required": ["context", "system"],
    "properties": {"context": {"type": "string"}, "system": {"type": "string"}},
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
        policy: the recompute policy (``"auto"``, ``"regions"``, ``"legolink:16"`` ...); default: the engine's.
        prefix: text before the chunks (recomputed).
        relevance: one score per chunk (``cache_ids``, then ``documents``), higher for the more relevant (a
            retriever's scores); a policy that ranks chunks (``regions``) and the relevance order use them.
        order: the chunks' order in the prompt: ``"given"`` (``cache_ids`` then ``documents``, as sent),
            ``"relevance"`` (the most relevant last, next to the prompt), or ``"policy"`` (the default: the
            policy's choice). The usage's ``pic_order`` and ``pic_chunk_order`` say what ran.
    """

    model_config = ConfigDict(extra="forbid")

    cache_ids: list[str] = Field(default_factory=list, max_length=4096)
    documents: list[str] = Field(default_factory=list, max_length=1024, json_schema_extra=_NONEMPTY_ITEMS)
    policy: str | None = None
    prefix: str = ""
    relevance: list[float] | None = Field(default=None, max_length=5120)
    order: Order = Field(default=Order.POLICY, strict=False)  # its value from JSON


class Sampling(_Body):
    """OpenAI's sampling fields (their defaults: temperature 1, top_p 1), and ``top_k`` (0: off).

    A ``temperature`` under ``GREEDY_TEMPERATURE`` or a ``top_p`` under ``GREEDY_TOP_P`` is greedy:
    ``SamplingParams`` makes it so for every caller (sampling at them would overflow float32 into NaN).
    """

    model_config = ConfigDict(json_schema_extra=lambda schema, cls: cls._openai_schema(schema))
    route: ClassVar[str] = ""

    model: str
    max_tokens: int | None = Field(default=16, ge=0, description=_MAX)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, description=f"under {GREEDY_TEMPERATURE:g}: greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description=f"under {GREEDY_TOP_P:g}: greedy")
    top_k: int = Field(default=0, ge=0, description=f"0: off; {_INT}")
    seed: int | None = Field(default=None, ge=0, lt=2**64, description=_INT)
    stop: str | list[str] | None = Field(default=None, json_schema_extra=lambda schema: _stop_schema(schema))
    n: int = Field(default=1, description=f"1 only; {_INT}", json_schema_extra={"minimum": 1, "maximum": 1})
    stream: bool = False
    stream_options: StreamOptions | None = None
    pic: PicOptions = Field(default_factory=PicOptions)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unknown_and_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            refused = unknown_fields(data, set(cls.model_fields), cls.route) or unsupported_parameters(data)
            if refused is not None:
                kind, param, message = refused
                raise PydanticCustomError(kind, "{message}", {"message": message, "param": param})
        return data

    @classmethod
    def _openai_schema(cls, schema: dict) -> None:
        """The body's schema lists the OpenAI parameters it accepts beyond its fields, and no others."""
        schema.setdefault("properties", {}).update(openai_properties())
        schema["additionalProperties"] = False

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
    route: ClassVar[str] = "/v1/completions"

    prompt: str


class ChunksBody(_Body):
    """``POST /v1/chunks``: documents to compile (``policy``: the one they will be linked with, when it
    needs its own compile options). Compiled in context when asked: after ``context`` (text whose KV is
    dropped), or after the chat template's system turn with ``system`` as the system prompt (``""``: no system
    message), as chat requests compile their inline documents."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"not": _BOTH_CONTEXTS})

    documents: list[str] = Field(min_length=1, max_length=1024, json_schema_extra=_NONEMPTY_ITEMS)
    policy: str | None = None
    context: str | None = Field(default=None, min_length=1)
    system: str | None = None

    @field_validator("system")
    @classmethod
    def _one_context(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("context") is not None:
            raise ValueError("give context or system, not both")
        return value


# A text content part, as OpenAI's clients send a message's content (``[{"type": "text", "text": "hi"}]``).
_TEXT_PART = {
    "type": "object",
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    "required": ["type", "text"],
}
# The text of a message sent as parts: its text parts joined by a newline, as vLLM joins them
# (``vllm/entrypoints/chat_utils.py``: ``"\n".join(texts)``), so a chat gets the same prompt from both servers.
PART_SEPARATOR = "\n"


class ChatMessage(_Body):
    """A chat message of any role; ``content`` a string or a list of text parts (``message_text``)."""

    role: str
    content: str = Field(json_schema_extra=lambda schema: _content_schema(schema))

    @field_validator("content", mode="before")
    @classmethod
    def _text_of_parts(cls, value: Any) -> Any:
        return message_text(value)


def message_text(content: Any) -> Any:
    """The text of a message's ``content``: a list of text parts joined by ``PART_SEPARATOR``; anything else as it
    is (a string, or a value the string field then refuses by its path).

    Raises:
        PydanticCustomError: a part of another type (``image_url``, ``input_audio`` ...: a 400 naming it, this server
            reads text only), or a part that is not a text part's object (a 422 naming the part).
    """
    if not isinstance(content, list):
        return content
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind != "text":
            message = (
                f"is a content part of type {kind!r:.80}: this server reads text parts only "
                '({"type": "text", "text": "..."}); leave the other parts out, or send them to a server for that input'
            )
            raise PydanticCustomError(UNSUPPORTED_PART, "{message}", {"message": message, "index": index})
        if kind is None or not isinstance(part.get("text"), str):
            raise PydanticCustomError(
                "content_part", "content part {index} is not a text part: {example}",
                {"index": index, "example": '{"type": "text", "text": "..."}'},
            )  # fmt: skip
        texts.append(part["text"])
    return PART_SEPARATOR.join(texts)


# The pydantic error type of a content part of a type other than text (a 400: ``handlers``).
UNSUPPORTED_PART = "unsupported_content_part"


def _content_schema(schema: dict) -> None:
    """``content``: a string, or a list of text parts (what ``ChatMessage`` reads)."""
    schema.pop("type", None)
    schema["anyOf"] = [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]


class ChatBody(Sampling):
    """``POST /v1/chat/completions``: the documents go where ``pic.link_chat`` puts them (the start of the first
    user message, or a ``{documents}`` marker); ``pic.prefix`` does not apply."""

    route: ClassVar[str] = "/v1/chat/completions"

    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_completion_tokens: int | None = Field(default=None, ge=0, description=_MAX)

    @field_validator("pic")
    @classmethod
    def _no_prefix(cls, value: PicOptions) -> PicOptions:
        if value.prefix:
            raise ValueError("pic.prefix does not apply to chat: the chat template writes the text before the chunks")
        return value


def _stop_schema(schema: dict) -> None:
    """``stop``: a non-empty string, at most 4 of them, or null (what ``Sampling._stops`` lets through)."""
    text = {"type": "string", "minLength": 1}
    schema.pop("anyOf", None)
    schema["anyOf"] = [text, {"type": "array", "items": text, "maxItems": 4}, {"type": "null"}]
