"""The disk tier against what a fault campaign put in its way, with real OS objects: a sparse file that claims
gigabytes, a FIFO, a directory, a socket and symbolic links in a chunk's name, and a real full (and read-only)
file system: a small tmpfs mounted for the test. Where mounting is impossible (not root) those tests skip and say
why, and the same logic runs on a disk made to fail ENOSPC (``disk_file.write`` patched), which always runs.

Every call that could hang (a FIFO's open blocks until a writer comes) runs in a thread joined with a timeout:
a hang fails its test, never the suite.
"""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pic.errors import StoreUnavailableError
from pic.store import DiskTier, disk_file
from pic.store.disk_file import SUFFIX
from tests.full_disk import fill, remount
from tests.test_disk import EXPECTED, assert_same, files, make_chunk, tier

HANG_S = 30.0  # a generous guard on a wait, not a speed: these calls take milliseconds, a hang takes forever


def prompt(fn: Callable[[], Any], *, unblock: Callable[[], None] | None = None) -> Any:
    """``fn()``, run in a daemon thread; a call still running after ``HANG_S`` fails the test (after ``unblock``,
    which frees a thread stuck on a FIFO so it does not outlive the test)."""
    result: list[Any] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # re-raised in the test's thread
            error.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HANG_S)
    if thread.is_alive():
        if unblock is not None:
            unblock()
        pytest.fail(f"{fn} still running after {HANG_S} s: it hangs")
    if error:
        raise error[0]
    return result[0]


def raising(code: int, calls: list[Any] | None = None) -> Callable[..., Any]:
    """A stand-in for a disk call that fails as a full (``ENOSPC``) or read-only (``EROFS``) disk does."""

    def fail(*args: Any, **kwargs: Any) -> Any:
        if calls is not None:
            calls.append(args)
        raise OSError(code, os.strerror(code))

    return fail


def counting(fn: Callable[..., Any], calls: list[Any]) -> Callable[..., Any]:
    """``fn``, counting its calls (the real disk call, for a test that asks whether it was made)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return fn(*args, **kwargs)

    return call


def put_when_writable(t: DiskTier, chunk, *, timeout_s: float = HANG_S) -> None:
    """Put ``chunk`` until it is stored: the breaker refuses writes until its ``retry_s`` has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if t.put(chunk):
                return
        except StoreUnavailableError:
            pass
        assert time.monotonic() < deadline, f"writes did not resume within {timeout_s} s: {t.last_error}"
        time.sleep(0.05)


# --- 1. a file that claims gigabytes -------------------------------------------------------------------------------

SPARSE = textwrap.dedent(
    """
    import json, resource, struct, sys
    sys.path.insert(0, {root!r})
    from pathlib import Path
    from pic.store import disk_file
    from tests.test_disk import make_chunk, tier
    t = tier(Path({path!r}))
    chunk = make_chunk(1)
    path = t.path / (chunk.cache_id + disk_file.SUFFIX)
    with open(path, "wb") as f:  # a header declaring 3 GiB of metadata, in a sparse 4 GiB file
        f.write(disk_file.MAGIC + struct.pack("<Q", 3 * 2**30))
        f.truncate(4 * 2**30)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    extent = t.extent(chunk.cache_id)
    contains = t.contains(chunk.cache_id)
    got = t.get(chunk.cache_id)
    print(json.dumps({{
        "extent": repr(extent), "got": repr(got), "contains": contains, "exists": path.exists(),
        "errors": t.stats().errors,
        "grew_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before,
    }}))
    """
)


