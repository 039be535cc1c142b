"""Megatron-LM's partition: the same number of transformer layers on every stage.

With block kinds, a layer starts at each 'attention' block and holds the blocks up to the next one
(its FFN half); blocks before the first layer (the embedding) go to stage 0 and blocks after the
last one (the head) to the last stage, as Megatron places them. Without kinds, or with no
'attention' block among them, every block counts as a layer (`partition_blocks("uniform", ...)`).
"""

from __future__ import annotations

from typing import Optional, Sequence

from .partition import partition_blocks

Bounds = tuple[tuple[int, int], ...]

KINDS = ("embedding", "attention", "ffn", "head")  # other names are allowed and ride with a layer


def layer_starts(kinds: Sequence[str]) -> list[int]:
    return [i for i, k in enumerate(kinds) if k == "attention"]


def uniform_bounds(num_blocks: int, stages: int, kinds: Optional[Sequence[str]] = None) -> Bounds:
    starts = layer_starts(kinds) if kinds is not None else []
    if not starts:  # no kinds, or no transformer layers among them: every block is a unit
        return partition_blocks("uniform", num_blocks, stages).bounds
    layers = len(starts)
    if layers < stages:
        raise ValueError(
            f"uniform with block kinds gives every stage whole layers, but the model has {layers} layers "
            f"('attention' blocks) for {stages} stages: use at most {layers} stages or another method"
        )
    base, extra = divmod(layers, stages)
    # the remainder goes to the first stages: the last one already holds the head (the LM head
    # costs several layers' worth of FLOPs), the first only the light embedding
    per_stage = [base + (1 if s < extra else 0) for s in range(stages)]
    cuts, layer = [0], 0
    for count in per_stage[:-1]:
        layer += count
        cuts.append(starts[layer])
    cuts.append(num_blocks)
    return tuple(zip(cuts, cuts[1:]))
