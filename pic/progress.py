"""Progress bars that suit where they are written.

On a terminal, tqdm's bar. Anywhere else (a file, a pipe, a server's log), a bar redrawn in place would be a pile
of carriage-return lines, so there the bar is a line at its start, one each quarter of the way and one at its end.
``from pic.progress import tqdm`` in place of ``from tqdm.auto import tqdm``: the same arguments.
"""

from __future__ import annotations

import sys

from tqdm.auto import tqdm as _tqdm

__all__ = ["tqdm"]

LINES_PER_BAR = 4  # a line at each quarter, on a file


def _is_terminal(file: object) -> bool:
    isatty = getattr(file, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed file
        return False


class tqdm(_tqdm):  # noqa: N801 (tqdm's name, so it replaces tqdm's import)
    """tqdm's bar on a terminal (or in a notebook); on a file, whole lines (``LINES_PER_BAR`` and the last)."""

    def __init__(self, *args, **kwargs) -> None:
        file = kwargs.get("file") or sys.stderr
        self._as_lines = "notebook" not in type(self).__mro__[1].__module__ and not _is_terminal(file)
        self._shown: tuple[int, int, str | None] | None = None  # (step, n, postfix) of the last line written
        super().__init__(*args, **kwargs)

    def _step(self) -> int:
        return int(LINES_PER_BAR * self.n / self.total) if self.total else 0

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        if not self._as_lines:
            return super().display(msg, pos)
        if msg is None and (self._shown is None or self._step() > self._shown[0] or self.postfix != self._shown[2]):
            self._write_line()  # a quarter further, or a new label (``set_postfix_str``: a long job's next step)
        return True

    def _write_line(self) -> None:
        self._shown = (self._step(), self.n, self.postfix)
        self.fp.write(self.__str__() + "\n")
        self.fp.flush()

    def close(self) -> None:
        if not self._as_lines or self.disable:
            return super().close()
        if self._shown is None or self._shown[1] != self.n:
            self._write_line()  # where it ended
        self.disable = True
        self._decr_instances(self)
