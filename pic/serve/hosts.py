"""Whom a server without an API key answers: requests addressed to it by its own address (``Host``), and from no
other site's web page (``Origin``).

A keyless server trusts whoever reaches its port, and a web page can reach it too: a page on any site can POST a
form to ``http://127.0.0.1:8000/v1/chunks`` (cross-site request forgery), and a page whose name its owner points at
127.0.0.1 after it loaded (DNS rebinding) can call the server and read its answers as if it were the same site.
Browsers cannot hide what they do from either check: every request names the host it was sent to (``Host``: the
attacker's name under rebinding), and a cross-site POST names the page's site (``Origin``). With an API key neither
matters: a browser never attaches the bearer key to another site's request.

What a keyless server accepts as its own address: the address the connection came in on (the ASGI scope's
``server``: the interface's IP, also under a wildcard bind such as ``0.0.0.0``), with its port; on a loopback
connection also ``localhost``, ``127.0.0.1`` and ``[::1]`` with that port; and the names the operator allows
(``--allowed-host NAME`` for any port, ``NAME:PORT`` for one; a ``--host`` that is a name is allowed with its port).
"""

from __future__ import annotations

import argparse
import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass

_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
_NAME = re.compile(r"^[a-z0-9_]([a-z0-9_.-]*[a-z0-9_])?$")  # a DNS name or an IPv4 address, lower case
_DEFAULT_PORTS = {"http": 80, "https": 443}


def split_host(text: str) -> tuple[str, int | None] | None:
    """``"Example.COM.:8000"`` -> ``("example.com", 8000)``, ``"[::1]"`` -> ``("::1", None)``: a ``Host`` header's
    (or an ``--allowed-host``'s) name, lower case without a trailing dot (an IP address in its normal form), and its
    port (``None``: not given); ``None`` when it is not ``name[:port]`` or ``[ipv6][:port]``."""
    text = text.strip().lower()
    if text.startswith("["):
        address, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            return None
        name, port_text = address, rest[1:] if rest else None
        try:
            name = str(ipaddress.IPv6Address(name))
        except ValueError:
            return None
    else:
        name, colon, port_text = text.partition(":")
        port_text = port_text if colon else None
        name = name.rstrip(".")
        if not _NAME.match(name):
            return None
    if port_text is None:
        return _normal(name), None
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        return None
    return _normal(name), int(port_text)


def _normal(name: str) -> str:
    """An IP address in its normal form, an IPv4 address mapped into IPv6 (``::ffff:10.0.0.5``, a dual-stack
    socket's view of an IPv4 client) as the IPv4 address; a name as it is."""
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return name
    return str(getattr(address, "ipv4_mapped", None) or address)


def _is_loopback(name: str) -> bool:
    """Whether ``name`` (normal: ``_normal``) is a loopback address."""
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class AllowedHosts:
    """The names a keyless server answers besides its own address, each with a port or ``None`` (any port).

    Build it with ``AllowedHosts.parse`` from ``--allowed-host`` values (``name`` or ``name:port``)."""

    names: frozenset[tuple[str, int | None]] = frozenset()

    @classmethod
    def parse(cls, values: Iterable[str]) -> AllowedHosts:
        """Raises: ValueError: a value that is not ``name``, ``name:port``, ``[ipv6]`` or ``[ipv6]:port``."""
        names = set()
        for value in values:
            split = split_host(value)
            if split is None:
                raise ValueError(f"{value!r:.80} is not a host name (NAME or NAME:PORT, an IPv6 address in brackets)")
            names.add(split)
        return cls(frozenset(names))

    def _own(self, server: tuple[str, int] | None) -> list[tuple[str, int | None]]:
        """Every (name, port) the server answers to on a connection that came in on ``server``."""
        own = list(self.names)
        if server is not None and server[0]:
            host, port = _normal(str(server[0]).lower()), server[1]
            own.append((host, port))
            if _is_loopback(host):
                own += [(name, port) for name in _LOOPBACK_NAMES]
        return own

    def allows(self, host: tuple[str, int | None], server: tuple[str, int] | None, *, default_port: int) -> bool:
        """Whether a request addressed to ``host`` (a port of ``None``: ``default_port``) reached its server."""
        name, port = host[0], host[1] if host[1] is not None else default_port
        return any(name == own and (own_port is None or own_port == port) for own, own_port in self._own(server))

    def refusal(self, scope: dict) -> str | None:
        """Why an HTTP request (its ASGI ``scope``) is refused, or ``None``: its ``Host`` names no address of this
        server, or its ``Origin`` (when sent) is another site."""
        server = scope.get("server")
        headers = {key: value for key, value in scope["headers"] if key in (b"host", b"origin")}
        host_text = headers.get(b"host", b"").decode("latin-1")
        host = split_host(host_text) if host_text else None
        if host is None or not self.allows(host, server, default_port=80):
            said = f"Host {host_text!r:.80}" if host_text else "a request without a Host header"
            return (
                f"{said} names no address of this server ({self._named(server)}): a server without an API key "
                "answers only requests sent to its own address (a guard against DNS rebinding); address it by one "
                "of those, start it with --allowed-host NAME for a name its clients use, or with --api-key"
            )
        origin = headers.get(b"origin")
        if origin is not None and not self._same_site(origin.decode("latin-1"), server):
            return (
                f"a request from the web page at {origin.decode('latin-1')!r:.80} is refused: a server without an API "
                f"key answers no other site's pages (a guard against cross-site requests; its own: "
                f"{self._named(server)}); start it with --allowed-host NAME to allow pages of NAME, or with --api-key"
            )
        return None

    def _same_site(self, origin: str, server: tuple[str, int] | None) -> bool:
        """Whether an ``Origin`` (``scheme://host[:port]``) is this server's (``null``, a page of no site, is not)."""
        scheme, sep, rest = origin.strip().partition("://")
        scheme = scheme.lower()
        if not sep or scheme not in _DEFAULT_PORTS or "/" in rest:
            return False
        host = split_host(rest)
        return host is not None and self.allows(host, server, default_port=_DEFAULT_PORTS[scheme])

    def _named(self, server: tuple[str, int] | None) -> str:
        """The addresses the server answers to on this connection, in words (``127.0.0.1:8000, localhost:8000,
        ...``); the names ``--allowed-host`` allows are not listed (the client may be a rebound page: the server's
        own address it reached already, but not the names of the operator's network)."""
        own = [(name, port) for name, port in self._own(server) if (name, port) not in self.names]
        named = [
            (f"[{name}]" if ":" in name else name) + ("" if port is None else f":{port}")
            for name, port in sorted(set(own), key=lambda pair: (pair[0], pair[1] or 0))
        ]
        if self.names:
            named.append("a name --allowed-host allows")
        return ", ".join(named) or "none"


def allowed_host(text: str) -> str:
    """A host name a keyless server answers to (``NAME`` or ``NAME:PORT``, an IPv6 address in brackets)."""
    try:
        AllowedHosts.parse([text])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text
