"""An app on a real uvicorn server in a thread, on a free loopback port, with ``pic serve``'s protocol (its read
deadlines): what the serve tests talk to with real clients."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import uvicorn

from pic.serve.protocol import KEEP_ALIVE_S, timed_protocol
from tests.local_redis import free_ports


def free_port() -> int:
    """A free loopback port."""
    return free_ports(1)[0]


@contextlib.contextmanager
def serving(app, *, headers_timeout_s: float = 10.0, body_timeout_s: float = 30.0) -> Iterator[str]:
    """``app`` on uvicorn with ``pic serve``'s protocol on a free loopback port; yields its base URL."""
    port = free_port()
    protocol = timed_protocol(headers_timeout_s=headers_timeout_s, body_timeout_s=body_timeout_s)
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", http=protocol, timeout_keep_alive=KEEP_ALIVE_S
    )
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(30)


def wait_healthy(proc, port: int, *, timeout_s: float = 180.0) -> None:
    """Return once the ``pic serve`` process ``proc`` answers ``/health`` on ``port`` (its output in the failure
    when it exits first; ``timeout_s``: a bound on start-up, generous for a loaded machine, not a measurement)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return
        time.sleep(0.2)
    raise AssertionError("pic serve did not come up")
