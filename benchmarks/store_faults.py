"""What a stalled Redis, a FIFO in the disk tier and a full disk cost a running ``pic serve`` (issue 40's campaign).

python benchmarks/store_faults.py            # writes benchmarks/results/store_faults.json (~3 minutes)
python benchmarks/store_faults.py --quick    # 1 s Redis timeouts, fewer requests: a smoke run (the tests)

Real processes, as an operator meets them: ``pic serve`` subprocesses over the embedded model, a real
``redis-server`` frozen with SIGSTOP (it keeps accepting connections and answers nothing, so every command waits
out the socket timeout), a real FIFO named like a chunk file, and a real full file system (a 2 MiB tmpfs, mounted
as root; skipped, and said so in the JSON, where that is impossible). Wall times of single HTTP requests on this
machine: they show waits of seconds against milliseconds, not speeds.

- ``stall``, for ``--on-redis-error raise`` and ``miss``: 8 GETs of chunks in the pool sent in parallel while Redis
  is frozen, then a completion without documents (issue 40: 9.58 s, and 30 s timeouts under ``miss``), ``/metrics``
  twice, a compile of new documents twice (``miss``: 45 s for a 45 s stall); then Redis thaws, and under ``miss``
  the time until the chunks compiled meanwhile are in Redis without anyone asking.
- ``fifo``: 10 GETs of the id whose file is a FIFO (they hung forever), then a completion.
- ``disk_full`` (``--on-disk-error miss``): compiles on a full disk (120 answered 200, 6 written), what their
  answers say, whether the chunks reach the disk once there is room, and how many a restarted server finds
  (114 of 140 were 404s); then a start on the full disk in ``raise`` mode (it exited 1).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.full_disk import fill  # noqa: E402
from tests.local_redis import LocalRedis, free_port  # noqa: E402

MODEL = "stories260K"
PROMPT = "Once upon a time"


class Server:
    """A ``pic serve`` subprocess on a free port."""

    def __init__(self, *flags: str) -> None:
        self.port = free_port()
        argv = [sys.executable, "-m", "pic", "serve", "--port", str(self.port), *flags]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=300)

    def wait_up(self) -> bool:
        """Whether it came up (``False``: it exited)."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and self.proc.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                if self.http.get("/health", timeout=1).status_code == 200:
                    return True
            time.sleep(0.2)
        return False

    def timed(self, method: str, path: str, **kwargs) -> tuple[float, httpx.Response]:
        start = time.perf_counter()
        response = self.http.request(method, path, **kwargs)
        return time.perf_counter() - start, response

    def complete(self) -> tuple[float, int]:
        """A completion without documents: its wall time and status."""
        seconds, response = self.timed("POST", "/v1/completions", json={"model": MODEL, "prompt": PROMPT,
                                                                         "max_tokens": 8})  # fmt: skip
        return round(seconds, 3), response.status_code

    def compile(self, docs: list[str]) -> tuple[float, httpx.Response]:
        return self.timed("POST", "/v1/chunks", json={"documents": docs})

    def stop(self) -> str:
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=60)
        return out


def documents(tag: str, n: int) -> list[str]:
    return [f"{tag} story {i}: a small fox named Pip found {i} red berries under the old oak tree." for i in range(n)]


def stall(mode: str, *, timeout_s: float, retry_s: float, num_gets: int) -> dict:
    with tempfile.TemporaryDirectory() as workdir:
        redis = LocalRedis(workdir=workdir).start()
        flags = ["--redis-url", redis.url, "--on-redis-error", mode, "--redis-timeout", str(timeout_s),
                 "--tier-retry", str(retry_s)]  # fmt: skip
        server = Server(*flags)
        try:
            assert server.wait_up(), server.stop()
            ids = server.compile(documents("pooled", 4))[1].json()["cache_ids"]
            row = {"baseline_completion_s": [server.complete()[0] for _ in range(3)]}
            os.kill(redis._proc.pid, signal.SIGSTOP)
            frozen = time.perf_counter()
            with ThreadPoolExecutor(num_gets) as pool:
                gets = [pool.submit(server.timed, "GET", f"/v1/chunks/{ids[i % len(ids)]}") for i in range(num_gets)]
                time.sleep(0.5)
                row["completion_during_stuck_gets_s"] = [server.complete() for _ in range(3)]
                row["gets_still_waiting_after_completions"] = sum(not g.done() for g in gets)
                row["gets_s"] = sorted(round(g.result()[0], 3) for g in gets)
            row["metrics_s"] = [round(server.timed("GET", "/metrics")[0], 3) for _ in range(2)]
            new = documents(f"new-{mode}", 8)
            for name, docs in (("compile_new_s", new[:4]), ("compile_new_again_s", new[4:])):
                seconds, response = server.compile(docs)
                row[name] = [round(seconds, 3), response.status_code]
                if response.status_code == 200:
                    row.setdefault("compile_tiers", []).append(sorted({t for ts in response.json()["tiers"]
                                                                       for t in ts}))  # fmt: skip
            row["frozen_for_s"] = round(time.perf_counter() - frozen, 1)
            os.kill(redis._proc.pid, signal.SIGCONT)
            if mode == "miss":
                new_ids = server.compile(new)[1].json()["cache_ids"]  # resident: no work, the same ids
                thawed, deadline = time.perf_counter(), time.monotonic() + 120
                while time.monotonic() < deadline:
                    tiers = [server.http.get(f"/v1/chunks/{cid}").json().get("tiers", []) for cid in new_ids]
                    if all("redis" in t for t in tiers):
                        break
                    time.sleep(0.2)
                row["in_redis_after_thaw"] = sum("redis" in t for t in tiers)
                row["in_redis_after_thaw_s"] = round(time.perf_counter() - thawed, 2)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(redis._proc.pid, signal.SIGCONT)
            server.stop()
            redis.stop()
    return row


