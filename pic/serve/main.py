"""``pic serve``: take the port, load and check a model, build the app, run it with uvicorn on that port
(``pip install -e ".[serve]"``)."""

from __future__ import annotations

import argparse
import errno
import ipaddress
import logging
import socket
import sys

from pic.cli_args import (
    byte_size,
    chat_template,
    policy,
    port,
    positive_float,
    positive_int,
    share,
)
from pic.serve.hosts import allowed_host
from pic.serve.model_flags import CHECK_NEW_TOKENS, check_model_flags
from pic.serve.secret_flags import STORE_KEY_ENV, add_secret_flags, resolve_secrets


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server with cache ids")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=port, default=8000)
    add_secret_flags(serve)  # --api-key(-file), --store-key-file, --redis-url(-file)
    serve.add_argument(
        "--tenants", default=None, metavar="FILE",
        help="a TOML file of tenants ([tenants.NAME] with key_file / key_env, reads, kv_share, max_num_seqs, "
        "requests_per_s): each key's chunks in a namespace of its own (docs/security.md); instead of one API key",
    )  # fmt: skip
    serve.add_argument(
        "--allowed-host", type=allowed_host, action="append", default=[], metavar="NAME",
        help="without an API key, a name (NAME: any port; NAME:PORT) clients may address the server by besides its "
        "own address; repeatable (requests naming another Host, or from another site's page, get a 403)",
    )  # fmt: skip
    serve.add_argument(
        "--on-redis-error", choices=("raise", "miss"), default="raise",
        help="when Redis fails: raise (503) or miss (serve from the upper tiers, log it)",
    )  # fmt: skip
    serve.add_argument(
        "--disk-path", default=None, metavar="DIR",
        help="keep compiled chunks in files under DIR: they survive a restart (needs --disk-bytes)",
    )  # fmt: skip
    serve.add_argument(
        "--disk-bytes", type=byte_size, default=None, metavar="SIZE",
        help="the disk tier's capacity (bytes, or 512M, 10G ...); least recently used chunks are evicted",
    )  # fmt: skip
    serve.add_argument(
        "--on-disk-error", choices=("raise", "miss"), default="raise",
        help="when the disk fails (full, read-only): raise (503) or miss (serve from the other tiers, log it)",
    )  # fmt: skip
    serve.add_argument(
        "--redis-timeout", type=positive_float, default=None, metavar="SECONDS",
        help="socket timeout of Redis commands: what a stalled Redis costs before its breaker opens (default: 10)",
    )  # fmt: skip
    serve.add_argument(
        "--tier-retry", type=positive_float, default=None, metavar="SECONDS",
        help="a Redis or disk that failed is skipped this long (its calls fail or miss at once), then tried again "
        "(default: 5)",
    )  # fmt: skip
    serve.add_argument("--max-body-bytes", type=positive_int, default=8 << 20, help="larger request bodies get a 413")
    serve.add_argument(
        "--header-timeout", type=positive_float, default=10.0, metavar="SECONDS",
        help="a request's header must arrive within this many seconds (else 408, and the connection closed)",
    )  # fmt: skip
    serve.add_argument(
        "--body-timeout", type=positive_float, default=30.0, metavar="SECONDS",
        help="the longest wait for the next piece of a request body (else 408, and the connection closed)",
    )  # fmt: skip
    serve.add_argument(
        "--kv-pool-tokens", type=positive_int, default=None,
        help="KV pool size in tokens: live requests and resident chunks (default: 80%% of free GPU memory; "
        "65,536 on the CPU)",
    )  # fmt: skip
    serve.add_argument(
        "--policy", type=policy, default=None,
        help="the recompute policy of requests that name none (default: auto)",
    )  # fmt: skip
    serve.add_argument(
        "--chat-template", type=chat_template, default=None, metavar="FILE",
        help="a Jinja chat template file for /v1/chat/completions (replaces the tokenizer's own)",
    )  # fmt: skip
    serve.add_argument(
        "--decode-weights", choices=["model", "int8"], default=None,
        help="int8: decode steps read int8 copies of the weights (CPU, float32; faster decode, not exact: its speed "
        "and accuracy are measured in docs/cpu.md); default: the model's own",
    )  # fmt: skip
    serve.add_argument(
        "--prefill-order", choices=["interactive", "arrival"], default=None,
        help="interactive (default): completions' prompts before bulk compiles (POST /v1/chunks), so a chat that "
        "arrives during a large compile waits a step, not the compile; arrival: first come first served",
    )  # fmt: skip
    serve.add_argument(
        "--compile-share", type=share, default=None, metavar="SHARE",
        help="the share of each step's token budget bulk compiles keep while completions wait (default: 0.125)",
    )  # fmt: skip
    serve.add_argument("--skip-check", action="store_true", help="serve even if the start-up `pic check` fails")
    serve.set_defaults(check_flags=lambda args: check_flags(serve, args))
    return serve


