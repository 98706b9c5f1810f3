"""Redis URLs without a Redis client: the cluster and sentinel forms parsed, passwords masked.

Kept apart from ``pic.store.redis_client`` (which imports redis-py) so that ``pic.config`` can check a
URL when a ``StoreConfig`` is built without importing the store.

- ``redis-cluster://[[user]:password@]host:port[,host:port...]``: a Redis Cluster; the listed nodes are
  only where discovery starts.
- ``redis-sentinel://[[user]:password@]host:port[,host:port...]/service_name``: the master that the
  listed sentinels name for ``service_name``.

A password is URL-quoted (``quote(pw, safe='')``), so it may hold ``:``, ``/`` and ``@``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from pic.errors import InvalidInputError

CLUSTER, SENTINEL = "redis-cluster", "redis-sentinel"
_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})$")
_SERVICE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


@dataclass(frozen=True)
class MultiNodeUrl:
    """A parsed ``redis-cluster://`` or ``redis-sentinel://`` URL.

    Attributes:
        user, password: credentials (unquoted), ``None`` when absent.
        nodes: ``(host, port)`` of the cluster nodes or of the sentinels.
        service: the sentinels' name of the master; ``None`` for a cluster.
    """

    user: str | None
    password: str | None
    nodes: list[tuple[str, int]]
    service: str | None


def redact(url: str) -> str:
    """The URL without its password (``redis://user:***@host:6379/0``): safe in logs and errors."""
    url = re.sub(r"(?<=://)([^:@/]*):[^@/]*@", r"\1:***@", url)
    return re.sub(r"(?<=[?&]password=)[^&]*", "***", url)


def parse(url: str) -> MultiNodeUrl:
    """The parts of a ``redis-cluster://`` or ``redis-sentinel://`` URL.

    Raises:
        InvalidInputError: not one of the two forms, or a part of it is malformed (named with the
            password masked).
    """
    kind, sep, rest = url.partition("://")
    if not sep or kind not in (CLUSTER, SENTINEL):
        raise _bad(url, f"the scheme is not {CLUSTER}:// or {SENTINEL}://")
    auth, at, rest = rest.rpartition("@")
    user = password = None
    if at:
        name, colon, secret = auth.partition(":")
        if not colon:  # "secret@" may be a password put where the user goes: mask it all
            raise _bad(f"{kind}://***@{rest}", "credentials are [user]:password@ (URL-quoted)")
        user, password = (unquote(name) or None), unquote(secret)
    hosts, slash, service = rest.partition("/")
    if kind == CLUSTER and (slash and service):
        raise _bad(url, "a cluster URL has no path (no database or service name)")
    if kind == SENTINEL and not _SERVICE.match(service):
        raise _bad(url, "a sentinel URL ends in /service_name (letters, digits, '_', '.', '-')")
    nodes = [_host_port(url, h) for h in hosts.split(",")]
    return MultiNodeUrl(user=user, password=password, nodes=nodes, service=service if kind == SENTINEL else None)


def check_single(url: str) -> None:
    """Check a ``redis://`` / ``rediss://`` URL's port (1-65535) and database (digits), which redis-py
    would refuse later with a bare ``ValueError``, or (a database ``/abc``) silently read as 0.

    Raises:
        InvalidInputError: naming the part, with the password masked.
    """
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        raise _bad(url, "the port is not a number from 1 to 65535") from None
    if port == 0:
        raise _bad(url, "the port is not a number from 1 to 65535")
    if not parts.hostname:
        raise _bad(url, "no host")
    database = parts.path.strip("/")
    if database and not database.isdigit():
        raise _bad(url, f"the database {database!r} is not a number (redis://host:port/0)")


def _host_port(url: str, text: str) -> tuple[str, int]:
    found = _HOST_PORT.match(text)
    if not found or not 0 < int(found[2]) < 65536:
        raise _bad(url, f"{text!r} is not host:port")
    return found[1].strip("[]"), int(found[2])


def _bad(url: str, why: str) -> InvalidInputError:
    return InvalidInputError(f"bad Redis URL {redact(url)!r}: {why}")
