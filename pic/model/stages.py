"""A progress bar over the named steps of a long job whose steps report nothing themselves (a GGUF conversion:
transformers reads the file's metadata, dequantizes, builds a tokenizer, each for seconds without a word).

The bar says which step runs and how long the job has taken, and its clock keeps moving during a step: a
thread redraws it every ``tick_s``, so a 20-second step does not look like a hang.
"""

from __future__ import annotations

import sys
import threading
from types import TracebackType

from pic.progress import tqdm


class Stages:
    """``with Stages("converting x", total=4) as stages: stages.begin("reading"); ...; stages.begin("saving")``.

    Each ``begin`` counts the step before it done; leaving the block without an error counts the last one.
    Written to stderr (``file``), as tqdm's bars are."""

    def __init__(self, desc: str, *, total: int, tick_s: float = 1.0, file=None) -> None:
        self.desc, self.total, self.tick_s, self.file = desc, total, tick_s, file
        self._bar: tqdm | None = None
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._started = 0

    def __enter__(self) -> Stages:
        self._bar = tqdm(
            total=self.total, desc=self.desc, file=self.file or sys.stderr, leave=True,
            bar_format="{desc}: step {n_fmt}/{total_fmt} done [{elapsed}]{postfix}",
        )  # fmt: skip
        self._ticker = threading.Thread(target=self._tick, name="pic-stages", daemon=True)
        self._ticker.start()
        return self

    def begin(self, name: str) -> None:
        """Start step ``name`` (the one before it is done)."""
        assert self._bar is not None, "begin() outside the with block"
        self._started += 1
        self._bar.set_postfix_str(f"{name} (step {self._started})", refresh=self._started == 1)
        if self._started > 1:
            self._bar.update(1)
            self._bar.refresh()  # now, whatever tqdm's rate limit: the step done, the next one's name (a file: a line)

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None):
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        if self._bar is not None:
            if kind is None and self._started:
                self._bar.update(1)
                self._bar.set_postfix_str("done")
            self._bar.close()

    def _tick(self) -> None:
        while not self._stop.wait(self.tick_s):
            self._bar.refresh()  # takes tqdm's own lock: safe beside begin()
