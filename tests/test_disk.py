"""The disk tier on its own: chunk files written atomically, read back by a new tier (a restart), damage
read as a miss and removed, LRU by bytes shared by two processes, a failing disk as Redis fails."""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from pic.config import CompileOptions
from pic.errors import StoreUnavailableError
from pic.ids import chunk_id
from pic.kv import ChunkKV
from pic.store import DiskTier, disk_file, serde
from pic.store.disk_file import SUFFIX

FINGERPRINT = "0123456789abcdef0123456789abcdef"
EXPECTED = serde.Expected(FINGERPRINT, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                          max_tokens=512, vocab_size=1000)  # fmt: skip


def make_chunk(seed: int, num_tokens: int = 16) -> ChunkKV:
    """A chunk with random KV whose id is its tokens' (as a compiled one's)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 1000, (num_tokens,), generator=g)
    options = CompileOptions(add_bos=False)
    shape = (EXPECTED.num_layers, num_tokens, EXPECTED.num_kv_heads, EXPECTED.head_dim)
    k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    return ChunkKV(chunk_id(FINGERPRINT, tokens.tolist(), options), tokens, k, v, options)


def tier(path: Path, capacity: int = 1 << 30, **kwargs) -> DiskTier:
    return DiskTier(path, expected=EXPECTED, capacity_bytes=capacity, part_bytes=1000, **kwargs)


def files(t: DiskTier) -> list[Path]:
    return sorted(p for p in t.path.iterdir() if p.name not in (".lock", ".usage"))


def assert_same(a: ChunkKV, b: ChunkKV) -> None:
    assert a.cache_id == b.cache_id and torch.equal(a.token_ids, b.token_ids)
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v) and a.options == b.options


def test_a_new_tier_on_the_same_directory_reads_what_the_last_one_wrote(tmp_path):
    chunks = [make_chunk(i) for i in range(3)]
    first = tier(tmp_path)
    assert all(first.put(c) for c in chunks)
    again = tier(tmp_path)  # a restart
    assert sorted(again.ids()) == sorted(c.cache_id for c in chunks)
    for chunk in chunks:
        assert_same(again.get(chunk.cache_id), chunk)
        assert again.extent(chunk.cache_id).num_tokens == 16
    assert again.stats().hits == 3 and again.stats().num_entries == 3
    assert [p.name.endswith(SUFFIX) for p in files(again)] == [True] * 3  # no temporary file left


@pytest.mark.parametrize("damage", ["truncate", "flip_payload", "flip_meta", "empty", "other_chunk", "garbage"])
def test_a_damaged_file_is_a_miss_and_is_removed(tmp_path, damage, caplog):
    t = tier(tmp_path)
    chunk, other = make_chunk(1), make_chunk(2)
    t.put(chunk)
    t.put(other)
    path = t.path / f"{chunk.cache_id}{SUFFIX}"
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) - 100]
    elif damage == "flip_payload":
        data[-5] ^= 0xFF
    elif damage == "flip_meta":
        data[40] ^= 0xFF
    elif damage == "empty":
        data = bytearray()
    elif damage == "other_chunk":
        data = bytearray((t.path / f"{other.cache_id}{SUFFIX}").read_bytes())
    else:
        data = bytearray(os.urandom(len(data)))
    path.write_bytes(bytes(data))
    if damage != "flip_payload":  # extent reads the metadata alone; the payload's checksum is get's
        assert t.extent(chunk.cache_id) is None
    assert t.get(chunk.cache_id) is None
    assert not path.exists() and t.stats().errors == 1 and "dropping chunk file" in caplog.text
    assert_same(t.get(other.cache_id), other)  # the neighbour is untouched


def test_ids_that_are_not_cache_ids_never_become_paths(tmp_path):
    t = tier(tmp_path / "store")
    (tmp_path / "secret.kv").write_bytes(b"x")
    for bad in ["../secret", "../../secret", "/etc/passwd", "", "A" * 32, 5, None]:
        assert t.get(bad) is None and not t.contains(bad) and t.extent(bad) is None and not t.delete(bad)
    assert (tmp_path / "secret.kv").exists()


def test_least_recently_used_files_go_first_pins_and_keep_stay(tmp_path):
    chunks = [make_chunk(i) for i in range(6)]
    size = probe_size(tmp_path / "probe", chunks[0])
    t = tier(tmp_path / "d", capacity=3 * size)
    for c in chunks[:3]:
        assert t.put(c)
    t.get(chunks[0].cache_id)  # now most recently used: chunks[1] is the oldest
    assert t.put(chunks[3])
    assert sorted(t.ids()) == sorted(c.cache_id for c in (chunks[0], chunks[2], chunks[3]))
    assert t.pin(chunks[2].cache_id)
    assert t.put(chunks[4], keep=[chunks[3].cache_id])  # chunks[0] is the only one it may evict
    assert sorted(t.ids()) == sorted(c.cache_id for c in (chunks[2], chunks[3], chunks[4]))
    assert not t.can_fit(size, keep=[chunks[3].cache_id, chunks[4].cache_id])
    assert not t.put(chunks[5], keep=[chunks[3].cache_id, chunks[4].cache_id])  # cannot fit: nothing evicted
    assert len(t.ids()) == 3 and t.stats().evictions == 2 and len(files(t)) == 3
    assert t.stats().num_bytes <= 3 * size


def probe_size(path: Path, chunk: ChunkKV) -> int:
    t = tier(path)
    t.put(chunk)
    return files(t)[0].stat().st_size


def test_a_restart_with_a_smaller_limit_evicts_down_to_it_and_removes_dead_writers_files(tmp_path):
    chunks = [make_chunk(i) for i in range(4)]
    size = probe_size(tmp_path / "probe", chunks[0])
    t = tier(tmp_path / "d")
    for c in chunks:
        t.put(c)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    leftover = t.path / f".tmp.{chunks[0].cache_id}{SUFFIX}.{int(dead.stdout)}.1.0"
    live = t.path / f".tmp.{chunks[1].cache_id}{SUFFIX}.{os.getpid()}.1.0"
    leftover.write_bytes(b"half a chunk")
    live.write_bytes(b"being written")
    smaller = tier(tmp_path / "d", capacity=2 * size)
    assert len(smaller.ids()) == 2 and smaller.stats().num_bytes <= 2 * size
    assert not leftover.exists() and live.exists()


def test_the_usage_record_spares_listings_and_a_wrong_one_is_corrected(tmp_path, monkeypatch):
    chunks = [make_chunk(i, num_tokens=8) for i in range(140)]
    size = probe_size(tmp_path / "probe", chunks[0])
    t = tier(tmp_path / "d", capacity=100 * size)
    listings, real = [], disk_file.listing
    monkeypatch.setattr(disk_file, "listing", lambda d: listings.append(d) or real(d))
    for c in chunks[:90]:
        assert t.put(c)
    assert listings == []  # the record says there is room
    for c in chunks[90:]:
        assert t.put(c)
        assert sum(p.stat().st_size for p in files(t)) <= 100 * size
    assert 0 < len(listings) < 20  # each listing evicts a few files ahead (1/32 of the capacity), not one
    disk_file.write_usage(t.path, 100 * size)  # a record left high (a process died between its steps)
    assert t.put(chunks[0]) and disk_file.read_usage(t.path) == sum(p.stat().st_size for p in files(t))
    (t.path / ".usage").write_text("garbage")
    assert t.put(make_chunk(999, num_tokens=8)) and disk_file.read_usage(t.path) == sum(
        p.stat().st_size for p in files(t)
    )


def test_a_failing_disk_raises_naming_the_path_or_is_a_logged_miss(tmp_path, caplog):
    chunk = make_chunk(1)
    raising, missing = tier(tmp_path / "a"), tier(tmp_path / "b", on_error="miss")
    for t in (raising, missing):  # the directory is replaced by a file: every write and read fails
        t.path.rename(t.path.with_name("moved"))
        t.path.write_bytes(b"not a directory")
    with pytest.raises(StoreUnavailableError, match=f"disk tier at {raising.path} failed: ENOTDIR"):
        raising.put(chunk)
    assert "ENOTDIR" in raising.last_error and raising.stats().errors == 1
    assert missing.put(chunk) is False and missing.get(chunk.cache_id) is None and missing.ids() == []
    assert missing.stats().errors == 3 and "serving from the other tiers" in caplog.text


def test_a_directory_that_cannot_be_made_is_refused_at_start(tmp_path):
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(StoreUnavailableError, match="cannot start"):
        tier(tmp_path / "file" / "sub", on_error="miss")


WRITER = textwrap.dedent(
    """
    import random, sys
    sys.path.insert(0, {root!r})
    from pic.store import disk_file
    from tests.test_disk import make_chunk, tier, files
    from pathlib import Path
    t = tier(Path({path!r}), capacity={capacity})
    rng, over = random.Random({seed}), []
    for i in range({ops}):
        c = make_chunk(rng.randrange(40), num_tokens=rng.choice([8, 16, 32]))
        op = rng.random()
        if op < 0.5:
            t.put(c)
        elif op < 0.85:
            got = t.get(c.cache_id)
            assert got is None or got.cache_id == c.cache_id
        else:
            t.delete(c.cache_id)
        with disk_file.locked(t.path):  # the committed files, as every writer sees them
            total = sum(p.stat().st_size for p in files(t) if not p.name.startswith(".tmp."))
        if total > {capacity}:
            over.append(total)
    print("over", len(over), max(over, default=0))
    """
)


def run_writers(path: Path, *, num_procs: int, ops: int, capacity: int) -> list[str]:
    root = str(Path(__file__).resolve().parents[1])
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER.format(root=root, path=str(path), capacity=capacity, ops=ops, seed=i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for i in range(num_procs)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    return outs


def test_the_byte_limit_holds_under_a_2000_operation_soak_by_two_processes(tmp_path):
    capacity = 20_000  # ~8 of the 40 chunks (2.3-8.7 KB files): constant eviction
    outs = run_writers(tmp_path, num_procs=2, ops=1000, capacity=capacity)
    assert all(out.strip().endswith("over 0 0") for out in outs), outs
    t = tier(tmp_path, capacity=capacity)
    assert 0 < t.stats().num_bytes <= capacity and t.stats().evictions == 0
    for cache_id in t.ids():  # every file left is whole and reads as its chunk
        assert t.get(cache_id) is not None
    assert all(not p.name.startswith(".tmp.") for p in files(t))


SAME_CHUNKS = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {root!r})
    from pathlib import Path
    from tests.test_disk import make_chunk, tier
    t = tier(Path({path!r}))
    while time.time() < {start}:  # both processes begin together
        time.sleep(0.001)
    for i in range(40):
        assert t.put(make_chunk(i, num_tokens=64))
    """
)


