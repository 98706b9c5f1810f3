"""``pic serve`` while its store fails (issue 40): a real uvicorn server over a real redis-server paused with
SIGSTOP and a disk tier with a FIFO in a chunk's name. Store calls run on a pool of their own, so however many
are stuck, a request that needs no store is served; an open breaker answers monitoring and describing at once."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import pic
from pic.serve.app import build_app
from tests.local_redis import wait_until
from tests.models import DOCS, QUERY, model, tokenizer
from tests.redis_server import Paused
from tests.serving import serving
from tests.test_redis import redis_tier

NUM_STUCK = 16
FIFO_ID = "f" * 32  # a well-formed cache id, held by a FIFO in the disk tier's directory


@pytest.fixture
def stalled(tmp_path, paused_redis: Paused) -> Iterator[tuple[str, pic.PIC, list[str]]]:
    """A server over a disk tier and a Redis (30 s socket timeout: a stuck call stays stuck for the test's length);
    yields its URL, its engine and the ids of DOCS, compiled while Redis answered."""
    store = pic.StoreConfig(disk_path=str(tmp_path / "disk"), disk_bytes=1 << 30, redis_url=paused_redis.url,
                            redis_timeout_s=30.0, tier_retry_s=600)  # fmt: skip
    engine = pic.PIC(model("stories260K"), tokenizer(), store=store)
    with serving(build_app(engine, model_name="stories260K")) as url:
        compiled = httpx.post(f"{url}/v1/chunks", json={"documents": list(DOCS)}, timeout=60).json()
        assert compiled["tiers"] == [["device", "disk", "redis"]] * len(DOCS)
        (folder,) = (tmp_path / "disk").iterdir()
        os.mkfifo(folder / f"{FIFO_ID}.kv")
        yield url, engine, compiled["cache_ids"]
    engine.close()


def test_a_completion_without_documents_never_waits_on_stuck_store_calls(stalled, paused_redis):
    """Issue 40, item 4 and "Accepted when" 3: 16 GETs of a chunk stuck on a paused Redis (each waits out a 30 s
    timeout), and a GET of the id a FIFO holds on disk (which used to hang forever): a completion without
    documents is answered while every one of them is still waiting. Once Redis answers, they all do too."""
    url, engine, ids = stalled
    breaker = redis_tier(engine).breaker
    before = breaker.num_allowed
    paused_redis.pause()
    with ThreadPoolExecutor(NUM_STUCK + 1) as pool, httpx.Client(base_url=url, timeout=120) as http:
        gets = [pool.submit(http.get, f"/v1/chunks/{ids[0]}") for _ in range(NUM_STUCK)]
        gets.append(pool.submit(http.get, f"/v1/chunks/{FIFO_ID}"))
        wait_until(lambda: breaker.num_allowed - before >= NUM_STUCK + 1, "every GET to be stuck on Redis")
        start = time.perf_counter()
        done = http.post("/v1/completions", json={"model": "stories260K", "prompt": QUERY, "max_tokens": 8})
        elapsed = time.perf_counter() - start
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 8
        assert not any(get.done() for get in gets), "a store call returned: the test proves nothing"
        print(f"no-document completion: {elapsed:.3f} s with {NUM_STUCK + 1} store calls stuck")
        paused_redis.resume()
        answers = [get.result() for get in gets]
    assert [a.status_code for a in answers] == [200] * NUM_STUCK + [404]
    assert answers[0].json()["tiers"] == ["device", "disk", "redis"]
    assert FIFO_ID in answers[-1].json()["error"]["message"]


def test_monitoring_and_describing_answer_at_once_while_the_breaker_is_open(tmp_path, paused_redis):
    """Issue 40, item 9: during a Redis stall, ``/metrics`` and a GET of a chunk in the pool used to take the socket
    timeout each time. The first call pays it and opens the breaker; then neither touches Redis until a probe is
    due, and both say what is true: Redis down and not writable, the chunk in the pool."""
    store = pic.StoreConfig(redis_url=paused_redis.url, redis_timeout_s=2.0, tier_retry_s=600)
    engine = pic.PIC(model("stories260K"), tokenizer(), store=store)
    (cid,) = engine.compile([DOCS[0]])
    breaker = redis_tier(engine).breaker
    with serving(build_app(engine, model_name="stories260K")) as url, httpx.Client(base_url=url, timeout=60) as http:
        paused_redis.pause()
        assert http.get(f"/v1/chunks/{cid}").json()["tiers"] == ["device"]  # pays one timeout: the breaker opens
        assert breaker.is_open
        allowed = breaker.num_allowed
        text = http.get("/metrics").text
        assert 'pic_store_up{tier="redis"} 0.0' in text and 'pic_store_writable{tier="redis"} 0.0' in text
        assert http.get(f"/v1/chunks/{cid}").json()["tiers"] == ["device"]
        assert breaker.num_allowed == allowed  # neither waited on Redis
        assert http.delete(f"/v1/chunks/{cid}").status_code == 503  # nor said "deleted" (item 9)
    engine.close()


def test_a_damaged_chunk_file_is_a_404_by_get_but_a_link_compiles_it_again(tmp_path):
    """Issue 40, item 9, as documented (docs/store.md): a chunk whose file is damaged is in no tier, so GET says
    404; a link by its id in the server that compiled it is served, compiled again from the tokens the engine
    remembers, and written back."""
    store = pic.StoreConfig(disk_path=str(tmp_path), disk_bytes=1 << 30, cpu_bytes=0)
    engine = pic.PIC(model("stories260K"), tokenizer(), store=store, config=pic.PICConfig(kv_pool_tokens=1024))
    with serving(build_app(engine, model_name="stories260K")) as url, httpx.Client(base_url=url, timeout=60) as http:
        (cid,) = http.post("/v1/chunks", json={"documents": [DOCS[0]]}).json()["cache_ids"]
        with engine.paused() as core:
            core.pool.drop(cid)  # evicted from the pool: the file is the only copy
        (path,) = tmp_path.rglob(f"{cid}.kv")
        path.write_bytes(path.read_bytes()[:-7])  # truncated
        assert http.get(f"/v1/chunks/{cid}").status_code == 404
        body = {"model": "stories260K", "prompt": QUERY, "max_tokens": 4, "pic": {"cache_ids": [cid]}}
        assert http.post("/v1/completions", json=body).status_code == 200
        wait_until(lambda: http.get(f"/v1/chunks/{cid}").json().get("tiers") == ["device", "disk"], "the write-back")
    engine.close()


def test_an_unknown_id_says_ids_belong_to_one_model():
    """Issue 40, item 3: an id another model's server returned is unknown here; the error says why it may be."""
    engine = pic.PIC(model("stories260K"), tokenizer())
    with serving(build_app(engine, model_name="stories260K")) as url:
        body = {"model": "stories260K", "prompt": QUERY, "pic": {"cache_ids": ["0" * 32]}}
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 404
    assert "Ids belong to one model" in answer.json()["error"]["message"]
    engine.close()


@pytest.mark.parametrize("on_error", ["raise", "miss"])
def test_pic_serve_starts_on_a_full_disk_serves_what_is_on_it_and_its_check_writes_nothing(
    small_disk, monkeypatch, capsys, on_error
):
    """Issue 40, item 8: ``pic serve`` on a full disk exited 1 ("cannot start: [Errno 28]", or its start-up check's
    compile failed writing), so a crashed server could not come back to serve what was on disk; and that check wrote
    its 3 chunks into every disk tier. Now it starts with the tier's writes paused (said on the log), serves the
    chunks on disk, and the check leaves the directory as it was."""
    import uvicorn as uvicorn_module
    from fastapi.testclient import TestClient

    from pic.cli import main
    from tests.full_disk import fill
    from tests.serving import free_port

    store = pic.StoreConfig(disk_path=str(small_disk), disk_bytes=1 << 30)
    first = pic.load(store=store)
    ids = first.compile(list(DOCS))
    first.close()
    for usage in small_disk.glob("*/.usage"):  # (else the start may rewrite it in place, needing no new block)
        usage.unlink()
    fill(small_disk)
    before = sorted(p.name for p in small_disk.rglob("*"))
    apps = []
    monkeypatch.setattr(uvicorn_module.Server, "run", lambda server, sockets=None: apps.append(server.config.app))
    argv = ["serve", "--port", str(free_port()), "--disk-path", str(small_disk), "--disk-bytes", "1G"]
    assert main([*argv, "--on-disk-error", on_error]) == 0, capsys.readouterr().err
    assert sorted(p.name for p in small_disk.rglob("*")) == before  # the check wrote nothing
    engine = apps[0].state.engine.engine
    with TestClient(apps[0]) as http:
        assert http.get(f"/v1/chunks/{ids[0]}").json()["tiers"] == ["disk"]
        body = {"model": "stories260K", "prompt": QUERY, "max_tokens": 4, "pic": {"cache_ids": ids}}
        assert http.post("/v1/completions", json=body).status_code == 200
        assert 'pic_store_writable{tier="disk"} 0.0' in http.get("/metrics").text
    engine.close()
