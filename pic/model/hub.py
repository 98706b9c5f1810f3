"""Reaching the Hugging Face Hub: fail at once offline, and suggest the name a user probably meant.

Without a network, huggingface_hub asks the Hub for each of a model's files five times with back-off before
transformers reads its cache: on a machine without a route out, ``pic.load("nonexistent-model-xyz")`` took
tens of seconds to fail, and a model in the cache longer to load (docs/models.md#offline).
pic asks the operating system first whether the Hub's host answers a TCP connection (at most
``HUB_CHECK_TIMEOUT_S``); when it does not, or ``HF_HUB_OFFLINE`` is set, transformers reads only the cache,
which answers in well under a second. ``PIC_HUB_CHECK=0`` skips the check (for a network where a direct
connection fails but the Hub's own client gets through).
"""

from __future__ import annotations

import difflib
import os
import socket
import threading
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass

HUB_CHECK_TIMEOUT_S = 2.0
_TRUE = {"1", "ON", "YES", "TRUE"}  # huggingface_hub's reading of a boolean environment variable


@dataclass(frozen=True)
class HubAccess:
    """Whether a load may ask the Hub, and, when it may not, why (for the error message)."""

    online: bool
    reason: str = ""


def hub_access(timeout_s: float = HUB_CHECK_TIMEOUT_S) -> HubAccess:
    """Offline when ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set, or when the Hub's host (or the
    HTTPS proxy in front of it) does not accept a connection within ``timeout_s``."""
    if _offline_mode():
        return HubAccess(False, "HF_HUB_OFFLINE is set")
    if os.environ.get("PIC_HUB_CHECK", "").strip().upper() in {"0", "OFF", "NO", "FALSE"}:
        return HubAccess(True)
    host, port = _hub_address()
    failure = connect_failure(host, port, timeout_s)
    if failure is None:
        return HubAccess(True)
    return HubAccess(False, f"{host}:{port} is out of reach: {failure}")


def connect_failure(host: str, port: int, timeout_s: float) -> str | None:
    """Why ``host:port`` does not accept a TCP connection within ``timeout_s``, name lookup included, or
    ``None`` when it does.

    The lookup has no timeout of its own (a resolver that does not answer can take tens of seconds), so
    the attempt runs on a daemon thread that is abandoned when the time is up.
    """
    done = threading.Event()
    failures: list[str | None] = []

    def attempt() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            failures.append(None)
        except (OSError, ValueError) as exc:  # refused, unreachable, no such name, timed out; a bad port
            failures.append(getattr(exc, "strerror", None) or str(exc) or type(exc).__name__)
        finally:
            done.set()

    threading.Thread(target=attempt, name="pic-hub-check", daemon=True).start()
    if not done.wait(timeout_s):
        return f"no answer within {timeout_s:g} s"
    return failures[0] if failures else "the check failed"


def close_model_name(name: str, known: Mapping[str, str]) -> str | None:
    """The short model name (``"smollm2"``) of ``known`` (short name -> the model's own name) that ``name``
    probably meant, or ``None``.

    ``name``'s last path part matches a known model's full name in any case
    (``"HuggingFaceTB/SmolLM2-135M-Instruct"``), or is within a typo of a short name (``"smollm3"``,
    ``"smolm2"``).
    """
    last = name.strip().rstrip("/").rsplit("/", 1)[-1].lower()
    for short, full in known.items():
        if last == full.lower():
            return short
    close = difflib.get_close_matches(last, list(known), n=1, cutoff=0.75)
    return close[0] if close else None


def _offline_mode() -> bool:
    """huggingface_hub's offline flag, or the environment variable set after huggingface_hub read it."""
    import huggingface_hub.constants

    if huggingface_hub.constants.is_offline_mode():
        return True
    return any(os.environ.get(v, "").strip().upper() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _hub_address() -> tuple[str, int]:
    """``(host, port)`` a Hub request connects to first: the HTTPS proxy's when one is set and the Hub's
    host is not exempt from it, else the endpoint's (``HF_ENDPOINT``, default huggingface.co)."""
    import huggingface_hub.constants

    endpoint = urllib.parse.urlsplit(huggingface_hub.constants.ENDPOINT)
    host = endpoint.hostname or "huggingface.co"
    proxy = urllib.request.getproxies().get(endpoint.scheme or "https")
    if proxy and not urllib.request.proxy_bypass(host):
        target = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        if target.hostname:
            return target.hostname, _port(target)
    return host, _port(endpoint)


def _port(url: urllib.parse.SplitResult) -> int:
    try:
        explicit = url.port
    except ValueError:  # a malformed port: let the connection attempt say no
        explicit = None
    return explicit or (80 if url.scheme == "http" else 443)
