"""Tensor parallelism inside a stage: each block's weights split over the mesh's "tp" dimension by its plan
(torch's `parallelize_module` and its styles), plus the styles our fused attention and our vocabulary need. No
Lightning.

Activations between blocks stay whole on every rank of a tensor group (a plan's row-parallel halves end in
an all-reduce, a vocabulary-parallel head gathers its logits), so a stage's input and output, and the pipeline's
messages, are what one process has. Under sequence parallelism a run of blocks passes the hidden state split over
the sequence (`sequence_scatter` before it, `sequence_gather` after it): a stage's ends stay whole. Under
`split_logits()` (loss parallelism) a vocabulary-parallel head's logits stay split over the vocabulary.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Mapping, Optional, Union

import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, loss_parallel, parallelize_module
from torch.distributed.tensor.placement_types import Placement, _StridedShard

# submodule name -> style, as `parallelize_module` takes it; or one style for the whole block
Plan = Union[Mapping[str, ParallelStyle], ParallelStyle]


class FusedColwise(ParallelStyle):
    """A Linear whose output is `parts` equal projections side by side (a fused q, k, v): each rank holds
    its columns of every part, so its output is its heads' q, k and v side by side. The weight is a strided
    shard (split into `parts`, then each part over the ranks): `full_tensor()` and checkpoints give back the
    single-process layout. Its input is whole on every rank (its gradient all-reduced in backward), or, with
    `input_layout=Shard(1)`, this rank's part of the sequence, gathered (its gradient reduce-scattered)."""

    def __init__(self, parts: int, input_layout: Optional[Placement] = None):
        super().__init__()
        self.parts = parts
        # Shard(1): the input split over the sequence (sequence parallelism), gathered; default: whole
        self.input_layout = input_layout if input_layout is not None else Replicate()

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise TypeError(f"FusedColwise splits an nn.Linear, not {type(module).__name__}")
        if module.out_features % (self.parts * device_mesh.size()):
            raise ValueError(
                f"a fused projection of {module.out_features} features does not split into {self.parts} parts over "
                f"{device_mesh.size()} tensor-parallel ranks"
            )
        placement = [_StridedShard(0, split_factor=self.parts)]
        for name, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.detach(), device_mesh, placement, src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        module.register_forward_pre_hook(_whole_input(device_mesh, self.input_layout))
        module.register_forward_hook(_local_output)
        return module


def _whole_input(mesh, layout: Placement) -> Callable:
    def hook(module: nn.Module, args: tuple) -> tuple:
        x, *rest = args
        if isinstance(x, DTensor):
            return args
        whole = DTensor.from_local(x, mesh, [layout], run_check=False)
        return (whole if layout.is_replicate() else whole.redistribute(mesh, [Replicate()]), *rest)

    return hook


def sequence_scatter(x: Tensor, mesh) -> Tensor:
    """This rank's part of `x` (batch, sequence, ...) split over the sequence (sequence parallelism: where the
    activations between a stage's blocks are split); backward: the parts' gradients gathered whole."""
    if x.shape[1] % mesh.size():
        raise ValueError(f"a sequence of {x.shape[1]} tokens does not split over tensor={mesh.size()} ranks")
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(1)]).to_local()


def sequence_gather(x: Tensor, mesh) -> Tensor:
    """The whole of `x` from every rank's part of its sequence (one all-gather); backward: this rank's part of the
    gradient (every rank's is the same whole one)."""
    return DTensor.from_local(x, mesh, [Shard(1)], run_check=False).full_tensor()


def _local_output(module: nn.Module, args: tuple, output):
    return output.to_local() if isinstance(output, DTensor) else output


