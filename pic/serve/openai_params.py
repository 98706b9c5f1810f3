"""Which top-level fields a completion body may hold: OpenAI's parameters (honoured, ignored or refused) and
nothing else.

A field this server does not know is a 400 naming it, not silently dropped: a client that writes pic's
``documents`` at the top level instead of under ``"pic"`` would otherwise get an answer that never saw its
documents. OpenAI's own clients (``openai``, LangChain's ``ChatOpenAI``) send some parameters this server has
no use for (``user``, ``stream_options``, ``n``, ``logprobs: false`` ...): those stay accepted.
"""

from __future__ import annotations

import json

# OpenAI parameters (chat completions and completions) accepted and ignored: none changes the text a request
# gets (who asks, storage, billing, caching and latency hints; tool-call parallelism without tools).
IGNORED: frozenset[str] = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "parallel_tool_calls",
        "prompt_cache_key",
        "prompt_cache_retention",
        "safety_identifier",
        "prediction",
    }
)

# OpenAI parameters this server does not implement, with the values that ask for nothing: any other value is
# a 400 naming it, so that a request never silently gets less than it asked for.
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
    "modalities": (None, ["text"]),
    "audio": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
}

# pic's fields, which go under "pic": what the hint shows each one holds.
PIC_FIELDS: dict[str, str] = {
    "cache_ids": "[...]",
    "documents": "[...]",
    "policy": '"..."',
    "prefix": '"..."',
    "relevance": "[...]",
}

# Fields of the other route.
ROUTE_HINTS: dict[str, dict[str, str]] = {
    "/v1/completions": {
        "messages": "messages go to /v1/chat/completions",
        "max_completion_tokens": "a completion's limit is max_tokens",
    },
    "/v1/chat/completions": {"prompt": "a prompt goes to /v1/completions; a chat sends messages"},
}

# At most this many unknown fields are named, each in at most this many characters; a refused value is echoed
# whole up to _MAX_VALUE characters.
_MAX_NAMED, _MAX_NAME, _MAX_VALUE = 4, 60, 40


def unknown_fields(data: dict, known: set[str], route: str) -> tuple[str, str, str] | None:
    """The fields of ``data`` (a body of ``route``) that are neither ``known`` (its own fields) nor OpenAI's, as
    the error's ``(type, param, message)`` (``param``: the first one); ``None`` when there is none."""
    unknown = [key for key in data if key not in known and key not in IGNORED and key not in UNSUPPORTED]
    if not unknown:
        return None
    parts = [f"unknown field {_name(key)}: {_hint(key, route)}" for key in unknown[:_MAX_NAMED]]
    if len(unknown) > _MAX_NAMED:
        parts.append(f"and {len(unknown) - _MAX_NAMED} more unknown fields")
    return "unknown_parameter", unknown[0][:_MAX_NAME], "; ".join(parts)


def unsupported_parameters(data: dict) -> tuple[str, str, str] | None:
    """The OpenAI parameters of ``data`` this server does not implement that ask for something (not their
    neutral value), as the error's ``(type, param, message)``; ``None`` when there is none."""
    asked = [key for key, neutral in UNSUPPORTED.items() if key in data and not _neutral(data[key], neutral)]
    if not asked:
        return None
    names = ", ".join(f"{key}={_brief(data[key])}" for key in asked)
    leave = "leave it out" if len(asked) == 1 else "leave them out"
    return "unsupported_parameter", asked[0], f"{names}: not supported by this server ({leave})"


def openai_properties() -> dict[str, dict]:
    """JSON schemas of the OpenAI parameters a body may hold beyond its own fields: the ignored ones take any
    value, the unsupported ones only their neutral values."""
    properties: dict[str, dict] = {
        key: {"description": "OpenAI's; accepted and ignored (it changes nothing here)"} for key in sorted(IGNORED)
    }
    for key, neutral in UNSUPPORTED.items():
        properties[key] = {
            "enum": [_json_value(value) for value in neutral],
            "description": "OpenAI's; not supported: only its neutral values are accepted (any other is a 400)",
        }
    return properties


def _neutral(value: object, neutral: tuple[object, ...]) -> bool:
    """``value`` is one of ``neutral`` as JSON compares them: ``0.0`` is ``0``, but ``false`` is not ``0`` (as
    Python's ``False == 0`` would have it, and the schema's enum would not)."""
    return any(isinstance(value, bool) == isinstance(n, bool) and value == n for n in neutral)


def _hint(key: str, route: str) -> str:
    if key in PIC_FIELDS:
        return f'pic\'s fields go under "pic": {{"{key}": {PIC_FIELDS[key]}}}'
    hint = ROUTE_HINTS.get(route, {}).get(key)
    if hint is not None:
        return hint
    return f'not a parameter of {route} (OpenAI\'s, or pic\'s under "pic": {{"documents": [...], ...}})'


def _brief(value: object) -> str:
    """``value`` as the error echoes it: whole when short (``logprobs=5``), else its kind and size
    (``tools=[...] (1 item)``): a repr cut at a fixed width ended the message mid-value, mid-word."""
    text = repr(value)
    if len(text) <= _MAX_VALUE:
        return text
    if isinstance(value, list | dict):  # JSON's arrays and objects
        shape, unit = ("[...]", "item") if isinstance(value, list) else ("{...}", "key")
        return f"{shape} ({len(value)} {unit}{'s' if len(value) != 1 else ''})"
    return f"{text[: _MAX_VALUE - 3]}... ({len(text)} characters)"


def _name(key: str) -> str:
    text = repr(key)
    return text if len(text) <= _MAX_NAME else f"{text[:_MAX_NAME]}... ({len(key)} characters)"


def _json_value(value: object) -> object:
    """``value`` as JSON has it (a round trip: tuples become lists)."""
    return json.loads(json.dumps(value))
