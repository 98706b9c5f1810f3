"""The wire format of a compiled chunk (msgpack metadata + raw KV parts; never pickle).

An entry is one metadata record and ``num_parts`` payload parts. The payload is K's bytes then V's
bytes, each cut into parts of at most ``part_bytes`` (Redis refuses values over 512 MiB, and a 4K-token
chunk of a 7B model is 512 MiB). Writers store the parts first and the metadata last, so a reader
never sees metadata whose parts were not all written.

Nothing read is trusted: the metadata is size-bounded before unpacking and validated field by field
against what this engine expects (format version, model fingerprint, cache id, dtype, shape); the
token ids must lie in the vocabulary and hash, with the options, to the cache id; every part's length
is checked before the payload is allocated; and the payload's checksum (xxh3-128) must match. Any
failure is a ``CorruptEntryError``, which the Redis tier turns into a logged miss.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import msgpack
import numpy as np
import torch
import xxhash
from pydantic import BaseModel, ConfigDict, ValidationError

from pic.config import CompileOptions
from pic.ids import KV_FORMAT_VERSION, chunk_id
from pic.kv import ChunkKV

MAX_META_BYTES = 16 * 2**20  # a metadata record larger than this is refused unread (Redis and disk alike)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class CorruptEntryError(Exception):
    """A stored entry that is missing, damaged, foreign or of an unknown format."""


@dataclass(frozen=True)
class Expected:
    """What this engine's chunks look like; an entry that disagrees is refused."""

    fingerprint: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    max_tokens: int
    vocab_size: int


@dataclass(frozen=True)
class Encoded:
    """A chunk ready to store: ``meta`` (msgpack) and the payload ``parts`` (views, no copies)."""

    meta: bytes
    parts: list[memoryview]


class Meta(BaseModel):
    """The metadata record, validated strictly (no coercion)."""

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")
    format: int
    fingerprint: str
    cache_id: str
    dtype: str
    shape: tuple[int, int, int, int]
    options: CompileOptions
    token_ids: tuple[int, ...]
    checksum: str
    part_bytes: int
    num_parts: int

    @property
    def tensor_bytes(self) -> int:
        """Bytes of K (and of V)."""
        return int(np.prod(self.shape)) * _DTYPES[self.dtype].itemsize


def encode(chunk: ChunkKV, *, fingerprint: str, part_bytes: int) -> Encoded:
    """The wire form of ``chunk``: metadata and parts of at most ``part_bytes``."""
    k, v = (t.detach().contiguous().cpu().view(torch.uint8).flatten().numpy() for t in (chunk.k, chunk.v))
    parts = [*_cut(memoryview(k), part_bytes), *_cut(memoryview(v), part_bytes)]
    meta = {
        "format": KV_FORMAT_VERSION,
        "fingerprint": fingerprint,
        "cache_id": chunk.cache_id,
        "dtype": str(chunk.k.dtype).removeprefix("torch."),
        "shape": list(chunk.k.shape),
        "options": chunk.options.model_dump(),
        "token_ids": chunk.token_ids.tolist(),
        "checksum": _checksum(parts),
        "part_bytes": part_bytes,
        "num_parts": len(parts),
    }
    return Encoded(meta=msgpack.packb(meta), parts=parts)


def parse_meta(raw: bytes, *, cache_id: str, expected: Expected) -> Meta:
    """Unpack and validate a metadata record for ``cache_id``.

    Raises:
        CorruptEntryError: oversized, not msgpack, malformed, or not this engine's chunk ``cache_id``.
    """
    if len(raw) > MAX_META_BYTES:
        raise CorruptEntryError(f"metadata of {len(raw)} bytes is larger than {MAX_META_BYTES}")
    limit = expected.max_tokens + 8
    try:
        fields = msgpack.unpackb(
            raw,
            raw=False,
            use_list=False,
            max_str_len=1024,
            max_bin_len=0,
            max_ext_len=0,
            max_array_len=limit,
            max_map_len=64,
        )
        meta = Meta.model_validate(fields)
    except ValidationError as exc:
        raise CorruptEntryError(f"malformed metadata: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}") from None
    except Exception as exc:  # msgpack raises many types on garbage; none of them may escape
        raise CorruptEntryError(f"metadata is not msgpack: {type(exc).__name__}") from None
    _check_meta(meta, cache_id, expected)
    return meta


