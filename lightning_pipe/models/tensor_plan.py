"""Our GPT / BERT blocks' tensor-parallel plan, Megatron's: attention split by heads (the fused q, k, v
column-parallel, the output projection row-parallel) and the MLP's halves column- then row-parallel, so
each sub-layer block needs one all-reduce forward and one backward. Embeddings and heads stay whole on
every rank (ours: the vocabulary is not split)."""

from __future__ import annotations

from typing import Optional

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from ..runtime.tensor_parallel import FusedColwise, Plan
from .blocks import Embedding, LMHead, MLMHead, ResidualAttentionBlock, ResidualFFNBlock


def tensor_plan(block: nn.Module, size: int) -> Optional[Plan]:
    """The plan of one of our blocks over `size` ranks; None for a block that is not ours. Raises ValueError
    when the block's heads or hidden features do not split over `size`."""
    if isinstance(block, ResidualAttentionBlock):
        heads = block.attn.n_head
        if heads % size:
            raise ValueError(f"{heads} attention heads do not split over tensor={size} ranks (the heads must be a multiple)")
        return {"attn.qkv": FusedColwise(3), "attn.proj": RowwiseParallel()}
    if isinstance(block, ResidualFFNBlock):
        hidden = block.mlp.fc.out_features
        if hidden % size:
            raise ValueError(f"an MLP of {hidden} hidden features does not split over tensor={size} ranks")
        return {"mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}
    if isinstance(block, (Embedding, LMHead, MLMHead)):
        return {}
    return None
