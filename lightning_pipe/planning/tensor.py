"""Tensor parallelism in the planners' costs (ours): a block a plan splits over T ranks holds 1/T of its
weights on each and computes 1/T of its work. Our GPT / BERT plan splits the token embedding and the head over
the vocabulary too (their small whole parts, position embeddings and norms, are counted split with them);
a Hugging Face model's plan leaves its embedding and head whole. The all-reduces a split block adds, the logits
a split head gathers and the activations it keeps whole (the residual stream) are not counted: the compute is a
lower bound, the stashed activations an upper one."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from ..simulation.costs import CostModel

SPLIT_KINDS = ("attention", "ffn", "layer")  # entry.BLOCK_KINDS: what a plan splits
VOCAB_KINDS = ("embedding", "head")  # what our plan splits over the vocabulary as well
VOCAB_BLOCKS = ("Embedding", "LMHead", "MLMHead")  # our blocks of those kinds (models/tensor_plan.py)


def splits_vocabulary(names: Sequence[str]) -> bool:
    """Whether blocks of these class names are ours, whose plan splits the embedding and head over the vocabulary."""
    return any(name in VOCAB_BLOCKS for name in names)


def split_by_tensor(costs: CostModel, kinds: Optional[Sequence[str]], tensor: int, vocab: bool = False) -> CostModel:
    """`costs` as each rank of a tensor group sees its blocks (unchanged at tensor=1 or without kinds); `vocab`:
    the embedding and head are split too (our plan)."""
    if tensor == 1 or not kinds:
        return costs
    split = SPLIT_KINDS + VOCAB_KINDS if vocab else SPLIT_KINDS
    share = [1.0 / tensor if k in split else 1.0 for k in kinds]

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
