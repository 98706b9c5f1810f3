"""One chunk in one file: the disk tier's format, written atomically and read without trusting it.

A file is ``MAGIC``, the metadata record's length (8 bytes, little endian), the metadata record of
``pic.store.serde`` (msgpack, validated as Redis entries are) and the payload, K's bytes then V's. The
payload's checksum is in the metadata, so a torn, truncated or flipped file is found on read.

Nothing in the directory is trusted either: a chunk is opened only as a regular file, without following a
symbolic link and without blocking (``pic.store.disk_entry``), and a file larger than any chunk of this engine
can be is refused before a byte of it is read (a sparse file may claim gigabytes it does not hold).

Writes go to a temporary file in the same directory that is then renamed over the final name
(``os.replace`` is atomic on POSIX): a reader sees the old file, the new one, or none, never half of
one, and a writer that dies mid-write leaves only a temporary file, which no reader opens (``sweep_tmp``
removes those of dead processes). Two processes writing the same chunk each rename a whole file; the
last rename wins and both were good.

What the tier creates is its own user's alone: chunk files (and the usage and lock files) 0600, folders 0700 (a
folder that exists keeps its mode: never loosened). A chunk file holds a document's tokens and its compile context
in the clear, and another local user who can read one can decode the document.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import re
import stat
import struct
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import BinaryIO

from pic.kv import ChunkKV
from pic.store import serde
from pic.store.auth import StoreKey
from pic.store.disk_entry import NotAFileError, open_chunk, remove_stray

MAGIC = b"PICKV\x00\x01\x00"
SUFFIX = ".kv"
_TMP_PREFIX = ".tmp."
_LENGTH = struct.Struct("<Q")
_HEADER_BYTES = len(MAGIC) + _LENGTH.size
_counter = itertools.count()
_ID = re.compile(r"^[0-9a-f]{32}$")  # pic.ids.chunk_id
_LOCK_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC  # a FIFO named .lock must not hang writers
_USAGE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC  # a temporary chunk file
FILE_MODE, DIR_MODE = 0o600, 0o700  # what the tier creates: its user's alone
_USAGE_DIGITS = 20  # a usage record longer than any byte count is not one


def max_file_bytes(expected: serde.Expected) -> int:
    """The largest a chunk file of this engine can be: the header, the largest metadata record, and K and V
    of a chunk of ``expected.max_tokens`` tokens."""
    per_token = expected.num_layers * expected.num_kv_heads * expected.head_dim * expected.dtype.itemsize
    tensor_bytes = expected.max_tokens * per_token
    return _HEADER_BYTES + serde.MAX_META_BYTES + 2 * tensor_bytes


def make_dirs(path: Path) -> None:
    """Create ``path`` and its missing parents, each ``DIR_MODE`` (less if the umask says so); a folder that exists
    keeps its mode.

    Raises:
        OSError: one could not be created (a read-only or full disk, a file in the way).
    """
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process made it meanwhile
            folder.mkdir(mode=DIR_MODE)


def tighten(directory: Path) -> int:
    """Take group and other permissions off the chunk, usage and lock files of ``directory`` that have them (what
    versions before 0600 wrote); returns how many. Only regular files, never through a link; never loosens."""
    tightened = 0
    for entry in os.scandir(directory):
        if not (entry.name.endswith(SUFFIX) or entry.name in (".usage", ".lock")):
            continue
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to change: left as it is
            if entry.is_file(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_mode & 0o077:
                fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
                try:
                    mode = os.fstat(fd).st_mode
                    if stat.S_ISREG(mode):
                        os.fchmod(fd, stat.S_IMODE(mode) & FILE_MODE)
                        tightened += 1
                finally:
                    os.close(fd)
    return tightened


def is_cache_id(text: object) -> bool:
    """Whether ``text`` can be a cache id: only those become file names (no ``..``, no ``/``)."""
    return isinstance(text, str) and _ID.match(text) is not None


def listing(directory: Path) -> dict[str, tuple[int, int]]:
    """Every chunk file in ``directory``: cache id -> (bytes, mtime in ns), least recently used first."""
    found = []
    for entry in os.scandir(directory):
        cache_id = entry.name.removesuffix(SUFFIX)
        if entry.name.endswith(SUFFIX) and is_cache_id(cache_id):
            with contextlib.suppress(FileNotFoundError):  # evicted by another process meanwhile
                if not entry.is_file(follow_symlinks=False):  # a directory, FIFO or link in a chunk's name: never one
                    continue
                st = entry.stat(follow_symlinks=False)
                found.append((st.st_mtime_ns, cache_id, st.st_size))
    return {cache_id: (size, mtime) for mtime, cache_id, size in sorted(found)}


def read_usage(directory: Path) -> int | None:
    """The bytes of chunk files the usage record says ``directory`` holds; ``None`` when there is no readable
    record (then the caller lists the directory). Read and written under ``locked``."""
    try:
        with open_chunk(directory / ".usage") as f:  # never a FIFO's hang or a sparse file's gigabytes
            text = f.read(_USAGE_DIGITS + 1).decode("ascii", "replace")
    except (FileNotFoundError, NotAFileError):
        return None
    return int(text) if text.isdigit() and len(text) <= _USAGE_DIGITS else None


def write_usage(directory: Path, num_bytes: int) -> None:
    """Record ``num_bytes`` as the bytes of ``directory``'s chunk files (under ``locked``). A FIFO or symbolic link
    in the record's name is replaced (opening it never blocks: it fails, ENXIO or ELOOP).

    Raises:
        OSError: it could not be written (a full disk). The record is removed then, so that it is never left
            lower than the files (a missing record makes the next writer list the directory); if even that
            fails the record is as it was, and the caller must not commit what it reserved.
    """
    record = directory / ".usage"
    try:
        _write_record(record, num_bytes)
        return
    except OSError as exc:
        failure = exc
    with contextlib.suppress(OSError):
        if remove_stray(record):
            _write_record(record, num_bytes)
            return
    with contextlib.suppress(OSError):
        record.unlink(missing_ok=True)
    raise failure


def _write_record(record: Path, num_bytes: int) -> None:
    with os.fdopen(os.open(record, _USAGE_FLAGS, FILE_MODE), "wb") as f:
        f.write(str(num_bytes).encode("ascii"))


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """``directory``'s exclusive lock (``flock`` on its ``.lock``: between processes, and between one process's
    threads, since each call opens its own descriptor); closing the descriptor releases it. The lock file is
    created when missing (a tier that started on a full disk could not create it then)."""
    lock_path = directory / ".lock"
    try:
        fd = os.open(lock_path, _LOCK_FLAGS)  # no O_CREAT: it opens on a read-only disk
    except FileNotFoundError:
        fd = os.open(lock_path, _LOCK_FLAGS | os.O_CREAT, FILE_MODE)
    with os.fdopen(fd, "rb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def write(path: Path, chunk: ChunkKV, *, fingerprint: str, part_bytes: int, key: StoreKey | None = None) -> Path:
    """Write ``chunk`` (with ``key``'s MACs when there is one) to a temporary file beside ``path``, ``FILE_MODE``,
    and return that file: the caller renames it to ``path`` (``os.replace``) once it has decided, under its lock,
    that the chunk fits.

    Raises:
        OSError: the write failed (the temporary file is removed).
    """
    encoded = serde.encode(chunk, fingerprint=fingerprint, part_bytes=part_bytes, key=key)
    tmp = temporary(path)
    try:
        with os.fdopen(os.open(tmp, _NEW_FLAGS, FILE_MODE), "wb") as f:
            f.write(MAGIC + _LENGTH.pack(len(encoded.meta)) + encoded.meta)
            for part in encoded.parts:
                f.write(part)
        return tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def temporary(path: Path) -> Path:
    """This thread's temporary name for ``path``: unique per process, thread and write, and naming the
    process, so ``sweep_tmp`` can tell a dead writer's leftovers from a live one's file."""
    name = f"{_TMP_PREFIX}{path.name}.{os.getpid()}.{threading.get_ident()}.{next(_counter)}"
    return path.with_name(name)


def read_meta(
    f: BinaryIO,
    *,
    cache_id: str,
    expected: serde.Expected,
    file_bytes: int,
    readable: Mapping[str, bytes] | None = None,
    key: StoreKey | None = None,
) -> serde.Meta:
    """The validated metadata of an open chunk file (``serde.parse_meta``: its MAC checked with a ``key``, its
    namespace one of ``readable``'s), checking first that its size is exactly what the metadata promises (so the
    payload is never allocated for a truncated or padded file). Every length is bounded before anything is read or
    allocated: the file by the largest chunk this engine makes (``max_file_bytes``), the metadata record by
    ``serde``'s limit.

    Raises:
        serde.CorruptEntryError: not a chunk file, another chunk's, the wrong size, or (``ForgedEntryError``) one
            that fails ``key``'s MAC.
        serde.NotReadable: a whole chunk file of none of ``readable``'s namespaces.
    """
    largest = max_file_bytes(expected)
    if file_bytes > largest:
        raise serde.CorruptEntryError(f"file has {file_bytes} bytes; a chunk of this model has at most {largest}")
    header = f.read(_HEADER_BYTES)
    if len(header) != _HEADER_BYTES or header[: len(MAGIC)] != MAGIC:
        raise serde.CorruptEntryError("not a pic chunk file (bad magic or short header)")
    (meta_bytes,) = _LENGTH.unpack(header[len(MAGIC) :])
    if meta_bytes > min(serde.MAX_META_BYTES, file_bytes - _HEADER_BYTES):
        raise serde.CorruptEntryError(f"metadata of {meta_bytes} bytes in a {file_bytes}-byte file")
    meta = serde.parse_meta(f.read(meta_bytes), cache_id=cache_id, expected=expected, readable=readable, key=key)
    expected_bytes = _HEADER_BYTES + meta_bytes + 2 * meta.tensor_bytes
    if file_bytes != expected_bytes:
        raise serde.CorruptEntryError(f"file has {file_bytes} bytes; its metadata says {expected_bytes}")
    return meta


def read(
    path: Path,
    *,
    cache_id: str,
    expected: serde.Expected,
    pin: bool = False,
    readable: Mapping[str, bytes] | None = None,
    key: StoreKey | None = None,
) -> ChunkKV:
    """The chunk in ``path``, read straight into its tensors and checked (with a ``key``: its MACs too, before it
    is returned).

    Raises:
        FileNotFoundError: no such file (evicted or never written).
        NotAFileError: not a regular file (``open_chunk``).
        serde.CorruptEntryError: damaged, truncated, foreign or (``ForgedEntryError``) failing ``key``'s MAC.
        serde.NotReadable: a whole chunk of none of ``readable``'s namespaces.
    """
    with open_chunk(path) as f:
        size = os.fstat(f.fileno()).st_size
        meta = read_meta(f, cache_id=cache_id, expected=expected, file_bytes=size, readable=readable, key=key)
        return serde.read_payload(meta, f.readinto, pin=pin, key=key)


def sweep_tmp(directory: Path) -> int:
    """Remove the temporary files of writers that are no longer running (a crash mid-write); returns how many."""
    removed = 0
    for entry in os.scandir(directory):
        if not entry.name.startswith(_TMP_PREFIX) or entry.is_dir(follow_symlinks=False):
            continue
        pid = entry.name.split(".")[-3]
        if pid.isdigit() and not _alive(int(pid)):
            Path(entry.path).unlink(missing_ok=True)
            removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: a number no process has (a crafted name)
        return False
    except PermissionError:  # another user's live process
        return True
    return True
