"""Our GPT / BERT blocks' tensor-parallel plan, Megatron's: attention split by heads (the fused q, k, v
column-parallel, the output projection row-parallel) and the MLP's halves column- then row-parallel, so
each sub-layer block needs one all-reduce forward and one backward. The token embedding and the head are
split over the vocabulary (Megatron's vocabulary-parallel embedding): each rank holds vocabulary / T rows of the
(tied) weight; the embedding's lookups are summed over the ranks (one all-reduce), the head's logits gathered
whole (runtime/tensor_parallel.py `vocab_logits`). Position embeddings and norms stay whole (small)."""

from __future__ import annotations

from typing import Optional

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from ..runtime.tensor_parallel import FusedColwise, Plan, VocabParallel
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
        vocab = block.token.num_embeddings if isinstance(block, Embedding) else block.weight.shape[0]
        if vocab % size:
            # refused rather than padded: padding would change the weight's shape in checkpoints and in the
            # model handed back, and every rank's logits would need the padding masked out
            raise ValueError(f"a vocabulary of {vocab} tokens does not split over tensor={size} ranks (vocab_size must be a multiple)")
        if isinstance(block, Embedding):  # token ids whole on every rank; each rank looks up its rows, summed
            return {"token": RowwiseParallel(input_layouts=Replicate())}
        return VocabParallel()
    return None
