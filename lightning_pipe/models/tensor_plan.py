"""Our GPT / BERT blocks' tensor-parallel plan, Megatron's: attention split by heads (the fused q, k, v
column-parallel, the output projection row-parallel) and the MLP's halves column- then row-parallel, so
each sub-layer block needs one all-reduce forward and one backward. The token embedding and the head are
split over the vocabulary (Megatron's vocabulary-parallel embedding): each rank holds vocabulary / T rows of the
(tied) weight; the embedding's lookups are summed over the ranks (one all-reduce), the head's logits gathered
whole (runtime/tensor_parallel.py `vocab_lookup`, `vocab_logits`). Position embeddings and norms stay whole (small).
Raises ValueError (`tensor_plan`) where heads or hidden features do not split; a vocabulary splits unevenly."""

from __future__ import annotations

from typing import Optional

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from ..runtime.tensor_parallel import FusedColwise, Plan, VocabParallel
from .blocks import Embedding, LMHead, MLMHead, ResidualAttentionBlock, ResidualFFNBlock

SEQUENCE_BLOCKS = (ResidualAttentionBlock, ResidualFFNBlock)  # what runs on a part of the sequence under sequence parallelism
OUR_BLOCKS = (Embedding, LMHead, MLMHead, *SEQUENCE_BLOCKS)


def tensor_plan(block: nn.Module, size: int, sequence: bool = False) -> Optional[Plan]:
    """The plan of one of our blocks over `size` ranks; None for a block that is not ours. Raises ValueError
    when the block's heads or hidden features do not split over `size`. `sequence`: sequence parallelism
    (Megatron-SP), the attention and MLP blocks' input and output split over the sequence (dim 1): the first
    projection gathers it (all-gather; backward reduce-scatter), the last one reduce-scatters (instead of an
    all-reduce), so the norms, dropout and residual add between them run on this rank's part of the sequence."""
    inner = Shard(1) if sequence else Replicate()
    if isinstance(block, ResidualAttentionBlock):
        heads = block.attn.n_head
        if heads % size:
            raise ValueError(f"{heads} attention heads do not split over tensor={size} ranks (the heads must be a multiple)")
        return {"attn.qkv": FusedColwise(3, inner), "attn.proj": RowwiseParallel(output_layouts=inner)}
    if isinstance(block, ResidualFFNBlock):
        hidden = block.mlp.fc.out_features
        if hidden % size:
            raise ValueError(f"an MLP of {hidden} hidden features does not split over tensor={size} ranks")
        return {"mlp.fc": ColwiseParallel(input_layouts=inner), "mlp.proj": RowwiseParallel(output_layouts=inner)}
    if isinstance(block, (Embedding, LMHead, MLMHead)):
        # a vocabulary that T does not divide splits unevenly, as torch.chunk splits rows (ceil(V / T) on each rank,
        # the last the rest), rather than padded: the weight keeps its one-process shape in checkpoints and in the
        # model handed back, and no padded logit needs masking
        if isinstance(block, Embedding):  # token ids whole on every rank; each rank looks up its rows, summed
            return {"token": VocabParallel()}
        return VocabParallel()
    return None
