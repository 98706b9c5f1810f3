"""A request's recompute pass as one sequence of a batched forward: the tokens its policy selects run
fresh through every layer, over its assembled KV (chunk blocks mapped, or copied where written)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from pic.kv.transfer import to_device
from pic.link.assemble import Assembly
from pic.link.layout import Layout
from pic.link.policies import Policy
from pic.link.probe import Probe, ProbeRecorder
from pic.link.step import LayerStep
from pic.model import SeqInput
from pic.model.inputs import LayerView


@dataclass(frozen=True)
class PassResult:
    """What a recompute pass ran (for a query-aware policy: its probe and its second pass together).

    Attributes:
        recomputed: ``[T]`` bool (CPU), the tokens that ran the last layer fresh.
        recomputed_by_layer: tokens run fresh in each layer, first layer first (a probe's included).
        probe: what the query saw in the probe pass (query-aware policies).
        num_probe_tokens: tokens the probe pass ran through every layer.
    """

    recomputed: torch.Tensor
    recomputed_by_layer: tuple[int, ...]
    probe: Probe | None = None
    num_probe_tokens: int = 0

    def after(self, second: PassResult) -> PassResult:
        """This probe pass's result followed by the ``second`` pass's."""
        by_layer = zip(self.recomputed_by_layer, second.recomputed_by_layer, strict=True)
        recomputed = self.recomputed | second.recomputed
        return dataclasses.replace(self, recomputed=recomputed, recomputed_by_layer=tuple(a + b for a, b in by_layer))


class RecomputePass:
    """Builds a request's part of a batched forward, and tells what it ran once the forward is done.

    Args:
        selected: ``[T]`` bool (CPU), the tokens it runs (a dynamic policy drops some after each layer).
        num_output_rows: the last tokens of the prompt whose final hidden states the forward returns
            (1 to sample the next token; the query's length for ``Linked.logits``).
        probe: this pass is a query-aware policy's probe: it records the query's attention at every layer
            (``ProbeRecorder``) and returns no hidden states; ``Linker.probe_done`` sets up the second pass.
        chunkable: the pass may run in pieces over several forwards (chunked prefill: ``piece_size``): only a
            static policy's pass whose tokens' positions increase, so that a piece attends to the pieces before
            it exactly as one forward would (the slots of later pieces are unwritten: masked).
    """

    def __init__(
        self,
        assembly: Assembly,
        layout: Layout,
        selected: torch.Tensor,
        policy: Policy,
        *,
        num_layers: int,
        num_output_rows: int,
        probe: bool = False,
        chunkable: bool = False,
    ) -> None:
        self.assembly, self.layout, self.policy = assembly, layout, policy
        self.num_layers, self.is_probe = num_layers, probe
        self.num_output_rows_asked = num_output_rows  # the second pass's, after a probe
        self.num_output_rows = 0 if probe else num_output_rows
        self.index = selected.nonzero().squeeze(1)  # [n] prompt indices of the tokens run (CPU)
        self.chunkable = chunkable  # (``Linker._chunkable``)
        self.num_done = 0  # tokens run by the pieces so far
        self._tracker: _PassTracker | None = None
        self._recorder: ProbeRecorder | None = None
        self._inputs: tuple[torch.Tensor, ...] | None = None  # token ids, positions, slots of the pass (device)

    @property
    def num_tokens(self) -> int:
        """Tokens the pass runs through the first layer."""
        return self.index.shape[0]

    @property
    def num_left(self) -> int:
        return self.num_tokens - self.num_done

    @property
    def is_done(self) -> bool:
        return self.num_done == self.num_tokens

    def piece_size(self, max_tokens: int) -> int:
        """Tokens the next piece runs: every token left, or (a chunkable pass) at most ``max_tokens``, keeping
        the rows the pass returns in its last piece."""
        left = self.num_left
        if not self.chunkable or left <= max_tokens:
            return left
        size = min(max_tokens, left - self.num_output_rows)
        return size if size > 0 else left

    def seq_input(self, num_tokens: int | None = None) -> SeqInput:
        """The request's sequence in a forward: the next ``num_tokens`` of the pass (``None``: all that are left).
        The first piece writes the logical positions of the request's slots, those of later pieces' tokens
        excepted (unwritten: masked until their piece runs)."""
        req, layout = self.assembly.req, self.layout
        device = req.cache.device
        if self._inputs is None:
            index = to_device(self.index, device)  # host tensors: copies without a host sync
            slots, positions = to_device(layout.slots, device), to_device(layout.positions, device)
            req.kv_positions[slots] = positions
            if self.is_probe:
                layers = self.policy.probe_layers(self.num_layers)
                self._recorder = ProbeRecorder(layout, req, num_layers=self.num_layers, layers=layers)
            elif self.policy.is_dynamic:
                self._tracker = _PassTracker(self, index)
            self._inputs = (to_device(layout.token_ids, device)[index], positions[index], slots[index])
            if self.chunkable:  # each piece writes its own (``ModelRunner.forward``): a device op, the -1 its argument
                req.kv_positions.index_fill_(0, self._inputs[2], -1)  # (``[slots] = -1``: a blocking copy of the -1)
        start = self.num_done
        end = start + (self.num_left if num_tokens is None else num_tokens)
        self.num_done = end
        rows = torch.arange(end - start - self.num_output_rows, end - start, device=device) if self.is_done else None
        token_ids, positions, slots = (t[start:end] for t in self._inputs)
        return SeqInput(
            kv=req, token_ids=token_ids, positions=positions, slots=slots, output_rows=rows,
            after_layer=self._tracker or self._recorder,
        )  # fmt: skip

    def result(self) -> PassResult:
        """After the forward: the tokens that ran (and, for a probe, what the query saw)."""
        tracker, recorder = self._tracker, self._recorder
        tokens, counts = (
            (tracker.tokens, tracker.counts) if tracker else (self.index, [self.num_tokens] * self.num_layers)
        )
        recomputed = torch.zeros(self.layout.num_tokens, dtype=torch.bool)
        recomputed[tokens.cpu()] = True
        if recorder is None:
            return PassResult(recomputed=recomputed, recomputed_by_layer=tuple(counts))
        if recorder.exit is not None:  # the query left the probe after that layer
            left = self.num_tokens - self.layout.query.num_tokens
            counts = [n if layer <= recorder.exit else left for layer, n in enumerate(counts)]
        probe = recorder.probe(self.layout, recomputed)
        return PassResult(recomputed, tuple(counts), probe=probe, num_probe_tokens=self.num_tokens)


class _PassTracker:
    """The ``after_layer`` hook of a dynamic policy's pass: counts the tokens run per layer, asks the policy
    which keep running, and remembers the tokens that ran the last layer."""

    def __init__(self, pass_: RecomputePass, index: torch.Tensor) -> None:
        self._pass, self._index = pass_, index  # [n] prompt indices of the tokens the pass started with
        layout, req = pass_.layout, pass_.assembly.req
        self._cached = to_device(layout.cached, index.device)  # [T], moved to the device once per pass
        self._prompt_rows = req.physical(to_device(layout.slots, index.device))  # [T] every prompt token's row
        self.tokens = index  # prompt indices of the tokens that ran the latest layer
        self.counts: list[int] = []

    def __call__(self, view: LayerView) -> torch.Tensor | None:
        pass_, tokens = self._pass, self._index[view.alive]
        self.tokens = tokens
        self.counts.append(tokens.shape[0])
        step = LayerStep(
            layer=view.layer, num_layers=pass_.num_layers, layout=pass_.layout, tokens=tokens,
            cached=self._cached[tokens], rows=view.rows, source_rows=pass_.assembly.source_rows[tokens],
            cache=pass_.assembly.req.cache, view=view, prompt_rows=self._prompt_rows,
        )  # fmt: skip
        return pass_.policy.keep_mask(step)
