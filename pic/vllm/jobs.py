"""What the scheduler side hands the worker side each step (vLLM ships it inside ``SchedulerOutput``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from pic.config import CompileOptions
from pic.namespaces import DEFAULT, Namespace
from pic.vllm.plan import LoadSpan


def slots_of(block_ids: list[int], block_size: int, start: int, num_tokens: int) -> list[int]:
    """vLLM cache slots of prompt positions ``[start, start + num_tokens)`` for a request holding ``block_ids``."""
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, start + num_tokens)]


@dataclass(frozen=True)
class LoadJob:
    """Write ``segment``'s stored KV, rotated to its positions, into ``slots`` (one per token); the chunk is read as
    ``namespace`` (the request's ``cache_salt``: ``pic.vllm.tenants``) reads it."""

    req_id: str
    segment: LoadSpan
    slots: list[int]
    namespace: Namespace = DEFAULT


@dataclass(frozen=True)
class SaveJob:
    """Read prompt positions ``0 .. len(token_ids) - 1`` from ``slots`` after this step's forward and store
    them, un-rotated, as chunk ``cache_id`` (its content is ``token_ids[num_lead:]``, compiled with ``options``, whose
    ``namespace`` labels it)."""

    req_id: str
    cache_id: str
    token_ids: list[int]
    slots: list[int]
    options: CompileOptions


@dataclass
class PicConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
