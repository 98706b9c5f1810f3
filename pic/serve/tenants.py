"""Tenants of ``pic serve``: who may call the server, and whose chunks each caller's calls are.

``pic serve --tenants FILE`` reads a TOML file with one table per tenant::

    [tenants.alice]
    key_file = "/etc/pic/alice.key"   # or key_env = "ALICE_KEY", or key = "..." (a key in the file: 0600 it)
    reads = ["corpus"]                # shared namespaces it may link and describe (other tenants', read only)
    kv_share = 0.25                   # the share of the KV pool its chunks keep against other tenants
    store_share = 0.25                # the same in the CPU tier
    max_num_seqs = 16                 # its requests running at once
    requests_per_s = 20               # its request rate (a token bucket: ``burst`` requests at once, default 2 s)

    [tenants.corpus]                  # an operator's tenant: it fills the shared namespace "corpus"
    key_env = "PIC_CORPUS_KEY"

A tenant's namespace is set by the server from the key the request carries, never from the request: the namespace is
the tenant's name, and its secret salt (every cache id of its chunks hashes it) is ``salt_file`` / ``salt_env`` /
``salt`` when given, else derived from its key (``Namespace.derived``): then a new key gives the tenant new ids (its
chunks compile again), and every server of a fleet derives the same ids from the same file. A tenant with the same
salt as a vLLM ``cache_salt`` shares that namespace's ids with vLLM (docs/vllm.md).

One ``--api-key`` (or ``--api-key-file``, ``PIC_API_KEY``) is one tenant in the default namespace: the ids, and
everything else, as without tenants.
"""

from __future__ import annotations

import hashlib
import math
import os
import stat
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pic.config import Quota
from pic.errors import InvalidInputError
from pic.namespaces import DEFAULT, NAME_PATTERN, Access, Namespace
from pic.secrets import read_secret_file

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

MAX_FILE_BYTES = 1 << 20  # a tenants file is a few KB; a megabyte is surely the wrong file
_TENANT_FIELDS = frozenset(
    {"key", "key_file", "key_env", "salt", "salt_file", "salt_env", "reads", "kv_share", "store_share",
     "max_num_seqs", "requests_per_s", "burst"}
)  # fmt: skip
_MIN_KEY_CHARS = 16


@dataclass
class RateLimit:
    """A token bucket: ``burst`` requests at once, refilled at ``per_s`` a second. Thread-safe (the event loop and
    tests call it); the clock is monotonic."""

    per_s: float
    burst: int
    _tokens: float = field(init=False)
    _at: float = field(init=False)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._tokens, self._at = float(self.burst), time.monotonic()

    def take(self, now: float | None = None) -> float:
        """Take one request's token: ``0.0`` when there was one, else the seconds until there will be (refused)."""
        with self._lock:
            now = time.monotonic() if now is None else now
            self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.per_s)
            self._at = now
            if self._tokens >= 1:
                self._tokens -= 1
                return 0.0
            return (1 - self._tokens) / self.per_s


@dataclass(frozen=True)
class Tenant:
    """One caller of the server: its name, its access (its own namespace and the shared ones it reads), its quota
    in the engine, and its rate limit (``None``: none)."""

    name: str
    access: Access
    quota: Quota | None = None
    rate: RateLimit | None = field(default=None, compare=False)

    @property
    def namespace(self) -> str:
        return self.access.own.name



@dataclass(frozen=True)
class Tenants:
    """The server's tenants, found by the SHA-256 of their keys (a lookup that compares no key byte by byte, so its
    time says nothing about any key); ``open``: no key needed (a server without keys: one tenant, the default
    namespace)."""

    by_key_digest: Mapping[bytes, Tenant]
    open: Tenant | None = None

    def find(self, key: bytes | None) -> Tenant | None:
        """The tenant whose key ``key`` is (the bearer token as sent); ``None``: no such tenant."""
        if self.open is not None:
            return self.open
        if not key:
            return None
        return self.by_key_digest.get(hashlib.sha256(key).digest())

    @property
    def quotas(self) -> dict[str, Quota]:
        """The engine's ``PICConfig.quotas``: namespace -> quota, of the tenants that have one."""
        tenants = [*self.by_key_digest.values(), *([self.open] if self.open else [])]
        return {t.namespace: t.quota for t in tenants if t.quota is not None}

    @property
    def keyed(self) -> bool:
        return self.open is None

    @property
    def rate_limited(self) -> bool:
        """Some tenant has a request rate (its routes may answer 429)."""
        return any(t.rate is not None for t in self.by_key_digest.values())

    @classmethod
    def single(cls, api_key: str | None) -> Tenants:
        """Today's server: one key (or none) and the default namespace."""
        tenant = Tenant(name="default", access=Access(own=DEFAULT))
        if api_key is None:
            return cls(by_key_digest={}, open=tenant)
        return cls(by_key_digest={hashlib.sha256(api_key.encode()).digest(): tenant})


