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
