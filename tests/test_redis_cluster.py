"""``redis-cluster://`` and ``redis-sentinel://`` URLs against a real 3-master Redis Cluster and a real
Sentinel setup (tests/redis_cluster.py): URL parsing, sharing across processes, a dead cluster node and
a sentinel failover under a live engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from redis.cluster import RedisCluster

import pic
from pic.redis_url import MultiNodeUrl, parse, redact
from tests.conftest import make_engine
from tests.models import DOCS, QUERY
from tests.redis_cluster import Cluster, SentinelSetup, free_ports
from tests.test_redis import _WORKER, generate, redis_engine, redis_tier

GOOD = {
    "redis-cluster://127.0.0.1:7000": (None, None, [("127.0.0.1", 7000)], None),
    "redis-cluster://:p%3A%2F%40w@a:1,b.example:2,[::1]:3": (
        None,
        "p:/@w",
        [("a", 1), ("b.example", 2), ("::1", 3)],
        None,
    ),
    "redis-cluster://bob:pw@h:6379/": ("bob", "pw", [("h", 6379)], None),
    "redis-sentinel://:pw@s1:26379,s2:26380/mymaster": (None, "pw", [("s1", 26379), ("s2", 26380)], "mymaster"),
    "redis-sentinel://s1:26379/cache.v2": (None, None, [("s1", 26379)], "cache.v2"),
}
BAD = {
    "redis-cluster://:hunter2@": "'' is not host:port",
    "redis-cluster://:hunter2@h:1,h2": "'h2' is not host:port",
    "redis-cluster://:hunter2@h:99999": "'h:99999' is not host:port",
    "redis-cluster://:hunter2@h:1/0": "has no path",
    "redis-cluster://hunter2@h:1": r"\[user\]:password@",
    "redis-sentinel://:hunter2@h:1": "ends in /service_name",
    "redis-sentinel://:hunter2@h:1/bad name": "ends in /service_name",
    "redis-sentinel://:hunter2@h:x/mymaster": "'h:x' is not host:port",
}


@pytest.mark.parametrize("url", list(GOOD))
def test_good_urls(url):
    assert parse(url) == MultiNodeUrl(*GOOD[url])
    assert pic.StoreConfig(redis_url=url).redis_url == url


@pytest.mark.parametrize("url", list(BAD))
def test_bad_urls_name_the_url_with_the_password_masked(url):
    with pytest.raises(pic.InvalidInputError, match=BAD[url]) as info:
        pic.StoreConfig(redis_url=url)
    assert "hunter2" not in str(info.value) and "***@" in str(info.value)
    with pytest.raises(pic.InvalidInputError, match=BAD[url]):
        parse(url)


def test_redact_masks_passwords():
    assert redact("redis-sentinel://:p%40w@h:1,h:2/m") == "redis-sentinel://:***@h:1,h:2/m"
    assert redact("redis://u:pw@h:1/0") == "redis://u:***@h:1/0"
    assert redact("unix:///tmp/r.sock?db=0&password=pw") == "unix:///tmp/r.sock?db=0&password=***"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with_cluster = Cluster(tmp_path_factory.mktemp("cluster"))
    try:
        yield with_cluster.start()
    finally:
        with_cluster.stop()


@pytest.fixture(scope="module")
def sentinel(tmp_path_factory):
    """Module-wide; the failover test runs last in this file and leaves the replica as the master."""
    setup = SentinelSetup(tmp_path_factory.mktemp("sentinel"))
    try:
        yield setup.start()
    finally:
        setup.stop()


def test_round_trip_through_a_cluster(cluster):
    engine = redis_engine(cluster.url)
    ids = engine.compile(list(DOCS))
    local = make_engine("stories260K")
    assert local.compile(list(DOCS)) == ids
    assert generate(engine, ids, from_redis=True) == generate(local, ids)
    fresh = redis_engine(cluster.url)  # an empty device tier: every chunk comes from the cluster
    assert generate(fresh, ids) == generate(local, ids)
    tier = redis_tier(fresh)
    assert tier.ids() == sorted(ids) and tier.stats().num_entries == 3  # a scan of every master, one GET per key
    client: RedisCluster = tier._client
    keys = [k for k in client.scan_iter(match=f"pic:{engine.fingerprint}:*", count=1000)]
    assert len({client.get_node_from_key(k).port for k in keys}) == 3  # a chunk's keys spread over the masters
    assert tier.delete(ids[0]) and not tier.contains(ids[0])  # per-key DELs, no CROSSSLOT
    assert not [k for k in client.scan_iter(match=f"pic:{engine.fingerprint}:{ids[0]}:*")]


def _worker(url: str, ids_or_compile: str) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    args = [sys.executable, "-c", _WORKER, url, json.dumps(list(DOCS)), ids_or_compile, QUERY]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("setup", ["cluster", "sentinel"])
def test_second_process_links_what_the_first_compiled(setup, request):
    servers = request.getfixturevalue(setup)
    servers.flush()  # a fresh store, so the first process compiles every chunk
    url = servers.url
    first = _worker(url, "compile")
    assert all(t == ["device", "redis"] for t in first["tiers"])
    second = _worker(url, json.dumps(first["ids"]))
    assert all(t == ["redis"] for t in second["tiers"])  # nothing resident in the new pool: read from Redis
    assert second["tokens"] == first["tokens"] and len(first["tokens"]) == 24


def test_dead_cluster_node_is_a_miss_or_a_clear_error(tmp_path):
    """The master holding a chunk's metadata dies: never wrong output, a miss or StoreUnavailableError."""
    cluster = Cluster(tmp_path)
    try:
        cluster.start()
        writer = redis_engine(cluster.url)
        ids = writer.compile(list(DOCS))
        client: RedisCluster = redis_tier(writer)._client
        cluster.kill(client.get_node_from_key(f"pic:{writer.fingerprint}:{ids[1]}:meta").port)
        missing = redis_engine(cluster.url, on_redis_error="miss", redis_timeout_s=2.0)
        with pytest.raises(pic.UnknownCacheIdError, match="failed"):
            generate(missing, ids)
        raising = redis_engine(cluster.url, on_redis_error="raise", redis_timeout_s=2.0)
        with pytest.raises(pic.StoreUnavailableError, match=r"redis-cluster://:\*\*\*@"):
            generate(raising, ids)
    finally:
        cluster.stop()


