"""``pic serve``'s flags whose values are checked against what the model load and the start-up check will need,
before either runs: ``--device`` and ``--dtype`` as ``pic.load`` resolves them, ``--decode-weights int8``'s needs of
both, a ``--kv-pool-tokens`` too small for the start-up check (``pic check``) on any model, and a ``--disk-path``
that cannot be a folder. Each is known without the model, so a bad value is an argparse error naming its flag (exit
2), not an error after a load of seconds to minutes."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

CHECK_NEW_TOKENS = 8
"""The greedy tokens the start-up check compares (``pic.check.check``'s ``num_new_tokens``)."""


def check_model_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, *, block_size: int) -> None:
    """``parser.error`` (naming the flag) for a value of ``--device``, ``--dtype``, ``--decode-weights``,
    ``--kv-pool-tokens`` or ``--disk-path`` that the load or the start-up check would refuse; ``block_size``: the
    engine's (``PICConfig.block_size``)."""
    device, dtype = _device_and_dtype(parser, args)
    if args.decode_weights == "int8":
        _check_int8(parser, device, dtype)
    if args.kv_pool_tokens is not None and args.kv_pool_tokens < check_pool_tokens(block_size):
        parser.error(_small_pool(args.kv_pool_tokens, block_size))
    if args.disk_path is not None:
        problem = folder_problem(Path(args.disk_path))
        if problem is not None:
            parser.error(f"argument --disk-path: {args.disk_path!r} {problem}")


def _device_and_dtype(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """The torch device and dtype ``pic.load`` will use for ``--device`` / ``--dtype`` (the same functions resolve
    them there); a device this machine lacks, or a dtype name it does not know, is ``parser.error``."""
    from pic.errors import InvalidInputError
    from pic.model.loading import resolve_device, resolve_dtype

    try:
        device = resolve_device(args.device)
    except InvalidInputError as exc:
        parser.error(f"argument --device: {exc}")
    try:
        dtype = resolve_dtype(args.dtype, device)
    except InvalidInputError as exc:
        parser.error(f"argument --dtype: {exc}")
    return device, dtype


def _check_int8(parser: argparse.ArgumentParser, device, dtype) -> None:
    """``--decode-weights int8`` runs fbgemm's int8 products: a float32 or bfloat16 model on the CPU, and a torch
    with the x86 or fbgemm quantized engine (what ``pic.model.products.Int8Products`` refuses after the load)."""
    import torch

    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        parser.error(
            f"--decode-weights int8 needs a float32 or bfloat16 model on the CPU (fbgemm's int8 products); --device "
            f"and --dtype give {str(dtype).removeprefix('torch.')} on {device}: pass --device cpu --dtype float32 (or "
            "bfloat16), or leave --decode-weights out"
        )
    engines = torch.backends.quantized.supported_engines
    if not {"x86", "fbgemm"} & set(engines):
        parser.error(f"--decode-weights int8 needs torch's x86 or fbgemm quantized engine; this torch has {engines}")


def check_pool_tokens(block_size: int) -> int:
    """The most KV pool tokens the start-up check can need, whatever the model (so a smaller ``--kv-pool-tokens``
    fails it on every model): its chunks, compiled and held while the link runs, and the link's own blocks (Full
    Recompute makes every block of the prompt private: the prefix, a copy of each chunk, the query and the tokens
    generated), each segment in whole blocks, at a token per character (the check's texts are ASCII, which no
    tokenizer splits finer than bytes) with its BOS and a spare token (a SentencePiece word marker)."""
    from pic.check import DOCS, PREFIX, QUERY

    def blocks(num_tokens: int) -> int:
        return math.ceil(num_tokens / block_size)

    chunks = sum(blocks(len(doc) + 2) for doc in DOCS)
    private = blocks(len(PREFIX) + 2) + chunks + blocks(len(QUERY) + 1 + CHECK_NEW_TOKENS)
    return (chunks + private) * block_size


def _small_pool(num_tokens: int, block_size: int) -> str:
    floor = check_pool_tokens(block_size)
    return (
        f"argument --kv-pool-tokens: {num_tokens} tokens may not hold the start-up check (pic check: three short "
        f"chunks linked under Full Recompute, {CHECK_NEW_TOKENS} tokens generated), which takes up to {floor} tokens "
        f"in blocks of {block_size} whatever the model; pass at least {floor} (live requests and resident chunks "
        "share the pool: a server needs many times that)"
    )


def folder_problem(path: Path) -> str | None:
    """Why ``path`` cannot be (or become) a folder, or ``None``: a file is there, or the nearest part of it that
    exists is not a folder (nothing is created here: the disk tier makes the folder when it starts)."""
    if path.exists():
        return None if path.is_dir() else "is a file, not a folder"
    parent = next((p for p in path.absolute().parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        return f"cannot be a folder: {str(parent)!r} is a file"
    return None
