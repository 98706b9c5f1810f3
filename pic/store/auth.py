"""The fleet's store key: a keyed MAC on every chunk written to a shared tier (Redis, the disk folder).

Without it a shared tier is trusted as it is: its checks (``pic.store.serde``) find damage, not forgery, since
anyone who can write Redis or the folder can recompute an unkeyed checksum and put another document's KV under
an id. With ``StoreConfig.store_key`` every entry carries two HMAC-SHA256 tags, both by this key:

- ``payload_mac`` over the KV payload (K's bytes then V's, every part in order), bound to the entry's cache id;
- ``mac`` over the metadata record's every field (format, fingerprint, cache id, dtype, shape, compile options
  with their context and namespace label, token ids with the BOS, checksum, part layout) and ``payload_mac``.

So a metadata-only read (``extent``: ``GET /v1/chunks/{id}``) verifies ``mac`` alone, and a full read verifies
``payload_mac`` too, over the parts as they arrive, before the chunk is returned. Tags are compared in constant time.

Why HMAC-SHA256 rather than keyed BLAKE2b: both are fine MACs; HMAC-SHA256 takes a key of any length (BLAKE2b at
most 64 bytes), is in every FIPS list, and on CPUs with SHA extensions (x86 since Zen / Ice Lake, ARMv8) OpenSSL
runs it faster than CPython's BLAKE2b (measured in docs/store.md).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

import msgpack

from pic.errors import InvalidInputError

MIN_KEY_BYTES = 16
# Domain separation: a tag of one kind is never a valid tag of the other.
_META = b"pic store meta v1\0"
_PAYLOAD = b"pic store payload v1\0"


class StoreKey:
    """A store key (secret bytes, never shown in ``repr`` or any message) and the tags it makes.

    Raises:
        InvalidInputError: a key that is not bytes of at least ``MIN_KEY_BYTES``.
    """

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, bytes) or len(key) < MIN_KEY_BYTES:
            raise InvalidInputError(f"a store key is at least {MIN_KEY_BYTES} bytes (the key is not shown)")
        self._key = key

    def __repr__(self) -> str:
        return "StoreKey(<secret>)"

    def meta_mac(self, fields: Iterable[object]) -> str:
        """The tag of a metadata record's ``fields`` (plain msgpack-able values, in a fixed order)."""
        body = msgpack.packb(list(fields))
        return hmac.new(self._key, _META + body, hashlib.sha256).hexdigest()

    def payload_hasher(self, cache_id: str) -> hmac.HMAC:
        """A running tag of ``cache_id``'s payload: ``update`` it with every part in order, then ``hexdigest``."""
        return hmac.new(self._key, _PAYLOAD + cache_id.encode() + b"\0", hashlib.sha256)

    @staticmethod
    def same(tag: str | None, expected: str) -> bool:
        """Whether ``tag`` is ``expected`` (constant time; a missing tag never is)."""
        return isinstance(tag, str) and hmac.compare_digest(tag.encode(), expected.encode())


def store_key(key: bytes | None) -> StoreKey | None:
    """``StoreConfig.store_key`` as a ``StoreKey`` (``None``: no key, the shared tiers trusted as they are)."""
    return None if key is None else StoreKey(key)