def test_two_processes_writing_the_same_chunks_at_once_leave_one_good_copy_each(tmp_path):
    script = SAME_CHUNKS.format(
        root=str(Path(__file__).resolve().parents[1]), path=str(tmp_path), start=time.time() + 3
    )
    procs = [subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True) for _ in range(2)]
    assert [p.communicate(timeout=120)[1] for p in procs] == ["", ""] and {p.returncode for p in procs} == {0}
    t = tier(tmp_path)
    assert len(t.ids()) == len(files(t)) == 40  # one file per chunk, no temporary file left
    for i in range(40):
        chunk = make_chunk(i, num_tokens=64)
        assert_same(t.get(chunk.cache_id), chunk)


def test_files_are_the_owners_alone(tmp_path):
    """Chunk, usage and lock files 0600; the folders the tier creates 0700; a folder that exists keeps its mode."""
    (tmp_path / "shared").mkdir(mode=0o755)
    (tmp_path / "shared").chmod(0o755)
    t = tier(tmp_path / "shared" / "new" / "deeper")
    assert t.put(make_chunk(1))
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert mode(tmp_path / "shared") == 0o755  # the user's: not changed
    assert [mode(p) for p in (tmp_path / "shared" / "new", t.path.parent, t.path)] == [0o700] * 3
    assert sorted(p.name for p in t.path.iterdir() if p.name.startswith(".")) == [".lock", ".usage"]
    assert all(mode(p) == 0o600 for p in t.path.iterdir()), {p.name: oct(mode(p)) for p in t.path.iterdir()}


