"""A lease flood against a real ``pic serve`` on a real redis-server: does the server still answer ``/metrics``, a
chunk's description and other compiles while compiles of leased documents wait?

python benchmarks/lease_flood.py --out benchmarks/results/lease_flood.json                 # stories260K
python benchmarks/lease_flood.py --model smollm2 --out ...

Issue 63: whoever can write the fleet's Redis plants a lease key under ``{ns}:fleet:{fp}:lease:{id}`` for a document's
id; that document's compile then waited up to 300 s, and 64 such compiles filled the server's 64 store threads, so
``GET /v1/chunks/{id}``, ``/metrics``, compiles and inline-document completions hung. Two floods, each of
``--compiles`` concurrent compiles of documents whose leases were planted first:

- *planted*: leases with no expiry (the issue's probe; also an hour's, and a key of another type);
- *renewed*: leases that look live (a TTL within the fleet's lease life), renewed by the attacker every half second,
  so that each compile of them waits as on a live worker;
- *none*: the same compiles with no lease planted, the control: what the compiles' own work costs the probes.

During each, ``--probes`` times each: ``GET /metrics``, ``GET /v1/chunks/{id}`` of a chunk compiled before, and a
compile of a new document (no lease). Reported: each probe's median and longest answer, the flood's compiles' wall
time, and how many of them waited. The ids are computed in this process from the same model (pic's public
``chunk_id``): a Redis writer knows the model and the documents' text.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import redis

import pic
from pic.ids import chunk_id

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from engine_flood import machine, write_report  # noqa: E402
from tenant_oracle import Server  # noqa: E402  (a pic serve process, keys in its environment)

from tests.local_redis import LocalRedis  # noqa: E402

KEY = "lease-flood-key-0123456789"


def plant(client: redis.Redis, prefix: str, ids: list[str], how: str) -> None:
    """Lease keys for ``ids``: none (``none``: the control), no expiry, an hour, another type, or (``renewed``) a
    live-looking two seconds."""
    if how == "none":
        return
    for i, cid in enumerate(ids):
        key = f"{prefix}lease:{cid}"
        if how == "renewed":
            client.set(key, "attacker", px=2000)
        elif i % 3 == 0:
            client.set(key, "attacker")  # no expiry
        elif i % 3 == 1:
            client.set(key, "attacker", px=3600 * 1000)  # an hour
        else:
            client.hset(key, "x", "1")  # another type


def renew(client: redis.Redis, prefix: str, ids: list[str], stop: threading.Event) -> None:
    while not stop.wait(0.5):
        for cid in ids:
            client.set(f"{prefix}lease:{cid}", "attacker", px=2000)


def timed(call) -> float:
    start = time.perf_counter()
    response = call()
    response.raise_for_status()
    return time.perf_counter() - start


def flood(server: Server, engine: pic.PIC, client: redis.Redis, how: str, args, known: str, tag: str) -> dict:
    docs = [f"Flooded document {tag} {i}: the lantern by the river." for i in range(args.compiles)]
    ids = [chunk_id(engine.fingerprint, engine.tokenizer(d, add_special_tokens=False)["input_ids"],
                    engine.compile_options()) for d in docs]  # fmt: skip
    prefix = f"pic:fleet:{engine.fingerprint}:"
    plant(client, prefix, ids, how)
    stop = threading.Event()
    renewer = threading.Thread(target=renew, args=(client, prefix, ids, stop), daemon=True)
    if how == "renewed":
        renewer.start()
    http = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=600)
    probes: dict[str, list[float]] = {"metrics": [], "describe": [], "compile_other": []}
    started = time.perf_counter()
    with ThreadPoolExecutor(args.compiles) as pool:
        flooded = [pool.submit(timed, lambda d=d: http.post("/v1/chunks", json={"documents": [d]})) for d in docs]
        time.sleep(0.2)  # the flood's compiles are in
        for i in range(args.probes):
            probes["metrics"].append(timed(lambda: http.get("/metrics")))
            probes["describe"].append(timed(lambda: http.get(f"/v1/chunks/{known}")))
            other = {"documents": [f"A fresh document {tag} {i} with no lease."]}
            probes["compile_other"].append(timed(lambda other=other: http.post("/v1/chunks", json=other)))
        times = [f.result() for f in flooded]
    wall = time.perf_counter() - started
    stop.set()
    http.close()
    return {
        "how": how, "num_compiles": args.compiles, "flood_wall_s": wall,
        "flood_compile_s": {"median": statistics.median(times), "max": max(times)},
        "probes_s": {name: {"median": statistics.median(v), "max": max(v), "all": v} for name, v in probes.items()},
        "max_probe_s": max(max(v) for v in probes.values()),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="stories260K")
    parser.add_argument("--compiles", type=int, default=64)
    parser.add_argument("--probes", type=int, default=5)
    parser.add_argument("--out", default=str(HERE / "results" / "lease_flood.json"))
    args = parser.parse_args()
    started = time.perf_counter()
    engine = pic.load() if args.model == "stories260K" else pic.load(args.model)  # the server's model, for its ids
    with LocalRedis() as local:
        server = Server(args.model, local.url, tenants=None, key=KEY)
        try:
            with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=600) as http:
                known = http.post("/v1/chunks", json={"documents": ["A known document."]}).json()["cache_ids"][0]
            floods = [
                flood(server, engine, local.client(), how, args, known, how) for how in ("none", "planted", "renewed")
            ]
        finally:
            server.close()
    engine.close()
    report = {"command": " ".join(["python", *sys.argv]), "machine": machine(), "model": args.model, "floods": floods,
              "wall_s": time.perf_counter() - started}  # fmt: skip
    write_report(report, args.out)
    for f in floods:
        print(
            f"{f['how']}: {f['num_compiles']} flooded compiles took {f['flood_wall_s']:.1f} s (longest "
            f"{f['flood_compile_s']['max']:.1f} s); meanwhile the longest /metrics "
            f"{f['probes_s']['metrics']['max']:.2f} s, describe {f['probes_s']['describe']['max']:.2f} s, other "
            f"compile {f['probes_s']['compile_other']['max']:.2f} s"
        )


if __name__ == "__main__":
    main()
