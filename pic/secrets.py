"""Secrets from files and environment variables, never from the command line.

Any local user reads another process's command line (``ps``, ``/proc/PID/cmdline``), so a key given there is
given to all of them. A file's secret is read bounded (at most ``MAX_SECRET_BYTES``), from a regular file (or a
pipe: ``--api-key-file <(pass show pic)``) that neither the group nor others may read or write (``chmod 600``:
otherwise it is no more private than the command line, and refused, as ssh refuses such a key), with one trailing
newline dropped (``echo KEY > file`` writes one); an empty one is refused. An environment variable is readable only
by the process's own user (``/proc/PID/environ`` is 0400) and by root.

Each function raises ``InvalidInputError`` naming where the secret came from, never the secret itself.
"""

from __future__ import annotations

import os
import re
import stat

from pic.errors import InvalidInputError

MAX_SECRET_BYTES = 64 << 10
"""The longest secret file read: keys and URLs are short; a larger file is surely the wrong one."""

MIN_STORE_KEY_BYTES = 16
_HEX = re.compile(r"^[0-9a-fA-F]+$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def read_secret_file(path: str) -> bytes:
    """The secret in the file at ``path``: its bytes, one trailing newline (``\\n`` or ``\\r\\n``) dropped.

    Raises:
        InvalidInputError: it cannot be read; it is not a regular file or a pipe; the group or others may read or
            write it; it is over ``MAX_SECRET_BYTES``; it is empty.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise InvalidInputError(f"cannot read {path!r}: {exc.strerror or exc}") from None
    try:
        _check_private(path, os.fstat(fd).st_mode)  # of the file opened, not of what the path names a moment later
        data = _read_bounded(fd)
    finally:
        os.close(fd)
    if len(data) > MAX_SECRET_BYTES:
        raise InvalidInputError(f"{path!r} is over {MAX_SECRET_BYTES:,} bytes: not a key or a URL")
    data = data.removesuffix(b"\n").removesuffix(b"\r") if data.endswith(b"\n") else data
    if not data:
        raise InvalidInputError(f"{path!r} is empty")
    return data


def _check_private(path: str, mode: int) -> None:
    """Raises: InvalidInputError: not a regular file or a pipe, or readable or writable by group or others."""
    if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
        raise InvalidInputError(f"{path!r} is not a file")
    if mode & 0o066:
        raise InvalidInputError(
            f"{path!r} may be read or written by others (mode {stat.S_IMODE(mode):04o}): a secret there is no more "
            f"private than on the command line; chmod 600 {path}"
        )


def _read_bounded(fd: int) -> bytes:
    """Up to ``MAX_SECRET_BYTES + 1`` bytes of ``fd`` (a pipe gives them in pieces)."""
    pieces, size = [], 0
    while size <= MAX_SECRET_BYTES:
        piece = os.read(fd, MAX_SECRET_BYTES + 1 - size)
        if not piece:
            break
        pieces.append(piece)
        size += len(piece)
    return b"".join(pieces)


def secret_text(data: bytes | str, where: str) -> str:
    """A secret as one line of text (an API key, a Redis URL): UTF-8, without control characters (a second line, a
    tab: no client can send it in a header, and it is surely a mistake), not empty nor blank.

    Raises:
        InvalidInputError: naming ``where`` (a file or a variable), never the secret.
    """
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidInputError(f"{where} is not UTF-8 text (byte {exc.start})") from None
    if not data.strip():
        raise InvalidInputError(f"{where} is empty")
    control = _CONTROL.search(data)
    if control is not None:
        raise InvalidInputError(
            f"{where} holds a control character ({control.group()!r} at character {control.start()}): one secret, "
            "one line"
        )
    return data


def store_key(data: bytes | str, where: str) -> bytes:
    """The fleet's store key from its hex digits (``openssl rand -hex 32``): at least ``MIN_STORE_KEY_BYTES`` bytes
    (32 digits). Hex, in a file and in ``PIC_STORE_KEY`` alike: an environment variable cannot hold every byte (no
    NUL), and one rule leaves nothing to guess (a raw key that happened to be hex digits would be read as half as
    long).

    Raises:
        InvalidInputError: not hex digits, an odd number of them, or too few; naming ``where``, never the key.
    """
    text = secret_text(data, where).strip()
    if not _HEX.match(text):
        raise InvalidInputError(f"{where} is not hex digits: a store key is written in hex (openssl rand -hex 32)")
    if len(text) % 2:
        raise InvalidInputError(f"{where} has an odd number of hex digits ({len(text)}): two digits a byte")
    if len(text) < 2 * MIN_STORE_KEY_BYTES:
        raise InvalidInputError(
            f"{where} is {len(text) // 2} bytes; a store key has at least {MIN_STORE_KEY_BYTES} "
            f"({2 * MIN_STORE_KEY_BYTES} hex digits; openssl rand -hex 32 makes 32 bytes)"
        )
    return bytes.fromhex(text)


def has_credentials(url: str) -> bool:
    """Whether a Redis URL carries a user or password (``redis://:pw@host``, ``redis://u:pw@host``,
    ``?password=pw``)."""
    return re.search(r"://[^/]*@", url) is not None or re.search(r"[?&]password=", url) is not None
