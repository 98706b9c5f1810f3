"""The wire format of a compiled chunk (msgpack metadata + raw KV parts; never pickle).

An entry is one metadata record and ``num_parts`` payload parts. The payload is K's bytes then V's
bytes, each cut into parts of at most ``part_bytes`` (Redis refuses values over 512 MiB, and a 4K-token
chunk of a 7B model is 512 MiB). Writers store the parts first and the metadata last, so a reader
never sees metadata whose parts were not all written.

Nothing read is trusted: the metadata is size-bounded before unpacking and validated field by field
against what this engine expects (format version, model fingerprint, cache id, dtype, shape); the
token ids must lie in the vocabulary and hash, with the options, to the cache id; every part's length
is checked before the payload is allocated; and the payload's checksum (xxh3-128) must match. Any
failure is a ``CorruptEntryError``, which the tiers turn into a logged miss (and drop).

With the fleet's store key (``pic.store.auth``) the record also carries two HMAC-SHA256 tags, ``payload_mac``
over the payload and ``mac`` over every other field, and a reader with the key refuses (``ForgedEntryError``) an
entry whose tags are missing or wrong before it trusts any of its fields' meaning. Without a key no tag is
written, and one that is there is not read: the record is byte for byte what versions before the key wrote.

Whose an entry is (``pic.namespaces``): a reader passes the namespaces it may read (``readable``: name -> salt),
and an entry is theirs when one of them reproduces its cache id. One that none reproduces may be another
tenant's, honest: ``NotReadable``, a plain miss that nobody logs above DEBUG, counts or deletes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import msgpack
import numpy as np
import torch
import xxhash
from pydantic import BaseModel, ConfigDict, ValidationError

from pic.config import CompileOptions
from pic.ids import KV_FORMAT_VERSION, chunk_id
from pic.kv import ChunkKV
from pic.namespaces import DEFAULT_NAME
from pic.store.auth import StoreKey

MAX_META_BYTES = 16 * 2**20  # a metadata record larger than this is refused unread (Redis and disk alike)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class CorruptEntryError(Exception):
    """A stored entry that is missing, damaged, foreign or of an unknown format."""


class ForgedEntryError(CorruptEntryError):
    """An entry that fails the store key's MAC: forged, altered, written with another fleet's key or without one."""


class NotReadable(Exception):
    """An entry that none of the reader's namespaces reproduces: perhaps another tenant's, and whole. A plain miss,
    never an error (not a ``CorruptEntryError``: nothing may drop it). ``meta``: its validated record (what a count
    of the tier's entries needs; never served)."""

    def __init__(self, cache_id: str, meta: Meta) -> None:
        super().__init__(f"entry {cache_id[:32]} is none of the reader's namespaces'")
        self.meta = meta


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
    bos_token_id: int | None = None  # a chunk compiled with ``add_bos`` starts with it (``None``: not checked)


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
    payload_mac: str | None = None  # with a store key only (``pic.store.auth``)
    mac: str | None = None

    @property
    def tensor_bytes(self) -> int:
        """Bytes of K (and of V)."""
        return int(np.prod(self.shape)) * _DTYPES[self.dtype].itemsize


def encode(chunk: ChunkKV, *, fingerprint: str, part_bytes: int, key: StoreKey | None = None) -> Encoded:
    """The wire form of ``chunk``: metadata and parts of at most ``part_bytes``; tagged when there is a ``key``."""
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
    if key is not None:
        mac = key.payload_hasher(chunk.cache_id)
        for part in parts:
            mac.update(part)
        meta["payload_mac"] = mac.hexdigest()
        meta["mac"] = key.meta_mac(_mac_body(meta))
    return Encoded(meta=msgpack.packb(meta), parts=parts)


def parse_meta(
    raw: bytes,
    *,
    cache_id: str,
    expected: Expected,
    readable: Mapping[str, bytes] | None = None,
    key: StoreKey | None = None,
) -> Meta:
    """Unpack and validate a metadata record for ``cache_id``; with a ``key``, verify its tag first.

    ``readable`` (namespace name -> salt): the entry must belong to one of those namespaces (``_whose``), and
    the returned record's ``options.namespace`` is the local name that reproduced its id (the entry's own label
    is tried first). ``None``: as before namespaces had salts: the id must be the unsalted one of the entry's
    own label, whatever that label is.

    Raises:
        ForgedEntryError: a ``key`` was given and the record's tag is missing or wrong.
        CorruptEntryError: oversized, not msgpack, malformed, or not this engine's chunk ``cache_id``.
        NotReadable: an intact entry that no namespace of ``readable`` reproduces (perhaps another tenant's).
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
    if key is not None:
        _check_mac(fields, meta, key)
    _check_meta(meta, cache_id, expected)
    return _whose(meta, cache_id, readable)


def _mac_body(record: Mapping[str, object]) -> list[object]:
    """What a record's ``mac`` covers: every other field as written (msgpack packs a tuple as it packs a list), in
    name order, the options' fields too, so the tag does not depend on the order a writer put them in."""
    canonical = lambda value: sorted(value.items()) if isinstance(value, Mapping) else value  # noqa: E731
    return sorted([name, canonical(value)] for name, value in record.items() if name != "mac")


def _check_mac(fields: Mapping[str, object], meta: Meta, key: StoreKey) -> None:
    """Raise ``ForgedEntryError`` unless the record (``fields``, validated as ``meta``) carries this key's tags."""
    if meta.mac is None or meta.payload_mac is None:
        raise ForgedEntryError("metadata carries no MAC (written without the store key)")
    if not key.same(meta.mac, key.meta_mac(_mac_body(fields))):
        raise ForgedEntryError("metadata fails the store key's MAC (forged, altered, or another fleet's key)")


def _check_meta(meta: Meta, cache_id: str, expected: Expected) -> None:
    if meta.format != KV_FORMAT_VERSION:
        raise CorruptEntryError(f"unknown format version {meta.format} (this build reads {KV_FORMAT_VERSION})")
    if meta.fingerprint != expected.fingerprint:
        raise CorruptEntryError(f"written by another model (fingerprint {meta.fingerprint[:12]})")
    if meta.cache_id != cache_id:
        raise CorruptEntryError(f"metadata of cache id {meta.cache_id[:32]} under {cache_id[:32]}")
    if not all(0 <= t < expected.vocab_size for t in meta.token_ids):
        raise CorruptEntryError(f"token ids outside the {expected.vocab_size}-token vocabulary")
    bos, first = expected.bos_token_id, meta.token_ids[0] if meta.token_ids else None
    if meta.options.add_bos and bos is not None and first != bos:
        raise CorruptEntryError(f"the chunk starts with token {first}, not the model's BOS {bos}")
    shape = (expected.num_layers, len(meta.token_ids), expected.num_kv_heads, expected.head_dim)
    if _DTYPES.get(meta.dtype) != expected.dtype or meta.shape != shape or not 0 < shape[1] <= expected.max_tokens:
        raise CorruptEntryError(f"dtype {meta.dtype} and shape {meta.shape} disagree with {expected.dtype} {shape}")
    if not 0 < meta.part_bytes <= 512 * 2**20 or meta.num_parts != 2 * -(-meta.tensor_bytes // meta.part_bytes):
        raise CorruptEntryError(f"{meta.num_parts} parts of {meta.part_bytes} bytes do not fit the shape")


def _whose(meta: Meta, cache_id: str, readable: Mapping[str, bytes] | None) -> Meta:
    """``meta`` labelled with the namespace of ``readable`` that reproduces ``cache_id`` (its own label first, then
    the others), or as it is when ``readable`` is ``None`` and its own label's unsalted id is ``cache_id``.

    The id hashes the tokens after the chunk's BOS. An entry labelled with the default namespace (``""``, which
    has no salt anywhere) that does not hash to its id is damaged, whoever reads it; any other entry may be a
    namespace's whose salt the reader lacks.

    Raises:
        CorruptEntryError: a default-namespace entry that is not ``cache_id``'s.
        NotReadable: any other entry that no namespace of ``readable`` reproduces.
    """
    content, label = meta.token_ids[int(meta.options.add_bos) :], meta.options.namespace
    own_id = lambda: chunk_id(meta.fingerprint, content, meta.options)  # noqa: E731
    if readable is None:
        if own_id() == cache_id:
            return meta
    else:
        names = [label] if label in readable else []
        for name in names + [n for n in readable if n != label]:
            options = meta.options.model_copy(update={"namespace": name})
            if chunk_id(meta.fingerprint, content, options, salt=readable[name]) == cache_id:
                return meta if name == label else meta.model_copy(update={"options": options})
    if label == DEFAULT_NAME and (readable is None or DEFAULT_NAME in readable or own_id() != cache_id):
        raise CorruptEntryError(f"metadata does not belong to cache id {cache_id[:32]}")
    raise NotReadable(cache_id, meta)


def part_sizes(meta: Meta) -> list[int]:
    """The exact length of every part, K's then V's."""
    full, last = divmod(meta.tensor_bytes, meta.part_bytes)
    one = [meta.part_bytes] * full + ([last] if last else [])
    return one + one


def decode(meta: Meta, parts: Iterable[bytes | None], *, pin: bool = False, key: StoreKey | None = None) -> ChunkKV:
    """The chunk of a validated ``meta`` from its ``parts`` (CPU tensors; page-locked if ``pin``).

    ``parts`` may be a generator: each part is checked, hashed (and, with a ``key``, tagged) and copied as it
    arrives, so only one part is held at a time. The payload's size is bounded by the validated shape.

    Raises:
        CorruptEntryError: a missing or wrong-sized part (checked before it is copied), too many or
            too few parts, a bad checksum; ``ForgedEntryError``: a payload that fails ``key``'s MAC.
    """
    sizes = part_sizes(meta)
    buffer = torch.empty(2 * meta.tensor_bytes, dtype=torch.uint8, pin_memory=pin)
    flat, offset, digests = buffer.numpy(), 0, _Digests(meta, key)
    for i, part in enumerate(parts):
        size = None if part is None else len(part)
        if i >= len(sizes) or size != sizes[i]:
            raise CorruptEntryError(f"part {i} has {size} bytes; expected {sizes[i] if i < len(sizes) else 'none'}")
        digests.update(part)
        flat[offset : offset + size] = np.frombuffer(part, dtype=np.uint8)
        offset += size
    if offset != buffer.numel():
        raise CorruptEntryError(f"parts hold {offset} of the {buffer.numel()} payload bytes")
    return _chunk(meta, buffer, digests)


def read_payload(
    meta: Meta, readinto: Callable[[memoryview], int], *, pin: bool = False, key: StoreKey | None = None
) -> ChunkKV:
    """The chunk of a validated ``meta`` read straight into its tensors by ``readinto`` (a file's: no
    intermediate copy), in ``part_bytes`` steps, hashing (and, with a ``key``, tagging) each step as it lands.

    Raises:
        CorruptEntryError: the source ends before the payload does, or a bad checksum; ``ForgedEntryError``: a
            payload that fails ``key``'s MAC.
    """
    buffer = torch.empty(2 * meta.tensor_bytes, dtype=torch.uint8, pin_memory=pin)
    view, digests = memoryview(buffer.numpy()), _Digests(meta, key)
    for start in range(0, len(view), meta.part_bytes):
        step = view[start : start + meta.part_bytes]
        got = 0
        while got < len(step):
            n = readinto(step[got:])
            if not n:
                raise CorruptEntryError(f"payload ends after {start + got} of its {len(view)} bytes")
            got += n
        digests.update(step)
    return _chunk(meta, buffer, digests)


class _Digests:
    """The payload's checksum and, with a key, its tag, fed the payload's bytes in order."""

    def __init__(self, meta: Meta, key: StoreKey | None) -> None:
        self._meta, self._key = meta, key
        self._checksum = xxhash.xxh3_128()
        self._mac = None if key is None else key.payload_hasher(meta.cache_id)

    def update(self, data: bytes | memoryview) -> None:
        self._checksum.update(data)
        if self._mac is not None:
            self._mac.update(data)

    def check(self) -> None:
        """Raises: ForgedEntryError: a bad tag (checked first, when keyed); CorruptEntryError: a bad checksum."""
        if self._mac is not None and not StoreKey.same(self._meta.payload_mac, self._mac.hexdigest()):
            raise ForgedEntryError("payload fails the store key's MAC (forged or altered KV)")
        if self._checksum.hexdigest() != self._meta.checksum:
            raise CorruptEntryError("payload checksum mismatch")


def _chunk(meta: Meta, buffer: torch.Tensor, digests: _Digests) -> ChunkKV:
    """The chunk over ``buffer`` (``[2 * tensor_bytes]`` uint8: K's bytes, then V's) once its digests match."""
    digests.check()
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
