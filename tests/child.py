"""The environment of a Python subprocess a test starts: the parent's import path, whatever set it up."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def child_env(**overrides: str) -> dict[str, str]:
    """``os.environ`` with ``PYTHONPATH`` holding this checkout first, then every entry of the parent's ``sys.path``.

    A child given only the checkout would miss packages the parent found through a path added at run time (the
    GPU run installs pydantic and redis into ``/tmp/site`` and puts it on ``PYTHONPATH``; a site directory or a
    ``.pth`` file does the same). ``overrides`` are set last.
    """
    entries = [str(REPO)] + [p for p in sys.path if p and Path(p).is_dir() and p != str(REPO)]
    return dict(os.environ) | {"PYTHONPATH": os.pathsep.join(entries)} | overrides
