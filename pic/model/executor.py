"""``Executor``: the one owner of the device in the engine (vLLM v1's model runner, nano-vllm's ``ModelRunner`` with
its sampler). It takes a plain step plan, ``StepPlan`` (each sequence's token ids, positions and slots over its block
table, ``SeqInput``; which rows to sample, with what options and generator), runs the runner's forward over it (the
KV tensors, CUDA graphs and attention backend are the runner's), then the LM head and the sampler over those rows,
and hands back ``StepResult``: a token id per sampled row, and each sequence's final hidden rows, which the engine
keeps without reading (a parked link's query rows, for its logits). The engine's scheduler decides who runs and
takes the ids in; it never touches a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pic.model.inputs import SeqInput
from pic.model.runner import ModelRunner
from pic.model.sampler import RowOptions, sample_rows, seeded_generator


@dataclass(frozen=True)
class SampleRow:
    """One token to sample: from the last final hidden state of sequence ``input_index`` of the plan's ``inputs``,
    or from ``hidden`` ``[hidden_size]`` when given (a parked link's last query row: no forward for it); with
    ``options`` (a ``pic.SamplingParams``) and ``generator`` (its own when seeded, else ``None``)."""

    options: RowOptions
    generator: torch.Generator | None = None
    input_index: int = -1
    hidden: torch.Tensor | None = None
    decode: bool = False  # it follows a decode step (all rows so: the LM head's decode products)


@dataclass(frozen=True)
class StepPlan:
    """A step for the executor: the forward's sequences (``inputs``: none, a step that only samples kept rows), the
    rows to sample, and ``sync``: synchronize the device once done (a link returns with its pass run)."""

    inputs: list[SeqInput] = field(default_factory=list)
    sample: list[SampleRow] = field(default_factory=list)
    sync: bool = False


@dataclass(frozen=True)
class StepResult:
    """Per sequence of the plan's ``inputs``, its final hidden states ``[m, hidden_size]`` (``ModelRunner.forward``);
    per row of its ``sample``, the token id sampled."""

    hidden: list[torch.Tensor]
    tokens: list[int]


class Executor:
    """Runs ``StepPlan``s on ``runner``; ``num_steps``, ``num_batched_seqs``: the forwards run and the sequences they
    carried (``/metrics``)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.num_steps = self.num_batched_seqs = 0

    def generator(self, seed: int | None) -> torch.Generator | None:
        """A seeded generation's own generator, on the device its sampling runs on (``None``: unseeded)."""
        return None if seed is None else seeded_generator(seed, self.runner.spec.device)

    def execute(self, plan: StepPlan) -> StepResult:
        """The plan's forward (none without inputs), then one token per row to sample (one host sync)."""
        hidden = self.runner.forward(plan.inputs) if plan.inputs else []
        if plan.inputs:
            self.num_steps += 1
            self.num_batched_seqs += len(plan.inputs)
        tokens: list[int] = []
        if plan.sample:
            rows = [r.hidden if r.hidden is not None else hidden[r.input_index][-1] for r in plan.sample]
            decode = all(r.decode for r in plan.sample)
            logits = self.runner.logits(torch.stack(rows), decode=decode)  # [B, vocab_size] float32
            tokens = sample_rows(logits, [r.options for r in plan.sample], [r.generator for r in plan.sample])
        device = self.runner.spec.device
        if plan.sync and device.type == "cuda":
            torch.cuda.synchronize(device)
        return StepResult(hidden, tokens)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, vocab_size]`` float32 logits of final hidden states ``hidden`` ``[N, hidden_size]``."""
        return self.runner.logits(hidden)
