"""Tensor parallelism in the planners' costs (ours): a block a plan splits over T ranks holds 1/T of its
weights on each and computes 1/T of its work; embeddings and heads stay whole (our plans, and Hugging Face
plans, do not split the vocabulary). The all-reduces a split block adds and the activations it keeps whole
(the residual stream) are not counted: the compute is a lower bound, the stashed activations an upper one."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from ..simulation.costs import CostModel

SPLIT_KINDS = ("attention", "ffn", "layer")  # entry.BLOCK_KINDS: what a plan splits


def split_by_tensor(costs: CostModel, kinds: Optional[Sequence[str]], tensor: int) -> CostModel:
    """`costs` as each rank of a tensor group sees its blocks (unchanged at tensor=1 or without kinds)."""
    if tensor == 1 or not kinds:
        return costs
    share = [1.0 / tensor if k in SPLIT_KINDS else 1.0 for k in kinds]

    def scaled(values: Sequence[float]) -> tuple[float, ...]:
        return tuple(v * s for v, s in zip(values, share)) if values else tuple(values)

    return dataclasses.replace(
        costs,
        forward=scaled(costs.forward),
        backward=scaled(costs.backward),
        param_bytes=scaled(costs.param_bytes),
        weight=scaled(costs.weight),
        backward_input=scaled(costs.backward_input),
    )
