"""Whose a chunk is: namespaces, their secret salts, and what one caller may read.

Every chunk lives in one namespace. Its cache id hashes the namespace's name and secret salt with its tokens
(``pic.ids.chunk_id``), so the same document compiled in two namespaces gets two ids, and nobody without the salt
can compute an id of another namespace's chunk: another tenant's compile is always a miss for you, so neither an
answer nor a timing can tell you what it compiled (vLLM's ``cache_salt``, PR #17045). The engine checks every read
(a link, a description, a delete) against the caller's ``Access``: an id outside it is answered as an id nobody
compiled. Sharing is opt-in: a caller may read other, named namespaces (a public corpus an operator fills).

The default namespace (``""``, no salt) is the one of an engine without tenants: its ids are those of the versions
before namespaces existed, and anyone who knows the model can compute them.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import re
import threading
import types
from collections.abc import Mapping
from dataclasses import dataclass, field

from pic.errors import InvalidInputError

DEFAULT_NAME = ""
NAME_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
_NAME = re.compile(NAME_PATTERN)
MAX_SALT_BYTES = 1024
# What a namespace's salt is derived from a secret with (``Namespace.derived``): bump to change every derived id.
_DERIVATION = b"pic namespace salt v1\0"


@dataclass(frozen=True)
class Namespace:
    """A namespace: ``name`` (what quotas, ownership checks and logs use; not secret) and ``salt`` (secret bytes that
    every cache id of the namespace hashes; ``b""``: ids anyone who knows the model and the text can compute).

    The salt never appears in ``repr`` or in any stored entry: only the ids it made do.

    Raises:
        InvalidInputError: a name that is not 1-64 of ``A-Z a-z 0-9 _ . -`` (``""`` is the default namespace, which
            has no salt), a salt that is not bytes or is longer than 1 KiB.
    """

    name: str
    salt: bytes = field(default=b"", repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not (self.name == DEFAULT_NAME or _NAME.match(self.name)):
            raise InvalidInputError(
                f"namespace name {self.name!r:.80} is not 1 to 64 of the characters A-Z a-z 0-9 _ . - "
                "(the default namespace is '')"
            )
        if not isinstance(self.salt, bytes) or len(self.salt) > MAX_SALT_BYTES:
            raise InvalidInputError(f"the salt of namespace {self.name!r} is not bytes of at most {MAX_SALT_BYTES}")
        if self.name == DEFAULT_NAME and self.salt:
            raise InvalidInputError("the default namespace ('') has no salt; name the namespace to salt it")

    @classmethod
    def derived(cls, name: str, secret: str | bytes) -> Namespace:
        """The namespace ``name`` with a salt derived from ``secret`` (HMAC-SHA256): every server given the same
        secret derives the same salt, so a fleet agrees on the ids without the salt itself being configured."""
        key = secret.encode() if isinstance(secret, str) else secret
        if not key:
            raise InvalidInputError(f"namespace {name!r}: an empty secret derives no salt")
        return cls(name, hmac.new(key, _DERIVATION + name.encode(), hashlib.sha256).digest())

    @property
    def is_default(self) -> bool:
        return self.name == DEFAULT_NAME


DEFAULT = Namespace(DEFAULT_NAME)


@dataclass(frozen=True)
class Access:
    """What one caller may do with chunks: compile into ``own`` and delete from it; link and describe the chunks of
    ``own`` and of ``reads`` (shared namespaces, read only).

    Raises:
        InvalidInputError: ``reads`` naming ``own`` or one namespace twice, or not ``Namespace`` objects.
    """

    own: Namespace = DEFAULT
    reads: tuple[Namespace, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.own, Namespace) or not all(isinstance(n, Namespace) for n in self.reads):
            raise InvalidInputError(f"Access takes Namespace objects, not {self.own!r:.80} / {self.reads!r:.80}")
        names = [self.own.name, *(n.name for n in self.reads)]
        if len(set(names)) != len(names):
            raise InvalidInputError(f"namespaces {names} name one namespace twice")

    @functools.cached_property
    def readable(self) -> Mapping[str, bytes]:
        """Namespace name -> salt, for every namespace this caller may read (its own first); made once (a link asks
        for each of its chunks)."""
        return types.MappingProxyType({n.name: n.salt for n in (self.own, *self.reads)})

    def may_read(self, namespace: str) -> bool:
        return namespace in self.readable



OPEN = Access()  # the caller of an engine without tenants: the default namespace, nothing else


def access_of(value: str | Namespace | Access | None) -> Access:
    """The ``Access`` a ``namespace=`` argument stands for: ``None`` the default namespace; a name, that namespace
    without a salt (its ids computable by anyone who knows the text: a salt keeps them secret); a ``Namespace``
    alone; an ``Access`` as it is.

    Raises:
        InvalidInputError: anything else, or a bad name.
    """
    if value is None:
        return OPEN
    if isinstance(value, Access):
        return value
    if isinstance(value, Namespace):
        return Access(own=value)
    if isinstance(value, str):
        return Access(own=Namespace(value))
    raise InvalidInputError(f"namespace is {value!r:.80}; expected a name, a pic.Namespace or a pic.Access")


class Names:
    """One engine's rule that a name stands for one namespace: the salt each name was first used with (its digest),
    so that a caller naming ``"a"`` without ``"a"``'s salt is refused rather than reading ``"a"``'s resident chunks
    (the engine checks resident chunks by name; the shared tiers by salt). Thread-safe: callers' threads share it."""

    def __init__(self) -> None:
        self._digests: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def check(self, access: Access) -> Access:
        """``access``, once every namespace in it has the salt its name had before in this engine.

        Raises:
            InvalidInputError: a name used before with another salt (named; no salt shown).
        """
        with self._lock:
            for namespace in (access.own, *access.reads):
                digest = hashlib.sha256(namespace.salt).digest()
                known = self._digests.setdefault(namespace.name, digest)
                if not hmac.compare_digest(known, digest):
                    raise InvalidInputError(
                        f"namespace {namespace.name!r} was used in this engine with another salt: a name stands for "
                        "one namespace (give each namespace its own name)"
                    )
        return access
