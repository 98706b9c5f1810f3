"""How long ``GET /health`` takes while large request bodies are being parsed (issue 63: 16 bodies of 5.6 MB
stalled the event loop, ``/health`` 2.5 s).

git archive 455029c | tar -x -C /tmp/pic-before   # the code before the change
python benchmarks/serve_big_bodies.py --tree before=/tmp/pic-before --tree after=. \
    --out benchmarks/results/serve_big_bodies.json

One real ``pic serve`` process per ``--tree LABEL=DIR`` (that source tree on ``PYTHONPATH``; default: this
checkout), each serving the embedded stories260K with ``--api-key`` and ``--skip-check``, all started first and
measured in turn, round by round (A B A B: the machine's noise falls on each alike). A round: ``--clients`` threads
(16) each POST one body of about ``--mb`` MB (5.6) at once; meanwhile one thread asks ``GET /health`` again and
again (each 5 ms after the last answer) and times each answer. Bodies, each a body
the server parses as JSON and then refuses (nothing reaches the engine, so what is timed is the body's parse and
validation):

- ``numbers``: a completion whose ``pic.relevance`` is a list of ~1.4 million small numbers (a 422: over 5,120
  scores): many small JSON values, the slowest kind to parse;
- ``strings``: a completion with ``pic.cache_ids`` of 4,096 unknown ids of ~1.4 KB (a 422: the list is at most
  4,096... long ids; a 404 when the list fits);
- ``prompt``: a completion with one prompt string of the whole size (a 400: longer than any prompt could be).

Reported per tree and kind: ``/health``'s p50, p99 and max (ms) while bodies were in flight (all rounds pooled),
and alone (1 s before the rounds), with the statuses the bodies got.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
KEY = "bench-key"
KINDS = ("numbers", "strings", "prompt")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def body(kind: str, num_bytes: int) -> bytes:
    """One request body of about ``num_bytes`` bytes of the given kind (see the module's docstring)."""
    head = {"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 1}
    if kind == "numbers":
        head["pic"] = {"relevance": [0.5] * (num_bytes // 4)}
    elif kind == "strings":
        head["pic"] = {"cache_ids": ["ab" * (num_bytes // 4096 // 2)] * 4096}
    else:
        head["prompt"] = "x" * num_bytes
    return json.dumps(head, separators=(",", ":")).encode()


def _serve(port: int, tree: Path) -> subprocess.Popen:
    args = [sys.executable, "-m", "pic", "serve", "--port", str(port), "--api-key", KEY, "--skip-check"]
    args += ["--max-body-bytes", str(8 << 20)]
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=tree)


def _wait_healthy(proc: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit("pic serve exited")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        time.sleep(0.2)
    raise SystemExit("pic serve did not come up")


def _health_times(url: str, stop: threading.Event, times: list[float]) -> None:
    with httpx.Client(base_url=url, timeout=60) as http:
        while not stop.is_set():
            start = time.perf_counter()
            http.get("/health")
            times.append(time.perf_counter() - start)
            time.sleep(0.005)


def _flood(url: str, data: bytes, clients: int) -> list[int]:
    """``clients`` threads each POST ``data`` once, all at once; the statuses."""
    statuses: list[int] = []
    barrier = threading.Barrier(clients)

    def one() -> None:
        headers = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
        with httpx.Client(base_url=url, timeout=300, headers=headers) as http:
            barrier.wait()
            statuses.append(http.post("/v1/completions", content=data).status_code)

    threads = [threading.Thread(target=one) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return statuses


def _summary(times: list[float]) -> dict[str, float]:
    ms = sorted(t * 1000 for t in times)
    return {
        "count": len(ms),
        "p50_ms": statistics.median(ms),
        "p99_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))],
        "max_ms": ms[-1],
    }


def _alone(url: str) -> list[float]:
    """``/health``'s times over 1 s with nothing else sent."""
    times: list[float] = []
    stop = threading.Event()
    poller = threading.Thread(target=_health_times, args=(url, stop, times))
    poller.start()
    time.sleep(1.0)
    stop.set()
    poller.join()
    return times


def _round(url: str, data: bytes, clients: int) -> tuple[list[float], list[int], float]:
    """One flood of ``clients`` bodies: ``/health``'s times meanwhile, the statuses, the flood's seconds."""
    times: list[float] = []
    stop = threading.Event()
    poller = threading.Thread(target=_health_times, args=(url, stop, times))
    poller.start()
    start = time.perf_counter()
    statuses = _flood(url, data, clients)
    seconds = time.perf_counter() - start
    stop.set()
    poller.join()
    return times, statuses, seconds


def measure(urls: dict[str, str], kind: str, *, num_bytes: int, clients: int, rounds: int) -> list[dict]:
    """Each server's ``/health`` times alone, then during ``rounds`` floods of ``kind``, the servers in turn."""
    data = body(kind, num_bytes)
    alone = {label: _alone(url) for label, url in urls.items()}
    during: dict[str, list[float]] = {label: [] for label in urls}
    statuses: dict[str, set[int]] = {label: set() for label in urls}
    flood_s: dict[str, float] = dict.fromkeys(urls, 0.0)
    for _ in range(rounds):
        for label, url in urls.items():
            times, got, seconds = _round(url, data, clients)
            during[label] += times
            statuses[label] |= set(got)
            flood_s[label] += seconds
    return [
        {
            "tree": label,
            "kind": kind,
            "body_bytes": len(data),
            "statuses": sorted(statuses[label]),
            "flood_s": flood_s[label],
            "alone": _summary(alone[label]),
            "during": _summary(during[label]),
        }
        for label in urls
    ]


def _tree(text: str) -> tuple[str, Path]:
    label, sep, folder = text.partition("=")
    if not sep or not (Path(folder) / "pic" / "__init__.py").is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is not LABEL=DIR of a source tree holding pic/")
    return label, Path(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=_tree, action="append", default=[], metavar="LABEL=DIR")
    parser.add_argument("--out", default=None)
    parser.add_argument("--mb", type=float, default=5.6)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    args = parser.parse_args()
    trees = dict(args.tree or [("this", HERE.parent)])
    procs, urls = [], {}
    try:
        for label, tree in trees.items():
            port = _free_port()
            urls[label] = f"http://127.0.0.1:{port}"
            procs.append(_serve(port, tree))
        for proc, url in zip(procs, urls.values(), strict=True):
            _wait_healthy(proc, url)
        results = [
            row
            for kind in args.kinds
            for row in measure(urls, kind, num_bytes=int(args.mb * 1e6), clients=args.clients, rounds=args.rounds)
        ]
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)
    report = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "trees": {label: str(tree) for label, tree in trees.items()},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "results": results,
    }
    for r in results:
        d, a = r["during"], r["alone"]
        print(
            f"{r['tree']:8} {r['kind']:8} {r['body_bytes'] / 1e6:.1f} MB x {args.clients} x {args.rounds} "
            f"({r['statuses']}): /health p50 {d['p50_ms']:.1f} ms, p99 {d['p99_ms']:.1f} ms, max {d['max_ms']:.1f} ms "
            f"(alone: p50 {a['p50_ms']:.1f}, max {a['max_ms']:.1f}); floods {r['flood_s']:.1f} s"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