def test_a_sparse_file_claiming_gigabytes_is_a_miss_refused_before_it_is_read(tmp_path):
    """Its size is bounded by the largest chunk of this model before anything is read: the process's peak
    memory does not grow by the 3 GiB the header claims (it did: ``f.read(meta_bytes)``)."""
    script = SPARSE.format(root=str(Path(__file__).resolve().parents[1]), path=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["extent"] == "None" and out["got"] == "None" and out["contains"] is True  # a miss (a file is there)
    assert not out["exists"] and out["errors"] == 1  # removed as damaged, counted
    assert out["grew_kib"] < 256 * 1024, f"peak memory grew by {out['grew_kib'] // 1024} MiB reading it"


def test_the_size_bound_admits_the_largest_chunk_of_the_model(tmp_path):
    largest = make_chunk(7, num_tokens=EXPECTED.max_tokens)
    t = tier(tmp_path)
    assert t.put(largest)
    assert files(t)[0].stat().st_size <= disk_file.max_file_bytes(EXPECTED)
    assert_same(tier(tmp_path).get(largest.cache_id), largest)


# --- 2. things that are not files in a chunk's name ----------------------------------------------------------------

STRAYS = ["fifo", "directory", "socket", "link_to_device", "link_to_chunk"]


def make_stray(path: Path, kind: str, elsewhere: Path) -> Path | None:
    """Put a real ``kind`` at ``path``; returns what a link points to (which must survive untouched)."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
        (path / "inside").write_bytes(b"not ours")
    elif kind == "socket":
        with socket.socket(socket.AF_UNIX) as sock:  # bound by a relative name: a socket's path is short
            cwd = os.getcwd()
            os.chdir(path.parent)
            try:
                sock.bind(path.name)
            finally:
                os.chdir(cwd)
    elif kind == "link_to_device":
        os.symlink("/dev/zero", path)
        return Path("/dev/zero")
    else:  # a good file of the same chunk in another tier's directory: still not this tier's file
        other = tier(elsewhere)
        assert other.put(make_chunk(1))
        (target,) = files(other)
        os.symlink(target, path)
        return target
    return None


def unblocker(path: Path) -> Callable[[], None]:
    """Frees a reader blocked opening the FIFO at ``path`` (a writer appears, and leaves)."""

    def unblock() -> None:
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass

    return unblock


@pytest.mark.parametrize("kind", STRAYS)
def test_a_non_file_in_a_chunks_name_is_a_prompt_miss_and_the_tier_serves_on(tmp_path, kind, caplog):
    t = tier(tmp_path / "d")  # on_error="raise": a failure would raise
    chunk, neighbour = make_chunk(1), make_chunk(2)
    assert t.put(neighbour)
    path = t.path / f"{chunk.cache_id}{SUFFIX}"
    target = make_stray(path, kind, tmp_path / "elsewhere")
    before = target.read_bytes() if kind == "link_to_chunk" else None
    unblock = unblocker(path)

    assert not t.contains(chunk.cache_id) and not t.pin(chunk.cache_id)
    assert prompt(lambda: t.extent(chunk.cache_id), unblock=unblock) is None
    assert t.ids() == [neighbour.cache_id] and t.stats().num_entries == 1
    assert prompt(lambda: t.get(chunk.cache_id), unblock=unblock) is None
    assert f"{path} is a" in caplog.text and "not a chunk file" in caplog.text  # logged, naming the path
    if kind == "directory":  # left to its owner, whole
        assert path.is_dir() and (path / "inside").read_bytes() == b"not ours"
    else:  # the name is unlinked, nothing it points to
        assert not os.path.lexists(path)
        make_stray(path, kind, tmp_path / "elsewhere2")  # and put back, for the put below
    assert_same(t.get(neighbour.cache_id), neighbour)

    stored = prompt(lambda: t.put(chunk), unblock=unblock)  # never raises
    if kind == "directory":
        assert stored is False and t.last_error is None and path.is_dir()  # nothing stored, no tier failure
        assert t.delete(chunk.cache_id) is False and path.is_dir()
    else:  # replaced by the chunk's file
        assert stored is True and stat.S_ISREG(os.lstat(path).st_mode)
        assert_same(prompt(lambda: t.get(chunk.cache_id)), chunk) and t.contains(chunk.cache_id)
    if kind == "link_to_device":
        assert stat.S_ISCHR(os.stat("/dev/zero").st_mode)
    if kind == "link_to_chunk":
        assert target.read_bytes() == before
    assert_same(t.get(neighbour.cache_id), neighbour) and t.stats().writable


def test_eviction_passes_over_a_directory_in_a_chunks_name(tmp_path):
    """Listing skips it (it once counted as the least recently used file and its unlink raised EISDIR)."""
    chunks = [make_chunk(i) for i in range(5)]
    size = len(_encoded(tmp_path / "probe", chunks[0]))
    t = tier(tmp_path / "d", capacity=2 * size)
    stray = t.path / f"{chunks[0].cache_id}{SUFFIX}"
    stray.mkdir()
    os.utime(stray, (0, 0))  # the oldest entry of the directory
    for c in chunks[1:]:
        assert t.put(c)
    assert stray.is_dir() and len(t.ids()) == 2 and t.stats().evictions == 2
    assert t.delete(chunks[0].cache_id) is False and stray.is_dir()


def _encoded(path: Path, chunk) -> bytes:
    t = tier(path)
    t.put(chunk)
    return files(t)[0].read_bytes()


@pytest.mark.parametrize("name", [".usage", ".lock"])
def test_a_fifo_in_place_of_the_usage_record_or_lock_hangs_no_writer(tmp_path, name):
    t = tier(tmp_path)
    (t.path / name).unlink(missing_ok=True)
    os.mkfifo(t.path / name)
    chunk = make_chunk(1)
    assert prompt(lambda: t.put(chunk), unblock=unblocker(t.path / name)) is True
    assert_same(t.get(chunk.cache_id), chunk)
    if name == ".usage":  # replaced by a real record
        assert disk_file.read_usage(t.path) == files(t)[0].stat().st_size


# --- 3 and 4. a disk that takes no writes: made to fail (always runs) ---------------------------------------------


@pytest.mark.parametrize("on_error", ["raise", "miss"])
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EROFS])
def test_a_tier_starts_on_a_disk_that_takes_no_writes_and_serves_what_it_holds(
    tmp_path, monkeypatch, caplog, on_error, code
):
    chunks = [make_chunk(i) for i in range(2)]
    first = tier(tmp_path)
    assert all(first.put(c) for c in chunks)
    writes: list[Any] = []
    monkeypatch.setattr(disk_file, "write_usage", raising(code))  # what a start writes
    monkeypatch.setattr(disk_file, "write", counting(disk_file.write, writes))
    again = tier(tmp_path, on_error=on_error, retry_s=60)
    assert f"disk tier at {again.path} is full or read-only ({errno.errorcode[code]}" in caplog.text
    assert "serving the 2 chunks it holds; writes fail until there is room" in caplog.text
    for c in chunks:
        assert_same(again.get(c.cache_id), c)
        assert again.extent(c.cache_id).num_tokens == 16 and again.contains(c.cache_id)
    stats = again.stats()
    assert stats.up and not stats.writable and stats.num_entries == 2 and stats.hits == 2
    new = make_chunk(9)
    if on_error == "raise":  # the breaker is open from the start: refused at once, naming the path and why
        with pytest.raises(StoreUnavailableError, match=rf"disk tier at {re.escape(str(again.path))}.*not tried"):
            again.put(new)
    else:
        assert again.put(new) is False
    assert errno.errorcode[code] in again.last_error or os.strerror(code) in again.last_error
    assert writes == [] and not again.contains(new.cache_id)
    assert again.put(chunks[0]) is True and again.last_error is None  # held already: nothing to write


def test_a_tier_on_a_disk_failing_otherwise_is_still_refused_at_start(tmp_path, monkeypatch):
    tier(tmp_path).put(make_chunk(1))
    monkeypatch.setattr(disk_file, "write_usage", raising(errno.EIO))
    with pytest.raises(StoreUnavailableError, match="cannot start: .*Input/output error"):
        tier(tmp_path, on_error="miss")


@pytest.mark.parametrize("on_error", ["raise", "miss"])
def test_a_full_disk_opens_the_write_breaker_and_reads_go_on(tmp_path, monkeypatch, caplog, on_error):
    t = tier(tmp_path, on_error=on_error, retry_s=60)
    held = make_chunk(1)
    assert t.put(held)
    writes: list[Any] = []
    monkeypatch.setattr(disk_file, "write", raising(errno.ENOSPC, writes))
    first, second = make_chunk(2), make_chunk(3)
    if on_error == "raise":
        with pytest.raises(StoreUnavailableError, match=rf"disk tier at {re.escape(str(t.path))} failed: ENOSPC"):
            t.put(first)
        with pytest.raises(StoreUnavailableError, match=r"not tried: .*No space left on device"):
            t.put(second)
    else:
        assert t.put(first) is False and "ENOSPC" in t.last_error
        assert t.put(second) is False and "not tried" in t.last_error and "No space left" in t.last_error
        assert caplog.text.count("No space left on device; serving from the other tiers") == 1  # logged once
    assert len(writes) == 1  # the second put failed at once, without writing
    stats = t.stats()
    assert stats.up and not stats.writable and stats.errors == 2
    assert_same(t.get(held.cache_id), held)  # reads never go through the write breaker
    assert t.extent(held.cache_id).num_tokens == 16 and t.contains(held.cache_id) and t.ids() == [held.cache_id]
    assert t.put(held) is True and t.last_error is None  # held already: no write needed
    assert files(t) == [t.path / f"{held.cache_id}{SUFFIX}"]  # no temporary file left


def test_writes_resume_once_the_disk_has_room_again(tmp_path, monkeypatch):
    t = tier(tmp_path, on_error="miss", retry_s=0.2)
    chunk, real_write = make_chunk(1), disk_file.write
    monkeypatch.setattr(disk_file, "write", raising(errno.ENOSPC))
    assert t.put(chunk) is False and not t.stats().writable
    monkeypatch.setattr(disk_file, "write", real_write)  # room again
    put_when_writable(t, chunk)
    assert t.stats().writable and t.last_error is None and not t.breaker.is_open
    assert_same(t.get(chunk.cache_id), chunk)


def test_a_chunk_that_does_not_fit_is_no_failure(tmp_path, monkeypatch):
    """``last_error`` tells the store "the disk failed" (set) from "it does not fit" (``None``)."""
    chunk = make_chunk(1)
    small = tier(tmp_path / "small", capacity=100, on_error="miss")
    assert small.put(chunk) is False and small.last_error is None and small.stats().writable
    failing = tier(tmp_path / "failing", on_error="miss")
    monkeypatch.setattr(disk_file, "write", raising(errno.ENOSPC))
    assert failing.put(chunk) is False and failing.last_error is not None


def test_deleting_and_dropping_damaged_files_work_on_a_full_disk(tmp_path, monkeypatch):
    """An unlink works on a full disk; the usage record's rewrite after it, which fails there, does not fail it
    (the record stays high or goes, both safe)."""
    chunks = [make_chunk(i) for i in range(3)]
    t = tier(tmp_path)
    assert all(t.put(c) for c in chunks)
    recorded = disk_file.read_usage(t.path)
    damaged = t.path / f"{chunks[1].cache_id}{SUFFIX}"
    damaged.write_bytes(damaged.read_bytes()[:-9])
    monkeypatch.setattr(disk_file, "write_usage", raising(errno.ENOSPC))
    assert t.delete(chunks[0].cache_id) is True and t.last_error is None
    assert t.get(chunks[1].cache_id) is None and not damaged.exists()  # a miss, removed
    assert t.ids() == [chunks[2].cache_id]
    assert disk_file.read_usage(t.path) in (None, recorded)  # never below the files


def test_a_usage_record_that_cannot_be_read_as_a_count_is_relisted(tmp_path):
    t = tier(tmp_path)
    for text in ["²", "9" * 40, ""]:  # a digit int() refuses; longer than any count; empty
        (t.path / ".usage").write_text(text)
        assert disk_file.read_usage(t.path) is None
    assert t.put(make_chunk(1)) and disk_file.read_usage(t.path) == files(t)[0].stat().st_size


# --- 3 and 4 on a real full (and read-only) file system ------------------------------------------------------------


@pytest.mark.parametrize("on_error", ["raise", "miss"])
def test_a_full_file_system_pauses_writes_serves_reads_and_writes_resume_after_room(small_disk, monkeypatch, on_error):
    t = tier(small_disk, on_error=on_error, retry_s=1.0)
    held, new, other = make_chunk(1), make_chunk(2), make_chunk(3)
    assert t.put(held)
    filler = fill(small_disk)
    writes: list[Any] = []
    monkeypatch.setattr(disk_file, "write", counting(disk_file.write, writes))
    if on_error == "raise":
        with pytest.raises(StoreUnavailableError, match=rf"disk tier at {re.escape(str(t.path))} failed: ENOSPC"):
            t.put(new)
        with pytest.raises(StoreUnavailableError, match="not tried"):
            t.put(other)
    else:
        assert t.put(new) is False and "ENOSPC" in t.last_error
        assert t.put(other) is False and "not tried" in t.last_error
    assert len(writes) == 1  # the second put, within retry_s, failed without writing
    assert not t.stats().writable and t.stats().up
    assert_same(t.get(held.cache_id), held) and t.ids() == [held.cache_id]
    assert files(t) == [t.path / f"{held.cache_id}{SUFFIX}"]  # the failed write left no temporary file
    filler.unlink()  # room again
    put_when_writable(t, new)
    assert t.stats().writable and t.last_error is None
    assert_same(t.get(new.cache_id), new)


@pytest.mark.parametrize("on_error", ["raise", "miss"])
def test_a_tier_starts_on_a_full_file_system_and_serves_what_it_holds(small_disk, on_error, caplog):
    chunks = [make_chunk(i) for i in range(3)]
    first = tier(small_disk)
    assert all(first.put(c) for c in chunks)
    (first.path / ".usage").unlink()  # as a failed rewrite on a full disk leaves it: the start must write one
    fill(small_disk)
    again = tier(small_disk, on_error=on_error, retry_s=60)  # it raised "cannot start: [Errno 28]"
    assert "is full or read-only (ENOSPC" in caplog.text and "serving the 3 chunks it holds" in caplog.text
    for c in chunks:
        assert_same(again.get(c.cache_id), c)
    assert not again.stats().writable and again.stats().num_entries == 3
    if on_error == "raise":
        with pytest.raises(StoreUnavailableError, match=rf"disk tier at {re.escape(str(again.path))}.*not tried"):
            again.put(make_chunk(9))
    else:
        assert again.put(make_chunk(9)) is False and "No space left on device" in again.last_error
    assert again.delete(chunks[0].cache_id) is True  # an unlink works on a full disk


def test_a_tier_starts_on_a_read_only_file_system_and_serves_what_it_holds(small_disk, caplog):
    chunks = [make_chunk(i) for i in range(3)]
    first = tier(small_disk)
    assert all(first.put(c) for c in chunks)
    damaged = first.path / f"{chunks[2].cache_id}{SUFFIX}"
    damaged.write_bytes(damaged.read_bytes()[:-9])
    remount(small_disk, "ro")
    try:
        again = tier(small_disk, retry_s=60)  # on_error="raise"; it raised "cannot start: [Errno 30]"
        assert "is full or read-only (EROFS" in caplog.text
        for c in chunks[:2]:
            assert_same(again.get(c.cache_id), c)  # its mtime cannot be recorded: still a hit
        assert again.get(chunks[2].cache_id) is None and damaged.exists()  # a miss it cannot remove, no failure
        assert "cannot remove" in caplog.text and not again.stats().writable
        with pytest.raises(
            StoreUnavailableError, match=rf"disk tier at {re.escape(str(again.path))}.*Read-only file system"
        ):
            again.put(make_chunk(9))
    finally:
        remount(small_disk, "rw")


def test_a_usage_record_that_cannot_be_written_is_removed_never_left_low(small_disk):
    directory = small_disk / "d"
    directory.mkdir()
    fill(small_disk)
    with pytest.raises(OSError) as failed:
        disk_file.write_usage(directory, 12345)
    assert failed.value.errno == errno.ENOSPC
    assert not (directory / ".usage").exists() and disk_file.read_usage(directory) is None