def check_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What one flag's ``type`` cannot check: flags that need each other, and the configs the flags make
    together. A problem is an argparse error naming the flags (usage, exit 2), before the port or the model is
    touched, as every other bad option is."""
    from pic.errors import InvalidInputError

    resolve_secrets(parser, args)  # args.api_key, args.store_key, args.redis_url from their one source each
    args.tenant_set = None
    if args.tenants is not None:
        if args.api_key is not None:
            parser.error("--tenants and an API key (--api-key, --api-key-file, PIC_API_KEY): give one of them")
        from pic.serve.tenants import load_tenants

        try:
            args.tenant_set = load_tenants(args.tenants)
        except InvalidInputError as exc:
            parser.error(str(exc))
    if args.allowed_host and (args.api_key is not None or args.tenant_set is not None):
        parser.error(
            "--allowed-host is for a server without an API key (with one, a request's Host and Origin are not "
            "checked: a browser cannot send the key to another site); drop one of them"
        )
    if (args.disk_path is None) != (args.disk_bytes is None):
        given, needed = ("--disk-path", "--disk-bytes") if args.disk_bytes is None else ("--disk-bytes", "--disk-path")
        parser.error(f"{given} needs {needed}: the disk tier's folder and its size (--disk-path DIR --disk-bytes 200G)")
    try:
        config, _store = engine_config(args), store_config(args)
    except InvalidInputError as exc:
        parser.error(str(exc))
    check_model_flags(parser, args, block_size=config.block_size)  # what the load and the start-up check need


def run(args: argparse.Namespace) -> int:
    """Listen on ``--host``/``--port``, check the model (``pic check``), then serve until interrupted; returns
    the exit code.

    The port is taken first: a busy one is a one-line error at once, not a traceback after the model's load
    and check (seconds, a gigabyte). uvicorn then serves on that very socket."""
    try:
        import uvicorn  # noqa: F401  (missing: said before anything else runs)
    except ImportError:
        from pic.errors import MissingDependencyError

        raise MissingDependencyError('pic serve needs FastAPI and uvicorn: pip install "pic-kv[serve]"') from None
    config, store = engine_config(args), store_config(args)  # checked already (check_flags): exit 2 when bad
    if store is not None and store.store_key is None and (store.redis_url or store.disk_path):
        print(f"pic: note: {_unkeyed_note(store)}", file=sys.stderr, flush=True)
    sock = listen(args.host, args.port)
    if sock is None:
        return 1
    with sock:
        app = _checked_app(args, config, store)
        if app is None:
            return 1
        if args.api_key is None and args.tenant_set is None and not is_loopback(args.host):
            print(f"pic: warning: {_open_warning(args.host, args.port)}", file=sys.stderr, flush=True)
        _serve(app, sock, args)
    return 0


def _serve(app, sock: socket.socket, args: argparse.Namespace) -> None:
    """Run uvicorn on ``sock`` with ``pic serve``'s protocol (its read deadlines) until interrupted."""
    import uvicorn

    from pic.serve.http import CutLongPaths
    from pic.serve.protocol import KEEP_ALIVE_S, timed_protocol

    http = timed_protocol(headers_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout)
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level="info", http=http, timeout_keep_alive=KEEP_ALIVE_S
    )  # sets up its logging
    logging.getLogger("uvicorn.access").addFilter(CutLongPaths())  # a 16 KB path is not logged whole
    # uvicorn names the address only of a socket it binds itself: say it as it would.
    url = f"http://{_address(args.host, args.port)}"
    logging.getLogger("uvicorn.error").info("Uvicorn running on %s (Press CTRL+C to quit)", url)
    uvicorn.Server(config).run(sockets=[sock])