def _check_meta(meta: Meta, cache_id: str, expected: Expected) -> None:
    if meta.format != KV_FORMAT_VERSION:
        raise CorruptEntryError(f"unknown format version {meta.format} (this build reads {KV_FORMAT_VERSION})")
    if meta.fingerprint != expected.fingerprint:
        raise CorruptEntryError(f"written by another model (fingerprint {meta.fingerprint[:12]})")
    if not all(0 <= t < expected.vocab_size for t in meta.token_ids):
        raise CorruptEntryError(f"token ids outside the {expected.vocab_size}-token vocabulary")
    content = meta.token_ids[int(meta.options.add_bos) :]  # the id hashes the tokens after the chunk's BOS
    if meta.cache_id != cache_id or chunk_id(meta.fingerprint, content, meta.options) != cache_id:
        raise CorruptEntryError(f"metadata does not belong to cache id {cache_id}")
    shape = (expected.num_layers, len(meta.token_ids), expected.num_kv_heads, expected.head_dim)
    if _DTYPES.get(meta.dtype) != expected.dtype or meta.shape != shape or not 0 < shape[1] <= expected.max_tokens:
        raise CorruptEntryError(f"dtype {meta.dtype} and shape {meta.shape} disagree with {expected.dtype} {shape}")
    if not 0 < meta.part_bytes <= 512 * 2**20 or meta.num_parts != 2 * -(-meta.tensor_bytes // meta.part_bytes):
        raise CorruptEntryError(f"{meta.num_parts} parts of {meta.part_bytes} bytes do not fit the shape")


def part_sizes(meta: Meta) -> list[int]:
    """The exact length of every part, K's then V's."""
    full, last = divmod(meta.tensor_bytes, meta.part_bytes)
    one = [meta.part_bytes] * full + ([last] if last else [])
    return one + one


def decode(meta: Meta, parts: Iterable[bytes | None], *, pin: bool = False) -> ChunkKV:
    """The chunk of a validated ``meta`` from its ``parts`` (CPU tensors; page-locked if ``pin``).

    ``parts`` may be a generator: each part is checked, hashed and copied as it arrives, so only one
    part is held at a time. The payload's size is bounded by the validated shape.

    Raises:
        CorruptEntryError: a missing or wrong-sized part (checked before it is copied), too many or
            too few parts, a bad checksum.
    """
    sizes = part_sizes(meta)
    buffer = torch.empty(2 * meta.tensor_bytes, dtype=torch.uint8, pin_memory=pin)
    flat, offset, h = buffer.numpy(), 0, xxhash.xxh3_128()
    for i, part in enumerate(parts):
        size = None if part is None else len(part)
        if i >= len(sizes) or size != sizes[i]:
            raise CorruptEntryError(f"part {i} has {size} bytes; expected {sizes[i] if i < len(sizes) else 'none'}")
        h.update(part)
        flat[offset : offset + size] = np.frombuffer(part, dtype=np.uint8)
        offset += size
    if offset != buffer.numel():
        raise CorruptEntryError(f"parts hold {offset} of the {buffer.numel()} payload bytes")
    return _chunk(meta, buffer, h.hexdigest())


def read_payload(meta: Meta, readinto: Callable[[memoryview], int], *, pin: bool = False) -> ChunkKV:
    """The chunk of a validated ``meta`` read straight into its tensors by ``readinto`` (a file's: no
    intermediate copy), in ``part_bytes`` steps, hashing each step as it lands.

    Raises:
        CorruptEntryError: the source ends before the payload does, or a bad checksum.
    """
    buffer = torch.empty(2 * meta.tensor_bytes, dtype=torch.uint8, pin_memory=pin)
    view, h = memoryview(buffer.numpy()), xxhash.xxh3_128()
    for start in range(0, len(view), meta.part_bytes):
        step = view[start : start + meta.part_bytes]
        got = 0
        while got < len(step):
            n = readinto(step[got:])
            if not n:
                raise CorruptEntryError(f"payload ends after {start + got} of its {len(view)} bytes")
            got += n
        h.update(step)
    return _chunk(meta, buffer, h.hexdigest())


def _chunk(meta: Meta, buffer: torch.Tensor, checksum: str) -> ChunkKV:
    """The chunk over ``buffer`` (``[2 * tensor_bytes]`` uint8: K's bytes, then V's) once its checksum matches."""
    if checksum != meta.checksum:
        raise CorruptEntryError("payload checksum mismatch")
    dtype, half = _DTYPES[meta.dtype], meta.tensor_bytes
    k, v = (buffer[i * half : (i + 1) * half].view(dtype).view(meta.shape) for i in (0, 1))
    token_ids = torch.tensor(meta.token_ids, dtype=torch.long)
    return ChunkKV(cache_id=meta.cache_id, token_ids=token_ids, k=k, v=v, options=meta.options)


def _cut(data: memoryview, size: int) -> list[memoryview]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def _checksum(parts: Sequence[bytes | memoryview]) -> str:
    h = xxhash.xxh3_128()
    for part in parts:
        h.update(part)
    return h.hexdigest()
