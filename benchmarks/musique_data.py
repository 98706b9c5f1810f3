"""Fetch CacheBlend's MuSiQue questions for ``pic eval accuracy --workload musique``, and check them.

python benchmarks/musique_data.py                       # download -> benchmarks/data/musique_s.json
python benchmarks/musique_data.py --from PATH           # check and copy a copy you have instead
python benchmarks/musique_data.py --out PATH            # write elsewhere (then pass --musique-file PATH)

The file is ``inputs/musique_s.json`` of CacheBlend (github.com/YaoJiayi/CacheBlend, at ``COMMIT``): 150
MuSiQue questions, each with 10 retrieved Wikipedia passages and its answer, the set CacheBlend's
``example/blend_musique.py`` evaluates (Yao et al., 2024, "CacheBlend: Fast Large Language Model Serving for RAG
with Cached Knowledge Fusion", arXiv:2405.16444). Either way the bytes must have ``SHA256``, so every run of the
workload reads the same questions; a file that differs is refused and nothing is written.

Licence and citation: MuSiQue is CC BY 4.0, by Harsh Trivedi, Niranjan Balasubramanian, Tushar Khot and Ashish
Sabharwal: "MuSiQue: Multihop Questions via Single-hop Question Composition", Transactions of the Association
for Computational Linguistics 10 (2022), https://github.com/StonyBrookNLP/musique. Its passages are from
Wikipedia (CC BY-SA). pic does not ship the file (benchmarks/data/ is git-ignored); whoever redistributes it
keeps the attribution.

Standard library only: nothing here needs the engine.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import urllib.request
from pathlib import Path

COMMIT = "55ad02675939f783a38d579393527d218a7fd581"  # CacheBlend's HEAD when read (2024-12-30)
URL = f"https://raw.githubusercontent.com/YaoJiayi/CacheBlend/{COMMIT}/inputs/musique_s.json"
SHA256 = "d679da1dad32b7f3645de9db0d7a1aaa7e679eb76ed48c02c4688137e5ce6674"
NUM_BYTES = 3_760_082
DEFAULT_OUT = Path(__file__).resolve().parent / "data" / "musique_s.json"
MAX_BYTES = 64 * 1024 * 1024  # the file is 3.6 MiB: a download this large is not it
TIMEOUT_S = 60


class DataError(Exception):
    """The file could not be had, or is not CacheBlend's: the message names the source and what differs."""


def download(url: str = URL, *, timeout_s: float = TIMEOUT_S) -> bytes:
    """The bytes at ``url``, at most ``MAX_BYTES`` of them read (a longer body is refused, not truncated)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            data = response.read(MAX_BYTES + 1)
    except OSError as exc:
        raise DataError(f"cannot download {url}: {exc}; fetch it elsewhere and pass --from PATH") from None
    if len(data) > MAX_BYTES:
        raise DataError(f"{url} is more than {MAX_BYTES} bytes: not CacheBlend's file")
    return data


def read_local(path: str | os.PathLike) -> bytes:
    """A local copy's bytes, its size checked before it is read."""
    try:
        size = os.path.getsize(path)
        if size > MAX_BYTES:
            raise DataError(f"{str(path)!r} is {size} bytes, more than {MAX_BYTES}: not CacheBlend's file")
        with open(path, "rb") as file:
            return file.read(MAX_BYTES + 1)
    except OSError as exc:
        raise DataError(f"cannot read {str(path)!r}: {exc.strerror or exc}") from None


def verify(data: bytes, source: str, *, expected: str | None = None) -> None:
    """Refuse bytes whose sha256 is not ``expected`` (default: ``SHA256``), naming the source and both digests."""
    expected = expected or SHA256
    digest = hashlib.sha256(data).hexdigest()
    if digest != expected:
        raise DataError(
            f"{source} has sha256 {digest} ({len(data)} bytes), not CacheBlend's {expected} ({NUM_BYTES} bytes) "
            f"of inputs/musique_s.json at {COMMIT}"
        )


def write(data: bytes, out: str | os.PathLike) -> None:
    """Write ``data`` to ``out`` atomically (a temporary file in its folder, then renamed)."""
    folder = Path(out).resolve().parent
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".musique_s.", delete=False) as file:
        file.write(data)
    try:
        os.chmod(file.name, 0o644)  # a temporary file is private; the data is not
        os.replace(file.name, out)
    except OSError:
        os.unlink(file.name)
        raise


def fetch(out: str | os.PathLike = DEFAULT_OUT, *, source: str | os.PathLike | None = None) -> Path:
    """Download CacheBlend's file (or read ``source``), check its sha256, and write it to ``out``."""
    data = read_local(source) if source is not None else download()
    verify(data, repr(str(source)) if source is not None else URL)
    if source is not None and Path(source).resolve() == Path(out).resolve():
        return Path(out)  # checked in place
    write(data, out)
    return Path(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="source", default=None, help="a local copy to check and copy, not download")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help=f"where to write (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    try:
        path = fetch(args.out, source=args.source)
    except DataError as exc:
        print(f"musique_data: {exc}", file=sys.stderr)
        return 1
    print(f"{path}: CacheBlend's inputs/musique_s.json at {COMMIT[:12]}, sha256 {SHA256[:16]}...")
    print("MuSiQue (Trivedi et al., 2022, TACL) is CC BY 4.0; use: pic eval accuracy --workload musique "
          f"--musique-file {path}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
