"""``pic serve``'s secrets: the API key, the fleet's store key and the Redis URL (its password), each from a file
or an environment variable, so that none needs the command line (which every local user reads: ``ps``,
``/proc/PID/cmdline``).

| secret | file | environment | command line |
| --- | --- | --- | --- |
| API key | ``--api-key-file PATH`` | ``PIC_API_KEY`` | ``--api-key KEY`` (a warning) |
| store key (hex) | ``--store-key-file PATH`` | ``PIC_STORE_KEY`` | none |
| Redis URL | ``--redis-url-file PATH`` | ``PIC_REDIS_URL`` | ``--redis-url URL`` (a warning with a password) |

One source each: two given (a flag and the variable too) is an argparse error naming both, not a silent choice
of one. A variable that is set but empty is refused too (``PIC_API_KEY=$UNSET`` would leave the server open).
Every error is an argparse error (exit 2) before the model loads, naming the flag or variable, never the secret.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping
from typing import TypeVar

from pic.cli_args import api_key_file, nonempty, redis_url, redis_url_file, store_key_file
from pic.errors import InvalidInputError
from pic.redis_url import redact

_T = TypeVar("_T")
API_KEY_ENV, STORE_KEY_ENV, REDIS_URL_ENV = "PIC_API_KEY", "PIC_STORE_KEY", "PIC_REDIS_URL"


def add_secret_flags(serve: argparse.ArgumentParser) -> None:
    """The secrets' flags (their values resolved by ``resolve_secrets``)."""
    serve.add_argument(
        "--api-key", type=nonempty, default=None,
        help=f"require 'Authorization: Bearer KEY' (all routes but /health); visible to every local user in ps: "
        f"prefer --api-key-file or {API_KEY_ENV}",
    )  # fmt: skip
    serve.add_argument(
        "--api-key-file", type=api_key_file, default=None, metavar="PATH",
        help=f"the API key from this file (mode 600, one line); or set {API_KEY_ENV}",
    )  # fmt: skip
    serve.add_argument(
        "--store-key-file", type=store_key_file, default=None, metavar="PATH",
        help=f"the fleet's store key (hex, at least 32 digits: openssl rand -hex 32) from this file (mode 600), "
        f"or set {STORE_KEY_ENV}: chunks in the disk and Redis tiers are authenticated with it",
    )  # fmt: skip
    serve.add_argument(
        "--redis-url", type=redis_url, default=None,
        help=f"a Redis shared by a fleet of servers (a password here is visible in ps: prefer --redis-url-file or "
        f"{REDIS_URL_ENV})",
    )  # fmt: skip
    serve.add_argument(
        "--redis-url-file", type=redis_url_file, default=None, metavar="PATH",
        help=f"the Redis URL, with its password, from this file (mode 600); or set {REDIS_URL_ENV}",
    )  # fmt: skip


def resolve_secrets(
    parser: argparse.ArgumentParser, args: argparse.Namespace, environ: Mapping[str, str] = os.environ
) -> None:
    """Set ``args.api_key``, ``args.store_key`` (bytes or ``None``) and ``args.redis_url`` from their one source
    each, and warn on stderr about a secret given on the command line. An error is ``parser.error`` (exit 2)."""
    from pic.secrets import has_credentials, secret_text, store_key

    argv_key = args.api_key
    args.api_key = _one(parser, "the API key", {
        "--api-key": argv_key, "--api-key-file": args.api_key_file,
        API_KEY_ENV: _from_env(parser, environ, API_KEY_ENV, lambda text: secret_text(text, API_KEY_ENV)),
    })  # fmt: skip
    args.store_key = _one(parser, "the store key", {
        "--store-key-file": args.store_key_file,
        STORE_KEY_ENV: _from_env(parser, environ, STORE_KEY_ENV, lambda text: store_key(text, STORE_KEY_ENV)),
    })  # fmt: skip
    argv_url = args.redis_url
    args.redis_url = _one(parser, "the Redis URL", {
        "--redis-url": argv_url, "--redis-url-file": args.redis_url_file,
        REDIS_URL_ENV: _from_env(parser, environ, REDIS_URL_ENV, _env_redis_url),
    })  # fmt: skip
    if argv_key is not None:
        _warn(
            f"--api-key puts the key on the command line, where every local user reads it (ps, /proc/PID/cmdline): "
            f"give it as --api-key-file PATH (mode 600) or in the environment as {API_KEY_ENV}"
        )
    if argv_url is not None and has_credentials(argv_url):
        _warn(
            f"--redis-url {redact(argv_url)} puts its password on the command line, where every local user reads it "
            f"(ps, /proc/PID/cmdline): give the URL as --redis-url-file PATH (mode 600) or in the environment as "
            f"{REDIS_URL_ENV}"
        )


def _one(parser: argparse.ArgumentParser, what: str, sources: dict[str, _T | None]) -> _T | None:
    """The value of the one source that gives ``what`` (``None``: none does); two are ``parser.error``."""
    given = [name for name, value in sources.items() if value is not None]
    if len(given) > 1:
        parser.error(f"{' and '.join(given)} both give {what}: give one")
    return sources[given[0]] if given else None


def _from_env(
    parser: argparse.ArgumentParser, environ: Mapping[str, str], name: str, read: Callable[[str], _T]
) -> _T | None:
    """``read(environ[name])`` when the variable is set (``None`` when it is not); a bad value is ``parser.error``."""
    if name not in environ:
        return None
    try:
        return read(environ[name])
    except (InvalidInputError, argparse.ArgumentTypeError) as exc:
        parser.error(str(exc))


def _env_redis_url(text: str) -> str:
    """``PIC_REDIS_URL``'s value, checked as ``--redis-url`` checks its own (the message masks a password)."""
    from pic.secrets import secret_text

    try:
        return redis_url(secret_text(text, REDIS_URL_ENV))
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{REDIS_URL_ENV}: {exc}") from None


def _warn(message: str) -> None:
    print(f"pic: warning: {message}", file=sys.stderr, flush=True)
