"""``Turns``: whose turn it is among the namespaces with waiting work (round robin), so that one namespace's many
requests cannot hold another's first token (``PICConfig.quotas``).

Each namespace's work keeps its arrival order; the namespaces take turns: the first of each, then the second of
each, and so on, the namespaces in turn order. The namespace whose work was last given a step's budget goes to the
back of that order, so the turns go on across steps: when a step admits one request, the next step admits another
namespace's. A namespace new to the turns (or back after a while with nothing waiting) joins at the back, in the
order of its first work's arrival. With one namespace the order is the arrival order. Pure bookkeeping: no torch,
no engine state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import zip_longest
from typing import TypeVar

W = TypeVar("W")


class Turns:
    """The turn order of namespaces for one kind of waiting work (requests, or bulk compiles)."""

    def __init__(self) -> None:
        self._order: dict[str, None] = {}  # namespaces with waiting work, whose turn comes first first

    def order(self, works: Iterable[W], *, namespace: Callable[[W], str], arrival: Callable[[W], float]) -> list[W]:
        """``works`` in turns: each namespace's in arrival order, interleaved in the namespaces' turn order. The turn
        order forgets namespaces with nothing waiting and takes in new ones, first arrived first."""
        queues: dict[str, list[W]] = {}
        for work in sorted(works, key=arrival):
            queues.setdefault(namespace(work), []).append(work)
        if len(queues) <= 1:  # (one namespace, or none: arrival order)
            self._order = dict.fromkeys(queues)
            return next(iter(queues.values()), [])
        self._order = {name: None for name in self._order if name in queues} | dict.fromkeys(queues)
        rounds = zip_longest(*(queues[name] for name in self._order))
        return [work for round_ in rounds for work in round_ if work is not None]

    def took(self, name: str) -> None:
        """``name``'s work was given budget: its next turn comes after every other namespace's."""
        self._order.pop(name, None)
        self._order[name] = None

    @property
    def names(self) -> list[str]:
        """The namespaces in turn order (for tests and logs)."""
        return list(self._order)
