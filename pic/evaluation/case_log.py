"""Each case's outcomes, one JSON line per case as it finishes, so a long accuracy run resumes where it stopped.

An accuracy cell of 60-120 cases on a real model takes hours on a CPU; ``pic eval accuracy --resume`` reads this
log and runs only the cases it lacks. The first line says what the log is of (the workload's description, the
model, the rows' labels): a resume with other arguments is refused rather than mixing two evaluations. A last
line cut off by an interruption is dropped (its case runs again). JSON only, and the file's size is checked
before it is read.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from pic.errors import InvalidInputError
from pic.evaluation.accuracy import CaseOutcomes, Outcome
from pic.evaluation.answers import AnswerScore
from pic.evaluation.fidelity import LinkMeasurement

# A log holds one line of a few KB per case: refuse what cannot be one.
MAX_LOG_BYTES = 256 * 1024 * 1024


class CaseLog:
    """The case log at ``path`` of an evaluation described by ``header`` (JSON-able: workload, model, labels)."""

    def __init__(self, path: str | os.PathLike, header: dict) -> None:
        self.path, self.header = Path(path), json.loads(json.dumps(header))  # as it reads back

    def start(self) -> None:
        """Begin a new log (an old one at the path is replaced)."""
        self.path.write_text(json.dumps({"header": self.header}) + "\n", encoding="utf-8")

    def read(self) -> dict[int, CaseOutcomes]:
        """The outcomes logged so far, by case number; a new log when there is none.

        Raises:
            InvalidInputError: a log of another evaluation (its header differs: says how), an oversized or
                malformed file.
        """
        if not self.path.exists():
            self.start()
            return {}
        if self.path.stat().st_size > MAX_LOG_BYTES:
            raise InvalidInputError(f"case log {str(self.path)!r} is larger than {MAX_LOG_BYTES} bytes")
        text = self.path.read_text(encoding="utf-8")
        if text and not text.endswith("\n"):  # a last line cut off by an interruption: dropped, its case runs again
            text = text[: text.rfind("\n") + 1]
            self.path.write_text(text, encoding="utf-8")
        lines = text.splitlines()
        header = _loads(lines[0]).get("header") if lines else None
        if header != self.header:
            differ = sorted(k for k in {*self.header, *(header or {})} if (header or {}).get(k) != self.header.get(k))
            raise InvalidInputError(
                f"case log {str(self.path)!r} is of another evaluation (it differs in {', '.join(differ)}); "
                "run without --resume to start over, or with the arguments it was made with"
            )
        done = {}
        for line in lines[1:]:
            record = _loads(line)
            if record is None:
                raise InvalidInputError(f"case log {str(self.path)!r} holds a line that is not a JSON object")
            done[int(record["case"])] = {label: _outcome(item) for label, item in record["outcomes"].items()}
        return done

    def append(self, number: int, outcomes: CaseOutcomes) -> None:
        """Log case ``number``'s outcomes (one line, flushed to the OS before returning)."""
        record = {"case": number, "outcomes": {label: dataclasses.asdict(o) for label, o in outcomes.items()}}
        with open(self.path, "a", encoding="utf-8") as file:
            file.write(json.dumps(record) + "\n")


def _loads(line: str) -> dict | None:
    try:
        value = json.loads(line)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def _outcome(item: dict) -> Outcome:
    try:
        return Outcome(
            link=LinkMeasurement(**item["link"]),
            reply=str(item["reply"]),
            score=AnswerScore(**item["score"]),
            order=tuple(int(i) for i in item["order"]),
            full_in_order=bool(item["full_in_order"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidInputError(f"case log line holds a malformed outcome ({exc!r:.80})") from None