def test_sentinel_reads_from_the_replica_when_asked(sentinel):
    writer = redis_engine(sentinel.url)
    ids = writer.compile(list(DOCS))
    sentinel.client(sentinel.master_port()).execute_command("WAIT", 1, 5000)
    reader = redis_engine(sentinel.url, redis_read_from_replicas=True)
    gets = _replica_gets(sentinel)
    assert generate(reader, ids) == generate(writer, ids)
    assert _replica_gets(sentinel) >= gets + 3 * 2  # every chunk's metadata and parts came from the replica


def _replica_gets(sentinel: SentinelSetup) -> int:
    return sentinel.client(sentinel.replica).info("commandstats").get("cmdstat_get", {}).get("calls", 0)


def test_sentinel_failover_under_a_live_engine(sentinel):
    """Last in the file: kill the master; the same engine reads and writes through the promoted replica."""
    engine = redis_engine(sentinel.url)
    ids = engine.compile(list(DOCS))
    local = make_engine("stories260K")
    assert local.compile(list(DOCS)) == ids
    expected = generate(local, ids)
    old = sentinel.master_port()
    sentinel.client(old).execute_command("WAIT", 1, 5000)  # the replica has every chunk before the kill
    assert sentinel.fail_over() == sentinel.replica
    assert generate(engine, ids, from_redis=True) == expected  # read from the new master
    (new_id,) = engine.compile(["A chunk written after the failover."])
    assert sentinel.client(sentinel.replica).exists(f"pic:{engine.fingerprint}:{new_id}:meta")


def test_unreachable_cluster_starts_and_fails_like_a_single_server():
    """No node answers: the engine still starts; a lookup is a logged miss or StoreUnavailableError."""
    url = Cluster.url_for(free_ports(2, bus=True))
    missing = redis_engine(url, on_redis_error="miss")
    with pytest.raises(pic.UnknownCacheIdError, match="cannot be connected"):
        generate(missing, ["0" * 32])
    with pytest.raises(pic.StoreUnavailableError, match=r"Redis at redis-cluster://:\*\*\*@127.0.0.1:\d+,"):
        generate(redis_engine(url), ["0" * 32])