def _checked_app(args: argparse.Namespace, config, store):
    """The app over the model ``args`` name (with ``config`` and ``store``), once it passes ``pic check``;
    ``None`` (said on stderr) when it fails it and ``--skip-check`` is not given."""
    import pic
    from pic.serve.app import build_app

    model = args.model or pic.EMBEDDED_MODEL
    engine = pic.load(model, device=args.device, dtype=args.dtype, gguf_file=args.gguf_file, config=config, store=store)
    if args.chat_template is not None:
        _use_chat_template(engine, args.chat_template)
    name = str(args.model) if args.model else engine.model_name
    result = _check(engine, args)  # pic must reproduce the model's own outputs before it serves them
    print(result.message, flush=True)
    if not result.passed and not args.skip_check:
        print("pic: error: refusing to serve a model that fails the check (--skip-check overrides)", file=sys.stderr)
        return None
    return build_app(
        engine, model_name=name, api_key=args.api_key, tenants=args.tenant_set, max_body_bytes=args.max_body_bytes,
        body_timeout_s=args.body_timeout, allowed_hosts=allowed_hosts(args.host, args.port, args.allowed_host),
    )  # fmt: skip


def _check(engine, args: argparse.Namespace):
    """``pic check`` of ``engine`` (``CHECK_NEW_TOKENS`` tokens, as ``check_pool_tokens`` counts them); a pool too
    small for it (``check_flags`` refuses a ``--kv-pool-tokens`` under what any model needs; a tokenizer that splits
    the check's ASCII text finer than bytes would need more) is said naming the flag, not ``PICConfig``'s field."""
    from pic.check import check
    from pic.errors import KVPoolExhaustedError

    try:
        return check(engine, num_new_tokens=CHECK_NEW_TOKENS)
    except KVPoolExhaustedError as exc:
        pool = "the default KV pool" if args.kv_pool_tokens is None else f"--kv-pool-tokens {args.kv_pool_tokens}"
        raise KVPoolExhaustedError(
            f"{pool}: the start-up check does not fit ({exc}); pass a larger --kv-pool-tokens"
        ) from None


def allowed_hosts(host: str, port: int, names: list[str]):
    """The ``AllowedHosts`` of a keyless server: the ``--allowed-host`` names, and ``--host`` with its port when it
    is a name (the connection's own address, loopback names included, is always allowed: ``pic.serve.hosts``)."""
    from pic.serve.hosts import AllowedHosts

    try:
        ipaddress.ip_address(host.strip("[]"))
        bound = []
    except ValueError:
        bound = [f"{host}:{port}"]  # a name: the server was told its name, and its clients use it
    return AllowedHosts.parse([*names, *bound])


def _unkeyed_note(store) -> str:
    """The start-up line of a server with a shared tier and no store key."""
    tiers = " and ".join(
        name for name, on in (("Redis", store.redis_url), (f"the disk folder {store.disk_path}", store.disk_path)) if on
    )
    return (
        f"no store key: chunks read from {tiers} are trusted as they are (whoever can write there can change what "
        f"this server answers); set one with --store-key-file PATH or {STORE_KEY_ENV} (hex: openssl rand -hex 32), "
        "the same on every server of the fleet"
    )


