"""Argument types of the ``pic`` command line: a bad value is an argparse error naming it (exit 2), before
any model loads, never a traceback after a minute of start-up."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TypeVar

_T = TypeVar("_T")

MAX_CASES = 100_000
MAX_TEMPLATE_BYTES = 1 << 20  # a chat template is a few KB; a megabyte is surely the wrong file


def port(text: str) -> int:
    """A TCP port, 1-65535."""
    value = _int(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (1-65535)")
    return value


def non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    return value


def positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


_BYTE_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def byte_size(text: str) -> int:
    """A positive number of bytes, plain or with a binary unit: ``1073741824``, ``512M``, ``10G``, ``1T``."""
    number, unit = text.strip().upper().removesuffix("B").removesuffix("I"), ""
    if number[-1:] in _BYTE_UNITS:
        number, unit = number[:-1], number[-1]
    try:
        value = float(number) * _BYTE_UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (bytes, or a number with K, M, G or T)") from None
    if not math.isfinite(value) or value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size")
    return int(value)


def cases(text: str) -> int:
    """A number of evaluation cases, 1 to ``MAX_CASES`` (a typo's 100,000,000 would allocate for each first)."""
    value = positive_int(text)
    if value > MAX_CASES:
        raise argparse.ArgumentTypeError(f"{text!r} cases is more than {MAX_CASES:,}")
    return value


def file_stem(text: str) -> str:
    """A file name without a folder (``--name``): no separator, not ``.`` or ``..``, not empty."""
    if not text or text in (".", "..") or "/" in text or "\\" in text or "\0" in text:
        raise argparse.ArgumentTypeError(f"{text!r} is not a plain file name (use --out for the folder)")
    return text


def share(text: str) -> float:
    """A fraction in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a share in [0, 1)")
    return value


def positive_float(text: str) -> float:
    """A finite number above 0 (``nan`` and ``inf`` refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number above 0")
    return value


def nonempty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty value (it would match nothing, or everything)")
    return text


_REDIS_SCHEMES = ("redis://", "rediss://", "unix://", "redis-cluster://", "redis-sentinel://")


def redis_url(text: str) -> str:
    """A Redis URL as ``StoreConfig.redis_url`` takes it (the message masks a password: the scheme is checked
    here, as ``StoreConfig``'s own check of it echoes the URL whole)."""
    from pic.config import StoreConfig
    from pic.errors import InvalidInputError
    from pic.redis_url import redact

    if not text.startswith(_REDIS_SCHEMES):
        raise argparse.ArgumentTypeError(
            f"{redact(text)!r:.200} is not a Redis URL: it starts with {', '.join(_REDIS_SCHEMES)}"
        )
    try:
        StoreConfig(redis_url=text)
    except InvalidInputError as exc:
        raise argparse.ArgumentTypeError(redact(str(exc).removeprefix("invalid StoreConfig: "))) from None
    return text


def policy(text: str) -> str:
    """A recompute policy spec (``"mepic"``, ``"legolink:16"``, ...) that ``pic.policies.resolve`` accepts."""
    from pic.errors import PolicyError
    from pic.link.policies import resolve

    try:
        resolve(text)
    except PolicyError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def chat_template(path: str) -> str:
    """The text of a Jinja chat template file (at most ``MAX_TEMPLATE_BYTES``, UTF-8, that Jinja parses)."""
    import jinja2

    try:
        with open(path, "rb") as file:
            data = file.read(MAX_TEMPLATE_BYTES + 1)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path!r}: {exc.strerror or exc}") from None
    if len(data) > MAX_TEMPLATE_BYTES:
        raise argparse.ArgumentTypeError(f"{path!r} is over {MAX_TEMPLATE_BYTES:,} bytes: not a chat template")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{path!r} is not UTF-8 text (byte {exc.start})") from None
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{path!r} is empty")
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise argparse.ArgumentTypeError(f"{path!r} line {exc.lineno}: {exc.message}") from None
    return text


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def api_key_file(path: str) -> str:
    """The API key in the file at ``path`` (``pic.secrets``: private, bounded, one line)."""
    from pic.secrets import secret_text

    return _secret(lambda data: secret_text(data, repr(path)), path)


def store_key_file(path: str) -> bytes:
    """The fleet's store key in the file at ``path``: hex digits, at least 16 bytes (``pic.secrets.store_key``)."""
    from pic.secrets import store_key

    return _secret(lambda data: store_key(data, repr(path)), path)


def redis_url_file(path: str) -> str:
    """A Redis URL (with its password) in the file at ``path``, as ``--redis-url`` takes it."""
    from pic.secrets import secret_text

    return _secret(lambda data: redis_url(secret_text(data, repr(path))), path)


def _secret(read: Callable[[bytes], _T], path: str) -> _T:
    """``read(bytes of the secret file at path)``; an ``InvalidInputError`` is an argparse error (never echoing
    the secret: the messages name the file)."""
    from pic.errors import InvalidInputError
    from pic.secrets import read_secret_file

    try:
        return read(read_secret_file(path))
    except InvalidInputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
