"""Redis clients from one URL: a single server, a Redis Cluster or a Sentinel-managed master.

- ``redis://[[user]:password@]host:port/db``, ``rediss://...``, ``unix:///path.sock?db=0&password=...``:
  one server (``redis.Redis.from_url``).
- ``redis-cluster://[[user]:password@]host:port[,host:port...]``: a Redis Cluster (``RedisCluster``); the
  listed nodes are only where discovery starts, the client then follows the cluster's slot map.
- ``redis-sentinel://[[user]:password@]host:port[,host:port...]/service_name``: the master that the
  listed sentinels name for ``service_name``; after a failover the client finds the new master by itself.
  The password is sent to the sentinels and to the data nodes alike.

A password is URL-quoted (``quote(pw, safe='')``), so it may hold ``:``, ``/`` and ``@``. Parsing and
masking live in ``pic.redis_url`` (no redis import there).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import redis
from redis.cluster import ClusterNode, LoadBalancingStrategy, RedisCluster
from redis.exceptions import RedisClusterException
from redis.sentinel import Sentinel

from pic.redis_url import CLUSTER, SENTINEL, parse
from pic.store.breaker import Breaker, BreakerOpenError


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
    parsed = parse(url)
    auth = {"username": parsed.user, "password": parsed.password}
    if scheme == CLUSTER:
        startup = [ClusterNode(host, port) for host, port in parsed.nodes]
        strategy = LoadBalancingStrategy.ROUND_ROBIN if read_from_replicas else None
        return _LazyCluster(
            lambda: RedisCluster(startup_nodes=startup, load_balancing_strategy=strategy, **auth, **timeouts)
        )
    sentinel_kwargs = {**auth, **timeouts} if parsed.password is not None else dict(timeouts)
    sentinel = Sentinel(parsed.nodes, sentinel_kwargs=sentinel_kwargs, **auth, **timeouts)
    master = sentinel.master_for(parsed.service)
    return _ReplicaReads(master, sentinel.slave_for(parsed.service)) if read_from_replicas else master


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


# What says the server cannot be reached (as opposed to an answer such as an error reply): these open the breaker.
UNREACHABLE = (redis.ConnectionError, redis.TimeoutError)


def unreachable(exc: BaseException) -> bool:
    return isinstance(exc, UNREACHABLE)


class NotTried(redis.ConnectionError):
    """A command the breaker refused without sending it (``BreakerOpenError`` as redis-py's error type)."""

    not_tried = True


class BreakingClient:
    """A redis-py client (any of ``connect``'s) whose every round trip goes through a ``Breaker``: once a command
    times out or cannot connect, the commands that follow fail at once (``redis.ConnectionError`` naming the
    first failure) until the breaker lets a probe through. So the tier, the fleet's leases and the monitoring
    that share the client all stop waiting on a server that stopped answering.

    Commands buffered in a pipeline do no I/O; its ``execute`` does, and goes through the breaker. ``scan_iter``
    is checked when iterated."""

    def __init__(self, client: Any, breaker: Breaker) -> None:
        self._client, self.breaker = client, breaker

    def _run(self, fn: Callable[[], Any]) -> Any:
        try:
            return self.breaker.call(fn, unreachable=unreachable)
        except BreakerOpenError as exc:
            raise NotTried(str(exc)) from None

    def pipeline(self, *args: Any, **kwargs: Any) -> _BreakingPipeline:
        return _BreakingPipeline(self._client.pipeline(*args, **kwargs), self)

    def scan_iter(self, *args: Any, **kwargs: Any) -> Any:
        return self._run(lambda: list(self._client.scan_iter(*args, **kwargs)))

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._client, name)
        if not callable(found):
            return found

        @functools.wraps(found)
        def call(*args: Any, **kwargs: Any) -> Any:
            return self._run(lambda: found(*args, **kwargs))

        return call


class _BreakingPipeline:
    """A pipeline whose ``execute`` goes through its client's breaker (buffering a command is no I/O)."""

    def __init__(self, pipe: Any, client: BreakingClient) -> None:
        self._pipe, self._client = pipe, client

    def execute(self, *args: Any, **kwargs: Any) -> Any:
        return self._client._run(lambda: self._pipe.execute(*args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)