def test_files_an_older_version_left_readable_are_tightened_at_start(tmp_path, caplog):
    t = tier(tmp_path)
    assert t.put(make_chunk(1))
    for p in t.path.iterdir():
        p.chmod(0o644)
    with caplog.at_level(logging.INFO, logger="pic.store"):
        again = tier(tmp_path)
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in again.path.iterdir())
    assert any("readable by their owner only" in r.getMessage() for r in caplog.records)
    assert again.get(make_chunk(1).cache_id) is not None


def test_an_oversized_file_is_removed_at_start_without_evicting_the_rest(tmp_path, caplog):
    """A sparse file in a chunk's name, larger than the tier's capacity (and than any chunk), made a restart evict
    every valid chunk file to "make room" beside it, silently. Now it alone goes, logged."""
    chunks = [make_chunk(i) for i in range(4)]
    t = tier(tmp_path, capacity=100_000)
    assert all(t.put(c) for c in chunks)
    sparse = t.path / f"{'f' * 32}{SUFFIX}"
    with open(sparse, "wb") as f:
        f.truncate(3 * 2**30)
    os.utime(sparse, ns=(2**62, 2**62))  # the most recently used: the LRU evicted everything else first
    with caplog.at_level(logging.WARNING, logger="pic.store"):
        again = tier(tmp_path, capacity=100_000)
    assert not sparse.exists() and sorted(again.ids()) == sorted(c.cache_id for c in chunks)
    assert any(str(sparse) in r.getMessage() and "removed" in r.getMessage() for r in caplog.records)
    assert all(again.get(c.cache_id) is not None for c in chunks)


