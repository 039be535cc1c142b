"""A host for plain PyTorch: an `nn.Sequential` cut into chunks, trained with a loss function.

This is the runtime without Lightning: benchmarks and the runtime's own tests use it, and it
shows in a few lines what the Lightning strategy's host does around the user's hooks.
With `recompute`, each block of an `nn.Sequential` chunk keeps only its input for backward and
runs again there (runtime.recompute), as a recomputing Lightning stage does.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from ..schedules.actions import PipelineSchedule
from .executor import Executor
from .microbatch import signature, split_microbatches
from .p2p import Activation, Transport
from .recompute import run_block
from .reduce import allreduce_mean


class SequentialHost:
    def __init__(
        self,
        chunks: dict[int, nn.Module],
        last_chunk: int,
        loss_fn: Callable[[Any, Any], Tensor],
        replica_group: Any = None,
        width: int = 1,
        recompute: bool = False,
    ):
        self.chunks, self.last_chunk, self.loss_fn = chunks, last_chunk, loss_fn
        self.replica_group, self.width, self.recompute = replica_group, width, recompute
        self.inputs: list[Any] = []
        self.targets: list[Any] = []
        self.weights: list[float] = []
        self.losses: list[Tensor] = []

    def forward(self, chunk: int, microbatch: int, inputs: Optional[Activation]) -> Any:
        x = self.inputs[microbatch] if chunk == 0 else inputs
        out = self._run(self.chunks[chunk], x)
        if chunk != self.last_chunk:
            return out
        loss = self.loss_fn(out, self.targets[microbatch])
        self.losses.append(loss.detach() * self.weights[microbatch])
        return loss * self.weights[microbatch]

    def _run(self, module: nn.Module, x: Any) -> Any:
        if not self.recompute:
            return module(x)
        if not isinstance(module, nn.Sequential):  # one block: recomputed as a whole
            return run_block(module, x, True)
        for block in module:
            x = run_block(block, x, True)
        return x

    def reduce_gradients(self, chunk: int) -> None:
        allreduce_mean(self.chunks[chunk].parameters(), self.replica_group, self.width)


class SequentialPipeline:
    """Runs one training step of `schedule` on this rank; returns the batch loss on the last rank."""

    def __init__(self, schedule: PipelineSchedule, rank: int, host: SequentialHost, transport: Transport, prefetch: bool = True):
        self.host = host
        self.executor = Executor(schedule, rank, transport, prefetch)
        self.microbatches = schedule.num_microbatches

    def step(self, inputs: Any, targets: Any) -> Optional[Tensor]:
        host = self.host
        host.inputs, host.weights = split_microbatches(inputs, self.microbatches)
        host.targets, _ = split_microbatches(targets, self.microbatches)
        host.losses = []
        keys = [signature(x) for x in host.inputs]
        self.executor.run(host, keys)
        return torch.stack(host.losses).sum() if host.losses else None
