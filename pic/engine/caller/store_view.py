"""``StoreView``: the chunk store for other threads. The device tier (the pool's resident chunks) is read on
the engine's thread; the lower tiers (CPU, disk, Redis) are called from the caller's own thread, so a slow store
delays only its caller, never the engine's steps."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from pic.engine.commands import Channel, DeviceOp, OnDevice
from pic.errors import InvalidInputError
from pic.kv import ChunkKV
from pic.namespaces import Access, Names, Namespace, access_of
from pic.store import TieredStore
from pic.store.description import ChunkDescription
from pic.store.lease import FleetLeases
from pic.store.tier import Extent, TierStats


class _DeviceOnCore:
    """The device tier, every call run on the engine's thread (the ``Tier`` protocol)."""

    name = "device"
    last_error = None

    def __init__(self, channel: Channel, kv_device: torch.device) -> None:
        self._channel, self.kv_device = channel, kv_device

    def _run(self, op: DeviceOp, cache_id: str = "", readable: Mapping[str, bytes] | None = None) -> Any:
        return self._channel.call(lambda reply: OnDevice(op, reply, cache_id, readable))

    def contains(self, cache_id: str) -> bool:
        return self._run(DeviceOp.CONTAINS, cache_id)

    def extent(self, cache_id: str, *, readable: Mapping[str, bytes] | None = None) -> Extent | None:
        return self._run(DeviceOp.EXTENT, cache_id, readable)

    def peek(self, cache_id: str, *, readable: Mapping[str, bytes] | None = None) -> ChunkKV | None:
        return self._run(DeviceOp.PEEK, cache_id, readable)

    def delete(self, cache_id: str) -> bool:
        """Drop the chunk from the pool and the engine's memory of its tokens (an expired id is unknown)."""
        return self._run(DeviceOp.FORGET, cache_id)

    def pin(self, cache_id: str) -> bool:
        return self._run(DeviceOp.PIN, cache_id)

    def unpin(self, cache_id: str) -> None:
        self._run(DeviceOp.UNPIN, cache_id)

    def ids(self) -> list[str]:
        return self._run(DeviceOp.IDS)

    def stats(self) -> TierStats:
        return self._run(DeviceOp.STATS)

    def leases(self, lease_s: float) -> FleetLeases | None:
        return None


class StoreView:
    """Reads and operations on the engine's ``TieredStore`` (device, CPU, disk and Redis tiers), from any thread.

    ``describe``, ``get`` and ``expire`` take ``namespace=`` (as ``compile`` and ``link`` do; ``None``: the default
    namespace): a chunk of another namespace is answered as an id no tier holds. ``expire`` deletes only from the
    caller's own namespace (a shared namespace's readers cannot). ``ids``, ``lookup``, ``contains``, ``pin`` and
    ``stats`` are the operator's: every namespace's chunks.

    Attributes:
        fleet: compile-once leases in the Redis tier (``None`` without one); safe from any thread.
    """

    def __init__(self, channel: Channel, store: TieredStore, *, names: Names | None = None) -> None:
        self._store = store.view(_DeviceOnCore(channel, store.device.kv_device))
        self._names = Names() if names is None else names
        self.fleet: FleetLeases | None = store.fleet

    def _id(self, cache_id: object) -> str:
        """Raises: InvalidInputError: ``cache_id`` is not a string."""
        if not isinstance(cache_id, str):
            raise InvalidInputError(f"cache id {cache_id!r:.80} is not a string (an id compile returned)")
        return cache_id

    def _access(self, namespace: str | Namespace | Access | None) -> Access:
        """Raises: InvalidInputError: a bad namespace, or a name used in this engine with another salt."""
        return self._names.check(access_of(namespace))

    def lookup(self, cache_id: str) -> tuple[str, ...]:
        """Names of the tiers that hold ``cache_id``, fastest first (as ``CompileReport.tiers`` holds them)."""
        return self._store.lookup(self._id(cache_id))

    def describe(self, cache_id: str, *, namespace: str | Namespace | Access | None = None) -> ChunkDescription:
        """What the store knows of a chunk of ``namespace`` without reading its KV (tiers, tokens, bytes).

        Raises:
            UnknownCacheIdError: no tier holds it in the namespaces ``namespace`` may read.
        """
        return self._store.describe(self._id(cache_id), readable=self._access(namespace).readable)

    def contains(self, cache_id: str) -> bool:
        return self._store.contains(self._id(cache_id))

    def get(self, cache_id: str, *, namespace: str | Namespace | Access | None = None) -> ChunkKV | None:
        """The chunk's KV from the fastest tier that holds it in the namespaces ``namespace`` may read (a copy), on
        the engine's device; ``None`` when no tier does."""
        return self._store.get(self._id(cache_id), readable=self._access(namespace).readable)

    def pin(self, cache_id: str) -> None:
        """Never evict ``cache_id`` from the pool and the CPU tier (also once promoted into them).

        Raises:
            UnknownCacheIdError: no tier holds it.
        """
        self._store.pin(self._id(cache_id))

    def unpin(self, cache_id: str) -> None:
        self._store.unpin(self._id(cache_id))

    def expire(self, cache_id: str, *, namespace: str | Namespace | Access | None = None) -> bool:
        """Remove ``cache_id`` from every tier, if it is a chunk of ``namespace``'s own namespace; ``True`` if any
        held it (``False`` for a chunk of another namespace, as for an id nobody compiled). Live requests that link
        it keep its blocks until they are released."""
        own = self._access(namespace).own
        return self._store.expire(self._id(cache_id), readable={own.name: own.salt})

    def ids(self) -> list[str]:
        """Every cache id in any tier."""
        return self._store.ids()

    def stats(self) -> list[TierStats]:
        """One snapshot per tier, fastest first."""
        return self._store.stats()
