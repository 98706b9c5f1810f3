"""What the store says of one chunk without reading its KV (``GET /v1/chunks/{id}`` serves it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChunkDescription:
    """A chunk as the store's metadata describes it.

    Attributes:
        cache_id: its content address.
        tiers: names of the tiers holding it, fastest first (``"device"``, ``"cpu"``, ``"disk"``, ``"redis"``).
        num_tokens: tokens it contributes to a linked prompt.
        num_bytes: bytes of its K and V together (in each tier that holds it).
        token_ids: those tokens (what a prompt that links the chunk holds: ``pic.vllm.client.link_prompt``).
        namespace: the namespace it belongs to, by the reader's name for it (``""``: the default one).
    """

    cache_id: str
    tiers: tuple[str, ...]
    num_tokens: int
    num_bytes: int
    token_ids: tuple[int, ...] = ()
    namespace: str = ""