class VocabParallel(ParallelStyle):
    """A token embedding (`nn.Embedding`) or a head whose `weight` (vocabulary x features, and its `bias` if it has
    one) is split over the vocabulary, dim 0, Megatron's vocabulary-parallel embedding: a tied embedding and head
    hold the same rows on each rank, so the tie's gradients are summed shard by shard. The blocks look tokens up
    with `vocab_lookup` and compute logits with `vocab_logits`. A vocabulary that the ranks do not divide splits
    unevenly (torch.chunk's rows). Parameters already split (the tied embedding's, split first on the same
    stage) are kept."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        for name in ("weight", "bias"):
            param = getattr(module, name, None)
            if not isinstance(param, nn.Parameter) or isinstance(param, DTensor):
                continue
            sharded = distribute_tensor(param.detach(), device_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        return module


def vocab_lookup(ids: Tensor, weight: Tensor) -> Tensor:
    """`F.embedding(ids, weight)`; with `weight` split over the vocabulary (`VocabParallel`) each rank looks up
    the ids among its rows (zeros for the others) and the ranks' lookups are summed (one all-reduce; backward:
    none, each rank's gradient lands in its own rows). Not torch's RowwiseParallel on the embedding: its backward
    gives the split weight a gradient of the whole table on every rank."""
    if not isinstance(weight, DTensor):
        return F.embedding(ids, weight)
    mesh, local = weight.device_mesh, weight.to_local()
    rows = -(-weight.shape[0] // mesh.size())  # torch.chunk's rows per rank; the last ranks may hold fewer
    start = min(mesh.get_local_rank() * rows, weight.shape[0])
    outside = (ids < start) | (ids >= start + local.shape[0])
    if local.shape[0] == 0:  # a rank past the vocabulary's end: nothing of its own (still in the graph)
        h = local.sum() * ids.new_zeros((*ids.shape, local.shape[1]), dtype=local.dtype)
    else:
        h = F.embedding((ids - start).masked_fill(outside, 0), local).masked_fill(outside.unsqueeze(-1), 0.0)
    return DTensor.from_local(h, mesh, [Partial()], run_check=False).full_tensor()


class _SplitLogits:
    """Whether `vocab_logits` keeps the logits split (inside `split_logits()`). A plain attribute: torch.compile
    reads it and guards on its value, where reading a ContextVar breaks a compiled block's graph."""

    on = False


_SPLIT_LOGITS = _SplitLogits()


@contextlib.contextmanager
def split_logits() -> Iterator[None]:
    """Loss parallelism (Megatron's parallel cross-entropy, as torch's `loss_parallel` runs it): inside, a
    vocabulary-parallel head returns its logits split over the vocabulary (a DTensor, `Shard(-1)`), and
    `F.cross_entropy` on them, forward and backward, reduces over the tensor ranks instead of gathering the
    logits whole. The backward must run inside too."""
    before, _SPLIT_LOGITS.on = _SPLIT_LOGITS.on, True
    try:
        with loss_parallel():
            yield
    finally:
        _SPLIT_LOGITS.on = before


def vocab_logits(h: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """`F.linear(h, weight, bias)`; with `weight` split over the vocabulary (`VocabParallel`) each rank computes
    its vocabulary's columns and the logits are gathered whole: the loss and the metrics are the LightningModule's
    own code on what the model returns, the logits one process has. Under `split_logits()` they stay split (each
    rank's columns, a DTensor) for a parallel cross-entropy. Backward: each rank keeps its columns of the logits'
    gradient (no message), and the input's gradient is summed over the ranks (one all-reduce)."""
    if not isinstance(weight, DTensor):
        return F.linear(h, weight, bias)
    x = DTensor.from_local(h, weight.device_mesh, [Replicate()], run_check=False)
    logits = F.linear(x, weight, bias)
    return logits if _SPLIT_LOGITS.on else logits.full_tensor()


def is_strided(t) -> bool:
    """A DTensor split as a strided shard (a `FusedColwise` weight): stores that take contiguous chunks
    (torch.distributed.checkpoint, FSDP2 on top) cannot take it as it is."""
    return isinstance(t, DTensor) and any(isinstance(p, _StridedShard) for p in t.placements)


def parallelize_blocks(blocks: Mapping[int, nn.Module], mesh, plan_for: Callable[[int, nn.Module], Optional[Plan]]) -> None:
    """Each block's weights split over `mesh` (1-D, the "tp" dimension) by `plan_for(index, block)`; an empty
    plan leaves the block whole on every rank. A block already split (an earlier fit's) is left as it is.
    A weight two blocks of the stage share (a tied embedding and head) stays one parameter: the later block
    takes the one the earlier block's plan made."""
    made: dict[int, nn.Parameter] = {}  # id of a whole parameter -> what it is after its first block's plan
    for index, block in blocks.items():
        if any(isinstance(p, DTensor) for p in block.parameters()):
            continue
        before = [(name, id(p)) for name, p in block.named_parameters(remove_duplicate=False)]
        for name, pid in before:
            if pid in made:  # split already by an earlier block's plan: styles keep a parameter already split
                owner, _, leaf = name.rpartition(".")
                (block.get_submodule(owner) if owner else block).register_parameter(leaf, made[pid])
        plan = plan_for(index, block)
        if isinstance(plan, ParallelStyle):
            parallelize_module(block, mesh, plan)
        elif plan:
            parallelize_module(block, mesh, dict(plan))
        for name, pid in before:
            made.setdefault(pid, block.get_parameter(name))
