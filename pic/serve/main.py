"""``pic serve``: load a model, build the app, run it with uvicorn (``pip install -e ".[serve]"``)."""

from __future__ import annotations

import argparse
import sys

from pic.cli_args import byte_size, chat_template, nonempty, policy, port, positive_float, positive_int, redis_url


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server with cache ids")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=port, default=8000)
    serve.add_argument(
        "--api-key", type=nonempty, default=None, help="require 'Authorization: Bearer KEY' (all routes but /health)"
    )
    serve.add_argument("--redis-url", type=redis_url, default=None, help="a Redis shared by a fleet of servers")
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
        help="the recompute policy of requests that name none (default: regions)",
    )  # fmt: skip
    serve.add_argument(
        "--chat-template", type=chat_template, default=None, metavar="FILE",
        help="a Jinja chat template file for /v1/chat/completions (replaces the tokenizer's own)",
    )  # fmt: skip
    serve.add_argument(
        "--decode-weights", choices=["model", "int8"], default=None,
        help="int8: decode steps read int8 copies of the weights (CPU, float32; ~1.6x faster decode, not exact: "
        "docs/cpu.md); default: the model's own",
    )  # fmt: skip
    serve.add_argument("--skip-check", action="store_true", help="serve even if the start-up `pic check` fails")
    return serve


def run(args: argparse.Namespace) -> int:
    """Check the model (``pic check``), then serve until interrupted; returns the exit code."""
    try:
        import uvicorn
    except ImportError:
        from pic.errors import MissingDependencyError

        raise MissingDependencyError('pic serve needs FastAPI and uvicorn: pip install "pic-kv[serve]"') from None
    import pic
    from pic.check import check
    from pic.serve.app import build_app
    from pic.serve.protocol import timed_protocol

    store = store_config(args)
    options = {"kv_pool_tokens": args.kv_pool_tokens, "default_policy": args.policy,
               "decode_weights": args.decode_weights}  # fmt: skip
    config = pic.PICConfig(**{key: value for key, value in options.items() if value is not None})
    model = args.model or pic.EMBEDDED_MODEL
    engine = pic.load(model, device=args.device, dtype=args.dtype, gguf_file=args.gguf_file, config=config, store=store)
    if args.chat_template is not None:
        _use_chat_template(engine, args.chat_template)
    name = str(args.model) if args.model else engine.model_name
    result = check(engine)  # pic must reproduce the model's own outputs before it serves them
    print(result.message, flush=True)
    if not result.passed and not args.skip_check:
        print("pic: error: refusing to serve a model that fails the check (--skip-check overrides)", file=sys.stderr)
        return 1
    app = build_app(
        engine, model_name=name, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
        body_timeout_s=args.body_timeout,
    )  # fmt: skip
    http = timed_protocol(headers_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", http=http)
    return 0


def store_config(args: argparse.Namespace):
    """The ``StoreConfig`` the store flags ask for; ``None``: the default (the KV pool alone).

    Raises:
        InvalidInputError: ``--disk-path`` without ``--disk-bytes`` or the reverse.
    """
    import pic

    fields = {"redis_url": args.redis_url, "disk_path": args.disk_path, "disk_bytes": args.disk_bytes}
    if all(value is None for value in fields.values()):
        return None
    errors = {"on_redis_error": args.on_redis_error, "on_disk_error": args.on_disk_error}
    return pic.StoreConfig(**fields, **errors)


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
