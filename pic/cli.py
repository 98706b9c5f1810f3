"""The ``pic`` command line (``python -m pic ...``)."""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pic", description="Position-independent KV caching for LLMs.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="compile a few stories, link them under each policy, generate")
    demo.add_argument("--model", default=None, help="HF model name or path (default: the embedded stories260K)")
    demo.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    demo.add_argument("--max-new-tokens", type=int, default=48)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from transformers.utils import logging as hf_logging

    from pic.demo import run_demo
    from pic.errors import PicError
    from pic.model.loading import EMBEDDED_MODEL

    hf_logging.disable_progress_bar()
    try:
        if args.command == "demo":
            run_demo(args.model or EMBEDDED_MODEL, device=args.device, max_new_tokens=args.max_new_tokens)
    except PicError as exc:
        print(f"pic: error: {exc}", file=sys.stderr)
        return 1
    return 0