def fifo(*, num_gets: int) -> dict:
    with tempfile.TemporaryDirectory() as disk:
        server = Server("--disk-path", disk, "--disk-bytes", "1G")
        try:
            assert server.wait_up(), server.stop()
            server.compile(documents("fifo", 1))
            (folder,) = Path(disk).iterdir()
            cache_id = "f" * 32
            os.mkfifo(folder / f"{cache_id}.kv")
            with ThreadPoolExecutor(num_gets) as pool:
                gets = [pool.submit(server.timed, "GET", f"/v1/chunks/{cache_id}") for _ in range(num_gets)]
                answers = [g.result(timeout=120) for g in gets]
            return {
                "gets_s": sorted(round(s, 3) for s, _ in answers),
                "statuses": sorted({r.status_code for _, r in answers}),
                "completion_after": server.complete(),
            }
        finally:
            server.stop()


@contextlib.contextmanager
def tmpfs(size: str):
    mount = Path(tempfile.mkdtemp(prefix="pic-full-"))
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True,
                          text=True)  # fmt: skip
    if done.returncode != 0:
        yield None, done.stderr.strip() or f"mount exited {done.returncode}"
        return
    try:
        yield mount, None
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def disk_full(*, num_docs: int) -> dict:
    with tmpfs("2m" if num_docs <= 8 else "8m") as (mount, error):  # (40 files of ~60 KB take 2.4 MB)
        if mount is None:
            return {"skipped": f"cannot mount a tmpfs here: {error}"}
        flags = ["--disk-path", str(mount), "--disk-bytes", "1G", "--on-disk-error", "miss", "--tier-retry", "0.5"]
        server = Server(*flags)
        try:
            assert server.wait_up(), server.stop()
            filler = fill(mount)
            answers = [server.compile([doc])[1] for doc in documents("full", num_docs)]
            ids = [a.json()["cache_ids"][0] for a in answers if a.status_code == 200]
            row = {
                "compiles": num_docs,
                "answered_200": len(ids),
                "answers_naming_disk": sum("disk" in a.json()["tiers"][0] for a in answers if a.status_code == 200),
                "files_written_while_full": len(list(mount.rglob("*.kv"))),
            }
            filler.unlink()
            start, deadline = time.perf_counter(), time.monotonic() + 120
            while len(list(mount.rglob("*.kv"))) < len(ids) and time.monotonic() < deadline:
                time.sleep(0.2)
            row["files_after_room_returned"] = len(list(mount.rglob("*.kv")))
            row["written_within_s"] = round(time.perf_counter() - start, 2)
        finally:
            server.stop()
        restarted = Server(*flags)
        try:
            assert restarted.wait_up(), restarted.stop()
            row["found_after_restart"] = sum(restarted.http.get(f"/v1/chunks/{cid}").status_code == 200 for cid in ids)
        finally:
            restarted.stop()
        for usage in mount.glob("*/.usage"):  # what a server that crashed rewriting it leaves
            usage.unlink()
        fill(mount)
        strict = Server("--disk-path", str(mount), "--disk-bytes", "1G")  # raise mode, on the full disk
        try:
            row["raise_mode_starts_on_full_disk"] = strict.wait_up()
            if row["raise_mode_starts_on_full_disk"]:
                row["raise_mode_compile_status"] = strict.compile(documents("strict", 1))[1].status_code
                row["raise_mode_serves_from_disk"] = strict.http.get(f"/v1/chunks/{ids[0]}").json().get("tiers")
        finally:
            out = strict.stop()
        row["raise_mode_start_warning"] = next((line for line in out.splitlines() if "full or read-only" in line), None)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 s Redis timeouts, fewer requests: a smoke run")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    timeout_s, retry_s = (1.0, 1.0) if args.quick else (10.0, 5.0)  # (the full run: pic serve's defaults)
    report = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "redis_timeout_s": timeout_s,
        "tier_retry_s": retry_s,
        "stall": {
            mode: stall(mode, timeout_s=timeout_s, retry_s=retry_s, num_gets=4 if args.quick else 8)
            for mode in ("raise", "miss")
        },
        "fifo": fifo(num_gets=3 if args.quick else 10),
        "disk_full": disk_full(num_docs=8 if args.quick else 40),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / ("store_faults_quick.json" if args.quick else "store_faults.json")
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