def load_tenants(path: str | os.PathLike, *, environ: Mapping[str, str] | None = None) -> Tenants:
    """The tenants of a TOML file (see the module's docstring).

    Raises:
        InvalidInputError: a file that cannot be read, is too large, is not TOML, or describes tenants wrongly (an
            unknown field, a missing or empty key, two tenants with one key or one salt, a ``reads`` naming no tenant,
            shares that sum to more than 1 ...), naming the tenant and the field; never echoing a key or a salt.
    """
    environ = os.environ if environ is None else environ
    text, mode = _read_bounded(Path(path), "--tenants", MAX_FILE_BYTES)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InvalidInputError(f"--tenants {str(path)!r} is not TOML: {exc}") from None
    unknown = set(data) - {"tenants"}
    if unknown or not isinstance(data.get("tenants"), dict) or not data["tenants"]:
        raise InvalidInputError(
            f"--tenants {str(path)!r}: expected [tenants.NAME] tables (and nothing else); found {sorted(data)}"
        )
    tables: dict = data["tenants"]
    inline = [f"tenants.{n}.{f}" for n, t in tables.items() if isinstance(t, dict) for f in ("key", "salt") if f in t]
    if inline and mode & 0o066:
        raise InvalidInputError(
            f"--tenants {str(path)!r} holds secrets ({', '.join(inline[:3])}) but others may read it (mode "
            f"{stat.S_IMODE(mode):04o}): chmod 600 it, or move them to key_file / key_env"
        )
    base = Path(path).parent
    keys: dict[str, bytes] = {}
    namespaces: dict[str, Namespace] = {}
    for name, table in tables.items():
        _check_table(name, table)
        keys[name] = _secret(name, table, "key", base, environ, required=True)
        salt = _secret(name, table, "salt", base, environ, required=False)
        namespaces[name] = Namespace(name, salt) if salt else Namespace.derived(name, keys[name])
    _all_distinct("key", keys)
    _all_distinct("salt", {name: ns.salt for name, ns in namespaces.items()})
    by_digest = {}
    for name, table in tables.items():
        reads = table.get("reads", [])
        if not isinstance(reads, list) or not all(isinstance(r, str) and r in namespaces for r in reads):
            raise InvalidInputError(
                f"tenant {name!r}: reads={reads!r:.120} must list other tenants' names (their namespaces); the "
                f"tenants are {sorted(namespaces)}"
            )
        if name in reads:
            raise InvalidInputError(f"tenant {name!r}: reads names itself (a tenant always reads its own chunks)")
        access = Access(own=namespaces[name], reads=tuple(namespaces[r] for r in reads))
        tenant = Tenant(name=name, access=access, quota=_quota(name, table), rate=_rate(name, table))
        by_digest[hashlib.sha256(keys[name]).digest()] = tenant
    tenants = Tenants(by_key_digest=by_digest)
    try:
        from pic.config import PICConfig

        PICConfig(quotas=tenants.quotas)  # shares that sum to more than 1, said now
    except InvalidInputError as exc:
        raise InvalidInputError(f"--tenants {str(path)!r}: {exc}") from None
    return tenants


def _check_table(name: str, table: object) -> None:
    import re

    if not re.match(NAME_PATTERN, name):
        raise InvalidInputError(f"tenant name {name!r:.80} is not 1 to 64 of A-Z a-z 0-9 _ . -")
    if not isinstance(table, dict):
        raise InvalidInputError(f"tenants.{name} is not a table ([tenants.{name}] with key_file = ... under it)")
    unknown = set(table) - _TENANT_FIELDS
    if unknown:
        raise InvalidInputError(
            f"tenant {name!r}: unknown field(s) {sorted(unknown)}; the fields: {sorted(_TENANT_FIELDS)}"
        )


