"""Activation recomputation of one block (PipeDream-2BW §4.1).

A recomputed block keeps only its input for the backward pass, not the intermediate activations
its autograd graph would save; backward runs the block's forward again to rebuild them, then
differentiates. A stage trades about one more forward per micro-batch for the memory of its
in-flight micro-batches' activations, which 1F1B-style schedules hold for up to `depth` of them.

`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` does the work and stashes the RNG
state of the CPU and of the inputs' device, so dropout draws the same masks when replayed (device
generic: checkpoint handles the accelerator's RNG itself). One thing it does not know: a block
whose parameters are swapped in for its forward only, as 2BW's weight versions are
(`versions.WeightVersions.use`), would be replayed on whatever parameters the module holds when
backward runs (the live weights, an update later). So the parameters registered at forward time
are put back around the replay.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import checkpoint

Slots = list[tuple[nn.Module, str, Any]]  # (owner, name, the parameter registered there)


def _slots(block: nn.Module) -> Slots:
    return [(owner, name, p) for owner in block.modules() for name, p in owner._parameters.items()]


@contextmanager
def _registered(slots: Slots) -> Iterator[None]:
    """`slots`' parameters registered in their owners for the duration (a no-op when they still are)."""
    before = [owner._parameters[name] for owner, name, _ in slots]
    for owner, name, p in slots:
        owner._parameters[name] = p
    try:
        yield
    finally:
        for (owner, name, _), p in zip(slots, before):
            owner._parameters[name] = p


def recomputed(module: nn.Module, fn: Any, *inputs: Any) -> Any:
    """``fn(*inputs)`` (which reads `module`'s parameters) under checkpoint, replayed in backward on the
    parameters `module` holds now; the models' own per-block recompute flag uses it too."""
    # the parameters this forward reads (2BW: the micro-batch's version); FSDP2 swaps a sharded block's own
    # parameters in and out around each call, so there the replay takes whatever it registers then
    slots = [] if isinstance(module, FSDPModule) else _slots(module)

    def forward(*args: Any) -> Any:
        with _registered(slots):
            return fn(*args)

    # a block that reads state besides its inputs (a traced model's last block: the micro-batch's call)
    # gives checkpoint the context to replay it in (`replay_context`)
    context = getattr(module, "replay_context", None)
    if context is not None:
        return checkpoint(forward, *inputs, use_reentrant=False, preserve_rng_state=True, context_fn=context)
    return checkpoint(forward, *inputs, use_reentrant=False, preserve_rng_state=True)


def run_block(block: nn.Module, x: Any, recompute: bool) -> Any:
    """``block(x)``; with `recompute` (and grad enabled) its activations are recomputed in backward.

    `x` is a tensor or a tuple of tensors (a plain tuple goes to checkpoint as its arguments, so
    each tensor is saved as an input); the block receives it as one argument either way. Anything
    else (a stage's first input may be any structure) is passed through as one argument.
    """
    if not recompute or not torch.is_grad_enabled():
        return block(x)
    if type(x) is tuple:
        return recomputed(block, lambda *inputs: block(inputs), *x)
    return recomputed(block, block, x)
