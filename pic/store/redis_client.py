"""Redis clients from one URL: a single server, a Redis Cluster or a Sentinel-managed master.

- ``redis://[[user]:password@]host:port/db``, ``rediss://...``, ``unix:///path.sock?db=0&password=...``:
  one server (``redis.Redis.from_url``).
- ``redis-cluster://[[user]:password@]host:port[,host:port...]``: a Redis Cluster (``RedisCluster``); the
  listed nodes are only where discovery starts, the client then follows the cluster's slot map.
- ``redis-sentinel://[[user]:password@]host:port[,host:port...]/service_name``: the master that the
  listed sentinels name for ``service_name``; after a failover the client finds the new master by itself.
  The password is sent to the sentinels and to the data nodes alike.

A password is URL-quoted (``quote(pw, safe='')``), so it may hold ``:``, ``/`` and ``@``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

import redis
from redis.cluster import ClusterNode, LoadBalancingStrategy, RedisCluster
from redis.exceptions import RedisClusterException
from redis.sentinel import Sentinel

from pic.errors import InvalidInputError

CLUSTER, SENTINEL = "redis-cluster", "redis-sentinel"
_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})$")
_SERVICE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


def redact(url: str) -> str:
    """The URL without its password (``redis://user:***@host:6379/0``): safe in logs and errors."""
    url = re.sub(r"(?<=://)([^:@/]*):[^@/]*@", r"\1:***@", url)
    return re.sub(r"(?<=[?&]password=)[^&]*", "***", url)


def connect(url: str, *, timeout_s: float, read_from_replicas: bool = False) -> Any:
    """A redis-py client for ``url`` (see the module docstring for the forms).

    ``read_from_replicas``: a cluster reads from replicas too (round robin); a sentinel setup reads
    ``GET``/``EXISTS``/``SCAN`` from a replica (the master when none is up). Replicas lag the master, so a
    chunk just written may read as a miss there; the wire format's checks keep a lagging read from
    ever being a wrong answer. Ignored for a single server.

    Raises:
        InvalidInputError: a malformed URL (named with its password masked).
    """
    timeouts = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    scheme = url.partition("://")[0]
    if scheme not in (CLUSTER, SENTINEL):
        return redis.Redis.from_url(url, **timeouts)
    user, password, nodes, service = parse(url)
    auth = {"username": user, "password": password}
    if scheme == CLUSTER:
        startup = [ClusterNode(host, port) for host, port in nodes]
        strategy = LoadBalancingStrategy.ROUND_ROBIN if read_from_replicas else None
        return _LazyCluster(
            lambda: RedisCluster(startup_nodes=startup, load_balancing_strategy=strategy, **auth, **timeouts)
        )
    sentinel_kwargs = {**auth, **timeouts} if password is not None else dict(timeouts)
    sentinel = Sentinel(nodes, sentinel_kwargs=sentinel_kwargs, **auth, **timeouts)
    master = sentinel.master_for(service)
    return _ReplicaReads(master, sentinel.slave_for(service)) if read_from_replicas else master


def parse(url: str) -> tuple[str | None, str | None, list[tuple[str, int]], str | None]:
    """``(user, password, [(host, port), ...], service)`` of a ``redis-cluster://`` or
    ``redis-sentinel://`` URL; ``service`` is ``None`` for a cluster.

    Raises:
        InvalidInputError: not one of the two forms, or a part of it is malformed.
    """
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in (CLUSTER, SENTINEL):
        raise _bad(url, f"the scheme is not {CLUSTER}:// or {SENTINEL}://")
    auth, at, rest = rest.rpartition("@")
    user = password = None
    if at:
        name, colon, secret = auth.partition(":")
        if not colon:  # "secret@" may be a password put where the user goes: mask it all
            raise _bad(f"{scheme}://***@{rest}", "credentials are [user]:password@ (URL-quoted)")
        user, password = (unquote(name) or None), unquote(secret)
    hosts, slash, service = rest.partition("/")
    if scheme == CLUSTER and (slash and service):
        raise _bad(url, "a cluster URL has no path (no database or service name)")
    if scheme == SENTINEL and not _SERVICE.match(service):
        raise _bad(url, "a sentinel URL ends in /service_name (letters, digits, '_', '.', '-')")
    return user, password, [_host_port(url, h) for h in hosts.split(",")], (service if scheme == SENTINEL else None)


def _host_port(url: str, text: str) -> tuple[str, int]:
    found = _HOST_PORT.match(text)
    if not found or not 0 < int(found[2]) < 65536:
        raise _bad(url, f"{text!r} is not host:port")
    return found[1].strip("[]"), int(found[2])


def _bad(url: str, why: str) -> InvalidInputError:
    return InvalidInputError(f"bad Redis URL {redact(url)!r}: {why}")


class _ReplicaReads:
    """A sentinel master client whose single-key reads go to a replica; everything else (writes,
    pipelines, deletes) goes to the master."""

    def __init__(self, master: redis.Redis, replica: redis.Redis) -> None:
        self._master, self._replica = master, replica

    def get(self, name: str) -> bytes | None:
        return self._replica.get(name)

    def exists(self, *names: str) -> int:
        return self._replica.exists(*names)

    def scan_iter(self, **kwargs: Any) -> Any:
        return self._replica.scan_iter(**kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._master, name)


class _LazyCluster:
    """A ``RedisCluster`` made on first use, whose cluster-level failures are ``redis.ConnectionError``.

    ``RedisCluster()`` connects at once and raises ``RedisClusterException`` (not a ``RedisError``) when
    no node answers, as ``SlotNotCoveredError`` is raised for a slot no node serves: both would escape
    the tier's error handling. Made lazily, an engine starts with its cluster down, like one whose
    single server is down (and ``on_redis_error="miss"`` serves from the upper tiers meanwhile)."""

    def __init__(self, make: Callable[[], RedisCluster]) -> None:
        self._make, self._client = make, None

    def __getattr__(self, name: str) -> Any:
        if self._client is None:
            try:
                self._client = self._make()
            except RedisClusterException as exc:
                raise redis.ConnectionError(str(exc)) from exc
        found = getattr(self._client, name)
        return _converting(found) if callable(found) else found


def _converting(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except RedisClusterException as exc:
            raise redis.ConnectionError(f"{type(exc).__name__}: {exc}") from exc

    return call
