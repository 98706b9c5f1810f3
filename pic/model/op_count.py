"""Count the operations a runner's forwards dispatch, per layer: on a GPU each is about one kernel launch.

A link on an H100 was host-bound (a naive 16K link's launches took several times its GPU work:
docs/gpu.md#the-second-run-the-fixes-and-split-kv-the-same-day), so the operations a layer dispatches are a cost of
their own, and a number a test can pin on the CPU. ``count_ops`` observes a ``ModelRunner``'s forwards
(``ModelRunner.observe_forwards``, in whatever thread runs them: the engine's core thread) and records, per forward, the
operations each layer dispatched (views and metadata left out: they launch nothing).

Two counts: ``ops``, what the layer dispatches (``pic::rms_norm`` one: one kernel on CUDA), and ``kernels``, with
pic's own operators counted as the operations their CPU implementation runs (transformers' six for an RMSNorm).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from torch.utils._python_dispatch import TorchDispatchMode

from pic.model.norm import rms_norm_reference

# Operations that only make a new view or read metadata: nothing runs on the device.
VIEWS = frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "expand", "as_strided", "t", "transpose", "permute",
    "unsqueeze", "squeeze", "select", "slice", "split", "split_with_sizes", "unbind", "chunk", "narrow", "detach",
    "alias", "unflatten", "flatten", "view_as", "expand_as", "lift_fresh", "size", "stride", "sym_size", "sym_stride",
    "is_contiguous", "_to_copy_noop", "dim", "numel",
})  # fmt: skip


@dataclass
class ForwardOps:
    """One forward's operations.

    Attributes:
        decode: every sequence decoded (a decode step); otherwise a pass.
        num_rows: the tokens the forward ran.
        layers: per layer, the operations it dispatched (by name), in ``ops``'s sense.
        kernels: per layer, the same with pic's operators expanded into what their CPU implementation runs.
    """

    decode: bool
    num_rows: int
    layers: list[Counter] = field(default_factory=list)
    kernels: list[Counter] = field(default_factory=list)

    def per_layer(self, *, kernels: bool = False) -> int:
        """The most operations any layer dispatched (layers differ only by a first step's allocations)."""
        counts = self.kernels if kernels else self.layers
        return max(sum(c.values()) for c in counts)


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.kernels: Counter = Counter()
        self._inside_pic = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        kwargs = kwargs or {}
        if name in VIEWS:
            return func(*args, **kwargs)
        if not self._inside_pic:
            self.ops[name] += 1
        if func.namespace == "pic" and name == "rms_norm":
            self._inside_pic = True
            try:
                with self:  # count what its CPU implementation runs, as kernels
                    return rms_norm_reference(*args, **kwargs)
            finally:
                self._inside_pic = False
        out = func(*args, **kwargs)
        if name != "to" or out is not args[0]:  # (``to`` the same dtype is the tensor itself: nothing runs)
            self.kernels[name] += 1
        return out


class _Counting:
    """A ``pic.model.inputs.ForwardObserver``: each forward under a fresh ``_Count``, each layer's share of it kept."""

    def __init__(self) -> None:
        self.forwards: list[ForwardOps] = []
        self._mode = _Count()

    @contextlib.contextmanager
    def forward(self, seqs) -> Iterator[None]:
        num_rows = sum(len(s.token_ids) for s in seqs)
        self.forwards.append(ForwardOps(decode=all(s.decode for s in seqs), num_rows=num_rows))
        self._mode = _Count()
        with self._mode:
            yield

    @contextlib.contextmanager
    def layer(self, index: int) -> Iterator[None]:
        mode = self._mode
        before_ops, before_kernels = Counter(mode.ops), Counter(mode.kernels)
        yield
        self.forwards[-1].layers.append(mode.ops - before_ops)
        self.forwards[-1].kernels.append(mode.kernels - before_kernels)


@contextlib.contextmanager
def count_ops(runner) -> Iterator[list[ForwardOps]]:
    """Within the block, every forward of ``runner`` (a ``pic.model.ModelRunner``) appends its ``ForwardOps`` to the
    list yielded (``ModelRunner.observe_forwards``). Not reentrant."""
    counting = _Counting()
    with runner.observe_forwards(counting):
        yield counting.forwards


def link_ops(engine, cache_ids: list[str], query: str, policy: str, *, num_new: int = 4) -> dict[str, ForwardOps]:
    """The operations of a link's pass (``"pass"``) and of its last decode step (``"decode"``) under ``policy``:
    ``engine`` (a ``pic.PIC``) links ``cache_ids`` with ``query`` and generates ``num_new`` tokens, after one untimed
    link and two tokens (the first steps allocate the kept K and V), counted in the engine's thread."""
    with engine.paused() as core:
        runner = core.runner
    engine.link(cache_ids, query, policy=policy).generate(max_new_tokens=2)
    with count_ops(runner) as forwards:
        engine.link(cache_ids, query, policy=policy).generate(max_new_tokens=num_new)
    return {"pass": [f for f in forwards if not f.decode][-1], "decode": [f for f in forwards if f.decode][-1]}