def listen(host: str, port: int) -> socket.socket | None:
    """A TCP socket bound to ``host:port`` and listening (IPv4 or IPv6, as ``host`` resolves: an IPv4
    address when it has both, as uvicorn binds a name); ``None``, said on stderr with a hint, when the address
    cannot be taken (a port in use, a privileged port, an address not of this machine)."""
    where = _address(host, port)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _name, address = min(infos, key=lambda info: info[0] != socket.AF_INET)
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        print(f"pic: error: cannot listen on {where}: {exc}; pass --host an address of this machine", file=sys.stderr)
        return None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart reuses a port in TIME_WAIT
        sock.bind(address)
        sock.listen(2048)  # taken now: a second server fails here, not when its model is loaded
    except OSError as exc:
        sock.close()
        print(f"pic: error: cannot listen on {where}: {exc}{_hint(exc)}", file=sys.stderr)
        return None
    return sock


def _hint(exc: OSError) -> str:
    """What to do about a failed bind."""
    if exc.errno == errno.EADDRINUSE:
        return "; is another server running? pass --port"
    if exc.errno == errno.EACCES:
        return "; ports under 1024 need privileges: pass --port"
    if exc.errno == errno.EADDRNOTAVAIL:
        return "; pass --host an address of this machine"
    return ""


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (127.0.0.0/8, ::1, ``localhost``): reachable from this machine
    only."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False  # a name: it may be any interface
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def _open_warning(host: str, port: int) -> str:
    return (
        f"serving on {_address(host, port)} without --api-key: anyone who can reach this port can use the server "
        "and read or delete its chunks"
    )


def _address(host: str, port: int) -> str:
    """``host:port``, an IPv6 address in brackets (``[::]:8000``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def engine_config(args: argparse.Namespace):
    """The ``PICConfig`` the engine flags ask for (the library's defaults for those not given)."""
    import pic

    options = {"kv_pool_tokens": args.kv_pool_tokens, "default_policy": args.policy,
               "decode_weights": args.decode_weights, "prefill_order": args.prefill_order,
               "compile_share": args.compile_share}  # fmt: skip
    tenants = getattr(args, "tenant_set", None)
    if tenants is not None and tenants.quotas:
        options["quotas"] = tenants.quotas
    return pic.PICConfig(**{key: value for key, value in options.items() if value is not None})


def store_config(args: argparse.Namespace):
    """The ``StoreConfig`` the store flags ask for; ``None``: the default (the KV pool alone).

    Raises:
        InvalidInputError: ``--disk-path`` without ``--disk-bytes`` or the reverse (``check_flags`` says so first,
            naming the flags).
    """
    import pic

    fields = {"redis_url": args.redis_url, "disk_path": args.disk_path, "disk_bytes": args.disk_bytes}
    if all(value is None for value in fields.values()):
        return None if args.store_key is None else pic.StoreConfig(store_key=args.store_key)
    fields["store_key"] = args.store_key
    errors = {"on_redis_error": args.on_redis_error, "on_disk_error": args.on_disk_error}
    timing = {"redis_timeout_s": args.redis_timeout, "tier_retry_s": args.tier_retry}  # None: StoreConfig's default
    return pic.StoreConfig(**fields, **errors, **{key: value for key, value in timing.items() if value is not None})


def _use_chat_template(engine, template: str) -> None:
    """Make ``template`` the tokenizer's chat template, after rendering one message with it (a template that
    parses but fails on messages, or loses the documents' place, stops the start, not the first chat)."""
    from pic.errors import InvalidInputError
    from pic.link.chat import split_chat

    engine.tokenizer.chat_template = template
    try:
        split_chat(engine.tokenizer, [{"role": "user", "content": "Hello"}])
    except InvalidInputError as exc:
        raise InvalidInputError(f"--chat-template: {exc}") from None
