"""``StoreView``: the chunk store for other threads; every call runs on the engine's thread."""

from __future__ import annotations

from pic.engine.commands import Query
from pic.engine.owner import OwnerThread
from pic.errors import InvalidInputError
from pic.kv import ChunkKV
from pic.store.description import ChunkDescription
from pic.store.lease import FleetLeases
from pic.store.tier import TierStats


class StoreView:
    """Reads and operations on the engine's ``TieredStore`` (device, CPU and Redis tiers), between steps.

    Attributes:
        fleet: compile-once leases in the Redis tier (``None`` without one); safe from any thread.
    """

    def __init__(self, owner: OwnerThread, *, fleet: FleetLeases | None) -> None:
        self._owner, self.fleet = owner, fleet

    def _ask(self, query: Query, cache_id: object) -> object:
        """Raises: InvalidInputError: ``cache_id`` is not a string."""
        if not isinstance(cache_id, str):
            raise InvalidInputError(f"cache id {cache_id!r:.80} is not a string (an id compile returned)")
        return self._owner.ask(query, cache_id)

    def lookup(self, cache_id: str) -> list[str]:
        """Names of the tiers that hold ``cache_id``, fastest first."""
        return self._ask(Query.LOOKUP, cache_id)

    def describe(self, cache_id: str) -> ChunkDescription:
        """What the store knows of a chunk without reading its KV (tiers, tokens, bytes).

        Raises:
            UnknownCacheIdError: no tier holds it.
        """
        return self._ask(Query.DESCRIBE, cache_id)

    def contains(self, cache_id: str) -> bool:
        return self._ask(Query.CONTAINS, cache_id)

    def get(self, cache_id: str) -> ChunkKV | None:
        """The chunk's KV from the fastest tier that holds it (a copy), on the engine's device; ``None``
        when no tier does."""
        return self._ask(Query.GET, cache_id)

    def pin(self, cache_id: str) -> None:
        """Never evict ``cache_id`` from the pool and the CPU tier (also once promoted into them).

        Raises:
            UnknownCacheIdError: no tier holds it.
        """
        self._ask(Query.PIN, cache_id)

    def unpin(self, cache_id: str) -> None:
        self._ask(Query.UNPIN, cache_id)

    def expire(self, cache_id: str) -> bool:
        """Remove ``cache_id`` from every tier; ``True`` if any held it. Live requests that link it keep
        its blocks until they are released."""
        return self._ask(Query.EXPIRE, cache_id)

    def ids(self) -> list[str]:
        """Every cache id in any tier."""
        return self._owner.ask(Query.STORE_IDS)

    def stats(self) -> list[TierStats]:
        """One snapshot per tier, fastest first."""
        return self._owner.ask(Query.STORE_STATS)