def test_a_flipped_bos_is_refused(tmp_path, caplog):
    """The id hashes the tokens after the chunk's BOS, so a BOS changed in a file's metadata kept its id and was
    served: it is checked against the model's BOS now (without any store key)."""
    expected = dataclasses.replace(EXPECTED, bos_token_id=1)
    t = DiskTier(tmp_path, expected=expected, capacity_bytes=1 << 30, part_bytes=1000)
    tokens = torch.tensor([1, *range(10, 25)])
    options = CompileOptions(add_bos=True)
    k = v = torch.zeros(EXPECTED.num_layers, 16, EXPECTED.num_kv_heads, EXPECTED.head_dim)
    honest = ChunkKV(chunk_id(FINGERPRINT, tokens[1:].tolist(), options), tokens, k, v, options)
    flipped = ChunkKV(honest.cache_id, torch.tensor([7, *range(10, 25)]), k, v, options)
    assert t.put(honest) and t.get(honest.cache_id) is not None
    assert t.delete(honest.cache_id) and t.put(flipped)
    with caplog.at_level(logging.WARNING, logger="pic.store"):
        assert t.get(honest.cache_id) is None
    assert any("not the model's BOS 1" in r.getMessage() for r in caplog.records)


def test_a_folder_others_may_write_is_left_as_it_is_and_named(tmp_path, caplog):
    """Its mode is the operator's (never changed), but without a store key what other users write there would be
    served: a warning says so; with a key it is authenticated, and nothing is said."""
    folder = tmp_path / FINGERPRINT
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="pic.store"):
        tier(tmp_path)
        tier(tmp_path, store_key=b"k" * 16)
    warned = [r.getMessage() for r in caplog.records if "other users may write" in r.getMessage()]
    assert len(warned) == 1 and "mode 777" in warned[0]
    assert stat.S_IMODE(folder.stat().st_mode) == 0o777