def _secret(
    name: str, table: dict, kind: str, base: Path, environ: Mapping[str, str], *, required: bool
) -> bytes | None:
    """A tenant's ``key`` or ``salt``: from exactly one of ``{kind}``, ``{kind}_file`` (relative to the tenants file's
    folder; one trailing newline stripped) or ``{kind}_env``."""
    given = [f for f in (kind, f"{kind}_file", f"{kind}_env") if f in table]
    if len(given) > 1:
        raise InvalidInputError(f"tenant {name!r}: give one of {given}, not several")
    if not given:
        if required:
            raise InvalidInputError(f"tenant {name!r} has no key: give key_file, key_env or key")
        return None
    source, value = given[0], table[given[0]]
    if not isinstance(value, str) or not value:
        raise InvalidInputError(f"tenant {name!r}: {source} must be a non-empty string")
    if source == kind:
        secret = value.encode()
    elif source.endswith("_env"):
        if value not in environ or not environ[value]:
            raise InvalidInputError(
                f"tenant {name!r}: {source}={value!r} names an environment variable that is not set (or empty)"
            )
        secret = environ[value].encode()
    else:
        file = Path(value).expanduser()
        try:
            secret = read_secret_file(str(file if file.is_absolute() else base / file))  # mode 600, bounded
        except InvalidInputError as exc:
            raise InvalidInputError(f"tenant {name!r} {source}: {exc}") from None
    if not secret.strip():
        raise InvalidInputError(f"tenant {name!r}: its {kind} ({source}) is empty")
    if kind == "key" and len(secret) < _MIN_KEY_CHARS:
        raise InvalidInputError(
            f"tenant {name!r}: its key ({source}) has {len(secret)} bytes; use at least {_MIN_KEY_CHARS}"
        )
    return secret


def _read_bounded(path: Path, what: str, limit: int) -> tuple[str, int]:
    """A text file's text and mode, refused when larger than ``limit`` (read no further), not a regular file or not
    UTF-8."""
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            if not stat.S_ISREG(mode):
                raise InvalidInputError(f"{what}: {str(path)!r} is not a regular file")
            data = f.read(limit + 1)
    except OSError as exc:
        raise InvalidInputError(f"{what}: cannot read {str(path)!r}: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise InvalidInputError(f"{what}: {str(path)!r} is over {limit:,} bytes")
    try:
        return data.decode("utf-8"), mode
    except UnicodeDecodeError as exc:
        raise InvalidInputError(f"{what}: {str(path)!r} is not UTF-8 (byte {exc.start})") from None


def _all_distinct(kind: str, values: Mapping[str, bytes | None]) -> None:
    seen: dict[bytes, str] = {}
    for name, value in values.items():
        if value and value in seen:
            raise InvalidInputError(f"tenants {seen[value]!r} and {name!r} have the same {kind}; each needs its own")
        if value:
            seen[value] = name


def _quota(name: str, table: dict) -> Quota | None:
    fields = {k: table[k] for k in ("kv_share", "store_share", "max_num_seqs") if k in table}
    if not fields:
        return None
    for share in ("kv_share", "store_share"):
        if isinstance(fields.get(share), int) and not isinstance(fields[share], bool):
            fields[share] = float(fields[share])  # TOML's 0 and 1 are integers
    try:
        return Quota(**fields)
    except InvalidInputError as exc:
        raise InvalidInputError(f"tenant {name!r}: {exc}") from None


def _rate(name: str, table: dict) -> RateLimit | None:
    per_s, burst = table.get("requests_per_s"), table.get("burst")
    if per_s is None:
        if burst is not None:
            raise InvalidInputError(f"tenant {name!r}: burst needs requests_per_s")
        return None
    if isinstance(per_s, bool) or not isinstance(per_s, (int, float)) or not math.isfinite(per_s) or per_s <= 0:
        raise InvalidInputError(f"tenant {name!r}: requests_per_s={per_s!r} must be a number above 0")
    if burst is None:
        burst = max(1, math.ceil(2 * per_s))  # two seconds' worth at once
    if isinstance(burst, bool) or not isinstance(burst, int) or burst < 1:
        raise InvalidInputError(f"tenant {name!r}: burst={burst!r} must be a positive integer")
    return RateLimit(per_s=float(per_s), burst=burst)
