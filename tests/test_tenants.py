"""Two tenants of one real ``pic serve`` app (uvicorn on a loopback port, ``--tenants`` as a file), probed as a
second tenant would: B's reads, deletes and links of A's ids answer exactly what an id nobody compiled answers, B's
compile of A's document is a new chunk of B's, A's chunks survive B filling the pool, and a shared namespace is
read, not written, by its readers."""

from __future__ import annotations

import secrets

import httpx
import pytest

import pic
from pic.ids import chunk_id
from pic.serve.app import build_app
from pic.serve.tenants import load_tenants
from tests.models import model, tokenizer
from tests.serving import serving

KEYS = {name: f"{name}-{secrets.token_hex(12)}" for name in ("alice", "bob", "corpus")}
MEMO = "Alice's memo: the launch code is 4417 and the meeting moved to Tuesday."
POOL_TOKENS = 2048  # 128 blocks of 16: small, so that bob's compiles fill it


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Tenants alice (a quarter of the pool kept for her chunks, reads the corpus), bob (a rate limit) and corpus (an
    operator's, which fills the shared namespace); yields ``(url, engine, tenants)``."""
    folder = tmp_path_factory.mktemp("tenants")
    path = folder / "tenants.toml"
    path.write_text(
        '[tenants.alice]\nkey_env = "ALICE"\nreads = ["corpus"]\nkv_share = 0.25\n'
        '[tenants.bob]\nkey_env = "BOB"\nrequests_per_s = 1000\nburst = 1000\n'
        '[tenants.corpus]\nkey_env = "CORPUS"\n'
    )
    tenants = load_tenants(path, environ={"ALICE": KEYS["alice"], "BOB": KEYS["bob"], "CORPUS": KEYS["corpus"]})
    config = pic.PICConfig(kv_pool_tokens=POOL_TOKENS, quotas=tenants.quotas)
    engine = pic.PIC(model("stories260K"), tokenizer(), config=config)
    with serving(build_app(engine, model_name="stories260K", tenants=tenants)) as url:
        yield url, engine, tenants
    engine.close()


def _as(server, name: str) -> httpx.Client:
    return httpx.Client(base_url=server[0], headers={"Authorization": f"Bearer {KEYS[name]}"}, timeout=60)


def _compile(server, name: str, docs: list[str]) -> list[str]:
    with _as(server, name) as http:
        response = http.post("/v1/chunks", json={"documents": docs})
    assert response.status_code == 200, response.text
    return response.json()["cache_ids"]


def _link(http: httpx.Client, ids: list[str], prompt: str = "Repeat the document above word for word.") -> httpx.Response:  # noqa: E501
    body = {"model": "stories260K", "prompt": prompt, "max_tokens": 8, "temperature": 0, "pic": {"cache_ids": ids}}
    return http.post("/v1/completions", json=body)


def _never_compiled(engine) -> str:
    """An id of the same form that no tenant compiled (a document nobody sent, in a namespace nobody has)."""
    return chunk_id(engine.fingerprint, [7, 8, 9], engine.compile_options(), secrets.token_bytes(16))


def _same_but_id(foreign: httpx.Response, never: httpx.Response, foreign_id: str, never_id: str) -> None:
    assert foreign.status_code == never.status_code == 404
    assert foreign.headers["content-type"] == never.headers["content-type"]
    assert foreign.content.replace(foreign_id.encode(), b"ID") == never.content.replace(never_id.encode(), b"ID")


def test_b_reads_deletes_and_links_a_chunk_as_one_nobody_compiled(server):
    (memo,) = _compile(server, "alice", [MEMO])
    never = _never_compiled(server[1])
    with _as(server, "bob") as bob:
        for method, path in (("GET", "/v1/chunks/{}"), ("DELETE", "/v1/chunks/{}")):
            foreign, unknown = bob.request(method, path.format(memo)), bob.request(method, path.format(never))
            _same_but_id(foreign, unknown, memo, never)
        _same_but_id(_link(bob, [memo]), _link(bob, [never]), memo, never)
        streamed = bob.post("/v1/completions", json={"model": "stories260K", "prompt": "Go", "stream": True,
                                                     "pic": {"cache_ids": [memo]}})  # fmt: skip
        assert streamed.status_code == 404  # refused before the stream: nothing of the memo's reaches B
    with _as(server, "alice") as alice:  # A's chunk is still there, untouched by B's delete
        assert alice.get(f"/v1/chunks/{memo}").status_code == 200
        linked = _link(alice, [memo])
        assert linked.status_code == 200, linked.text


def test_b_compiling_a_document_a_compiled_gets_a_chunk_of_its_own(server):
    (mine,) = _compile(server, "alice", [MEMO + " Again."])
    (theirs,) = _compile(server, "bob", [MEMO + " Again."])
    assert mine != theirs
    with _as(server, "bob") as bob:
        assert bob.get(f"/v1/chunks/{theirs}").status_code == 200
        assert bob.get(f"/v1/chunks/{mine}").status_code == 404
    with _as(server, "alice") as alice:
        assert alice.get(f"/v1/chunks/{theirs}").status_code == 404
        assert alice.delete(f"/v1/chunks/{mine}").json() == {"id": mine, "deleted": True}
    with _as(server, "bob") as bob:  # A's delete of her copy leaves B's
        assert bob.get(f"/v1/chunks/{theirs}").status_code == 200


def test_a_chunks_survive_b_filling_the_pool(server):
    engine = server[1]
    kept = _compile(server, "alice", [f"Alice's note {i}: the garden needs water on day {i}." for i in range(3)])
    # bob compiles about four pools' worth, a few documents at a time
    for start in range(0, 64, 8):
        fillers = [f"Bob's filler {i}: " + "the cat sat on the mat. " * 6 for i in range(start, start + 8)]
        _compile(server, "bob", fillers)
    with _as(server, "alice") as alice:
        for cid in kept:
            described = alice.get(f"/v1/chunks/{cid}").json()
            assert "device" in described["tiers"], described  # still resident: B never evicted it
        assert _link(alice, kept).status_code == 200
    with engine.paused() as core:
        assert core.pool.num_evicted_chunks > 0  # B's compiles did fill the pool: they evicted B's own chunks
        assert core.pool.usage("alice") <= core.pool.share("alice")  # within the share that kept them


def test_a_shared_namespace_is_read_by_its_readers_and_written_by_its_owner(server):
    (fact,) = _compile(server, "corpus", ["The river Elbe flows into the North Sea."])
    with _as(server, "alice") as alice:  # alice reads the corpus
        assert alice.get(f"/v1/chunks/{fact}").status_code == 200
        assert _link(alice, [fact], "Where does the Elbe flow?").status_code == 200
        assert alice.delete(f"/v1/chunks/{fact}").status_code == 404  # a reader deletes nothing
    with _as(server, "bob") as bob:  # bob does not read it
        assert bob.get(f"/v1/chunks/{fact}").status_code == 404
        assert _link(bob, [fact]).status_code == 404
    with _as(server, "corpus") as corpus:
        assert corpus.get(f"/v1/chunks/{fact}").status_code == 200


def test_keys_are_checked_and_rates_held(server, tmp_path):
    with httpx.Client(base_url=server[0], headers={"Authorization": "Bearer wrong-key-0123456789"}) as stranger:
        assert stranger.get("/v1/models").status_code == 401
    with httpx.Client(base_url=server[0]) as anonymous:
        assert anonymous.get("/v1/models").status_code == 401
        assert anonymous.get("/health").status_code == 200
    path = tmp_path / "limited.toml"
    path.write_text('[tenants.slow]\nkey_env = "SLOW"\nrequests_per_s = 0.01\nburst = 2\n')
    tenants = load_tenants(path, environ={"SLOW": KEYS["alice"]})
    app = build_app(server[1], model_name="stories260K", tenants=tenants)
    with serving(app) as url, httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEYS['alice']}"}) as http:
        statuses = [http.get("/v1/models").status_code for _ in range(4)]
        assert statuses == [200, 200, 429, 429]  # two at once, then one a hundred seconds
        refused = http.get("/v1/models")
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["type"] == "rate_limit_exceeded"
        assert http.get("/health").status_code == 200  # not counted
    assert "429" in app.openapi()["paths"]["/v1/models"]["get"]["responses"]  # declared where a tenant has a rate
