"""Checks of user text shared by compiling (documents, queries) and linking chats (messages)."""

from __future__ import annotations

from pic.errors import InvalidInputError


def check_encodable(text: str, what: str) -> None:
    """Refuse text that is not valid Unicode (a lone surrogate, as ``"\\ud800"`` or a bad decode leaves):
    tokenizers and templates fail on it with errors that name nothing.

    Raises:
        InvalidInputError: naming ``what``, the character and where it is.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInputError(
            f"{what} holds {text[exc.start]!r} at character {exc.start}, a lone surrogate that is not valid "
            f"Unicode text; fix the text (e.g. decode its bytes with errors='replace')"
        ) from None


def refuse_text_for_list(value: object, name: str, items: str) -> None:
    """Refuse one string (or bytes) where a list of ``items`` is expected: iterated, it would be one item per
    character (``documents="one text"`` made 8 documents). ``compile(docs)`` is the exception, by design:
    there a string is one document.

    Raises:
        InvalidInputError: naming ``name`` and saying to pass a list (``[value]`` for one).
    """
    if isinstance(value, (str, bytes, bytearray)):
        text = repr(value)
        shown = text if len(text) <= 60 else f"{text[:57]}..."
        raise InvalidInputError(f"{name} is a string ({shown}), not a list: pass a list of {items} ([{shown}] for one)")
