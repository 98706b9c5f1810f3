"""Splitting a chat prompt around the documents: ``PIC.link_chat``.

The linked prompt is ``prefix + chunks + query``. To put the chunks exactly where a plain chat prompt
would put the documents, the model's own chat template is rendered once with a placeholder where the
documents go, and the text is cut there: what comes before is the prefix, what comes after the query.
The placeholder goes at the start of the first user message, or where a message says ``{documents}``.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence

from pic.errors import InvalidInputError
from pic.text import check_encodable

# The marker a message's content may hold to say where the documents go.
DOCUMENTS_MARKER = "{documents}"


def split_chat(
    tokenizer: object, messages: object, *, add_generation_prompt: bool = True, strip_bos: bool = True
) -> tuple[str, str]:
    """The ``(prefix, query)`` texts of the chat prompt of ``messages`` around its documents.

    ``prefix + documents + query`` is the tokenizer's chat template rendered with the documents' text
    in place of the placeholder. The placeholder is a random string made per call, so neither user
    content nor a template can hold it by chance; it must come out of the template exactly once.

    Args:
        strip_bos: drop a BOS text the template writes at the start (Llama 3 templates do): pic adds
            the BOS itself, so leaving it would give the prompt two. Pass ``False`` when pic adds none.

    Raises:
        InvalidInputError: malformed messages, none to hold the documents (no user message and no
            marker), several ``{documents}`` markers, a tokenizer without a chat template, or a
            template that fails on the messages or does not keep the placeholder exactly once.
    """
    if not isinstance(add_generation_prompt, bool):
        raise InvalidInputError(f"add_generation_prompt is {add_generation_prompt!r:.80}; expected True or False")
    check_messages(messages)
    if not has_chat_template(tokenizer):
        raise InvalidInputError(
            f"tokenizer {_name(tokenizer)!r} has no chat template; set tokenizer.chat_template, or link "
            f"with an explicit prefix and query (PIC.link)"
        )
    placeholder = f"PICDOCUMENTS{uuid.uuid4().hex}"
    marked = place_documents(messages, placeholder)
    text = _render(tokenizer, marked, add_generation_prompt=add_generation_prompt)
    count = text.count(placeholder)
    if count != 1:
        raise InvalidInputError(
            f"the chat template of {_name(tokenizer)!r} wrote the documents' placeholder {count} times, "
            f"not once; link with an explicit prefix and query (PIC.link)"
        )
    prefix, query = text.split(placeholder)
    bos = getattr(tokenizer, "bos_token", None)
    if strip_bos and isinstance(bos, str) and bos and prefix.startswith(bos):
        prefix = prefix[len(bos) :]
    return prefix, query


def has_chat_template(tokenizer: object) -> bool:
    """Whether ``tokenizer`` can render chats (a base model's has no template; ``pic serve --chat-template``
    gives it one)."""
    return bool(getattr(tokenizer, "chat_template", None)) and hasattr(tokenizer, "apply_chat_template")


def check_messages(messages: object) -> None:
    """Refuse anything but a non-empty list of ``{"role": str, "content": str, ...}`` dicts, naming
    the bad message: a template would fail on it later with a less helpful error, or render it wrong.

    Raises:
        InvalidInputError: the first problem found.
    """
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise InvalidInputError(
            f"messages is {_short(messages)}; expected a list of {{'role': ..., 'content': ...}} dicts"
        )
    if not messages:
        raise InvalidInputError("messages is empty; link_chat needs at least one message")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidInputError(
                f"message {i} is {_short(message)}; expected a dict with 'role' and 'content' strings"
            )
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise InvalidInputError(
                    f"message {i} has {key} {_short(message.get(key))}; expected a string (in {_short(message)})"
                )
            check_encodable(message[key], f"messages[{i}].{key}")


def place_documents(messages: Sequence[Mapping], placeholder: str) -> list[dict]:
    """Copies of ``messages`` with ``placeholder`` where the documents go: in place of the one
    ``{documents}`` marker, else at the start of the first user message's content.

    Raises:
        InvalidInputError: several markers, or neither a marker nor a user message.
    """
    marked = [i for i, m in enumerate(messages) for _ in range(m["content"].count(DOCUMENTS_MARKER))]
    if len(marked) > 1:
        raise InvalidInputError(
            f"{len(marked)} {DOCUMENTS_MARKER} markers (in messages {sorted(set(marked))}); the documents "
            f"go in one place: write the marker once"
        )
    if marked:
        index = marked[0]
        content = messages[index]["content"].replace(DOCUMENTS_MARKER, placeholder)
    else:
        index = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
        if index is None:
            roles = [m["role"] for m in messages]
            raise InvalidInputError(
                f"no user message (roles {roles}) and no {DOCUMENTS_MARKER} marker: nowhere to put the "
                f"documents; add a user message or write {DOCUMENTS_MARKER} in a message's content"
            )
        content = placeholder + messages[index]["content"]
    out = [dict(m) for m in messages]
    out[index]["content"] = content
    return out


def _render(tokenizer: object, messages: list[dict], *, add_generation_prompt: bool) -> str:
    """The template's text; its own errors (roles that must alternate, ...) become ``InvalidInputError``."""
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as error:  # jinja2's TemplateError and raise_exception(...) in templates
        raise InvalidInputError(f"the chat template of {_name(tokenizer)!r} failed on the messages: {error}") from error
    if not isinstance(text, str):
        raise InvalidInputError(f"the chat template of {_name(tokenizer)!r} rendered {_short(text)}, not text")
    return text


def _name(tokenizer: object) -> str:
    return getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
