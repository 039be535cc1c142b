"""ZeRO-1 (Rajbhandari et al., ZeRO: P_os, the optimizer state partitioned) over a stage's replicas.

Every replica of a stage holds the whole stage and all-reduces its gradients as before; each
parameter's optimizer state lives on one replica only (its owner), which alone steps it and then
broadcasts the new values to the other replicas. The update is the unsharded one exactly: an
optimizer such as Adam updates each parameter from its own gradient and state alone.

No Lightning here: the mode's Lightning layer (lightning.py) calls these on the stage's parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch import Tensor

from ...runtime.reduce import collective_in_buckets, local


def owners(sizes: Sequence[int], shards: int) -> list[int]:
    """The replica owning each parameter (`sizes`: element counts, in the optimizers' order): largest
    first onto the least-loaded replica, ties to the lower index (ZeroRedundancyOptimizer's rule), so
    every rank computes the same answer from the same stage."""
    load = [0] * shards
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        w = min(range(shards), key=lambda w: (load[w], w))
        owner[i] = w
        load[w] += sizes[i]
    return owner


def broadcast_from_owners(params: Sequence[Tensor], owner: Sequence[int], ranks: Sequence[int], group: Any) -> None:
    """After the owners' step: every replica gets each parameter's new value from its owner, in buckets
    per owner (`ranks`: the global rank of each replica in `group`). With tensor parallelism a replica
    broadcasts its tensor rank's shards (the group holds that shard's replicas)."""
    for w, src in enumerate(ranks):
        mine = [local(p.data) for p, o in zip(params, owner) if o == w]
        collective_in_buckets(mine, lambda buffer, src=src: dist.broadcast(buffer, src=src, group=group))
