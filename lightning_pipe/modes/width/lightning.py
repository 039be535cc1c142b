"""Replicas of one pipeline (data parallel over `width`), or none: REDUCE averages across them.

`FullyShardedReplicas` (shard="full"): FSDP2's `fully_shard` on every block of the stage over the
stage's replicas (the run's mesh's "dp" dimension): parameters, gradients and optimizer state are each
1/width on a rank; a block's weights are gathered for its forward and backward and freed after each
(reshard="microbatch"), or kept from the step's first forward to its last backward (reshard="step");
under precision="bf16-mixed" gathered in bf16, the shards and optimizer state fp32 (`mixed_precision`);
its gradients accumulate unsharded over the step and are reduce-scattered once. REDUCE has nothing
left to average. Under a split backward (zero bubble) FSDP2's own post-backward would run after BI,
before W has accumulated the weight gradients, and would free the weights W still reads: every BI and
W runs with FSDP2's reduction and resharding off, W gathers the weights again where a forward freed
them since, and the chunk's REDUCE (after its last W) runs FSDP2's end of backward by hand
(`_finish_backward`), as torch.distributed.pipelining does. Checkpoints are whole tensors in
shard="none"'s layout (lightning/checkpoint/dtensors.py).

`ShardedOptimizer` (shard="optimizer"): ZeRO-1 over the replicas of each stage (engine.py). The
user's optimizers keep their objects (LR schedulers and Lightning hold them) but each param group
lists only the parameters this replica owns, so Adam's moments exist once per stage across the
width; after Lightning's step the owners broadcast. Checkpoints see whole optimizers: the owners'
states are gathered onto the replica that writes them, and a resume loads into whole groups before
the groups are cut back, so the files are those of shard="none" and resume across settings.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from ...config import PipelineConfig
from ...errors import SettingError
from ...lightning.compiling import copied
from ...runtime.host_memory import return_large_buffers
from ...runtime.tensor_parallel import is_strided
from ..lightning import ReplicasLayer
from . import settings
from .engine import broadcast_from_owners, owners


class NoReplicas(ReplicasLayer):
    """One pipeline."""


class AllReduce(ReplicasLayer):
    """`width` replicas of the pipeline (data parallel): REDUCE averages each chunk's gradients."""

    averages_gradients = True


class ShardedOptimizer(AllReduce):
    """ZeRO-1: `width` replicas whose optimizer state is partitioned over them (each parameter's on one)."""

    shards_optimizer = True

    def start(self) -> None:
        ctx = self.ctx
        self._whole = [[list(g["params"]) for g in opt.param_groups] for opt in ctx.optimizers]
        self._params = list({id(p): p for groups in self._whole for group in groups for p in group}.values())
        self._owner = owners([p.numel() for p in self._params], ctx.topology.width)
        self._mine = {id(p) for p, o in zip(self._params, self._owner) if o == ctx.replica_index}
        self._ranks = ctx.topology.stage_ranks(ctx.stage_index, ctx.tensor_index)  # this tensor rank's replicas
        self._restrict()

    def _restrict(self) -> None:
        """Each param group lists (and the optimizer keeps state for) this replica's parameters only."""
        for opt, groups in zip(self.ctx.optimizers, self._whole):
            for group, whole in zip(opt.param_groups, groups):
                group["params"] = [p for p in whole if id(p) in self._mine]
            for p in [p for p in opt.state if id(p) not in self._mine]:
                del opt.state[p]

    def optimizer_step(self, step: Callable[[], Any]) -> Any:
        result = step()
        broadcast_from_owners(self._params, self._owner, self._ranks, self.ctx.groups.stage)
        for p in self._params:  # Lightning zeroes the owned gradients; the others are spent too
            if id(p) not in self._mine:
                p.grad = None
        return result

    @contextlib.contextmanager
    def whole_optimizers(self, gather: bool) -> Iterator[None]:
        """Whole param groups inside the block; `gather`: with every parameter's state on replica 0
        (collective over the stage's replicas), which writes the checkpoint."""
        for opt, groups in zip(self.ctx.optimizers, self._whole):
            for group, whole in zip(opt.param_groups, groups):
                group["params"] = list(whole)
        try:
            if gather:
                self._gather_states()
            yield
        finally:
            self._restrict()

    def _gather_states(self) -> None:
        ctx = self.ctx
        index = {id(p): i for i, p in enumerate(self._params)}
        cpu = torch.device("cpu")
        mine = [{index[id(p)]: _to(s, cpu, local=True) for p, s in opt.state.items() if id(p) in self._mine} for opt in ctx.optimizers]
        parts: Any = [None] * ctx.topology.width if ctx.replica_index == 0 else None
        dist.gather_object(mine, parts, dst=self._ranks[0], group=ctx.groups.stage)
        if parts is None:
            return
        for part in parts[1:]:
            for opt, states in zip(ctx.optimizers, part):
                for i, s in states.items():
                    opt.state[self._params[i]] = _to(s, ctx.device, like=self._params[i])

    def switch_extras(self) -> None:
        """A live switch moves blocks with their optimizer state: refused (the legality table refuses adaptive)."""
        raise SettingError(
            "repartition() with shard='optimizer' is not built: the optimizer state a moved block needs is spread over the "
            "replicas; train with shard='none' to move blocks",
            "shard",
        )


class FullyShardedReplicas(ReplicasLayer):
    """FSDP2 per block over the stage's `width` replicas (shard="full")."""

    shards_optimizer = True  # the gradients a rank clips are its shards: the norm spans every rank

    @classmethod
    def check_trainer(cls, config: PipelineConfig, trainer: Any, model: Any) -> None:
        settings.check_trainer_full(trainer)
        settings.check_model_full(config, model)

    def prepare_stage(self) -> None:
        ctx, cut = self.ctx, self.ctx.cut
        held = set(cut.stage.blocks())
        strided = next((n for n, p in cut.stage.named_parameters() if is_strided(p)), None)
        if strided is not None:
            raise SettingError(settings.strided_message(ctx.config.tensor, strided), "shard")
        shared = [g for g in cut.ties if len({b for b, _ in g if b in held}) > 1]
        if shared:
            raise SettingError(
                f"shard='full' with a weight shared by blocks of one stage ({[b for b, _ in shared[0]]}, e.g. a tied embedding "
                "and head placed on one rank) is not built: FSDP2 shards each block on its own; use shard='optimizer', "
                "another partition or schedule, or untie them",
                "shard",
            )
        if ctx.device.type == "cpu":  # ours: FSDP2's per-block buffers go back to the system once freed
            return_large_buffers()
        mesh = ctx.groups.mesh(ctx.device.type)["dp"]  # the run's mesh: this stage across its replicas
        policy = mixed_precision(ctx.trainer, ctx.config.shard_mixed_precision)
        for index, block in cut.stage.blocks().items():
            if isinstance(block, FSDPModule) or not any(True for _ in block.parameters()):
                continue  # sharded by an earlier fit, or nothing to shard
            if cut.pipeline is not None:  # global rank 0 hands the trained model back in these modules: shard a copy
                block = copied(block)
                cut.stage._modules[str(index)] = block
            fully_shard(block, mesh=mesh, reshard_after_forward=ctx.config.reshard == "microbatch", mp_policy=policy)
            if ctx.config.reshard == "step":
                block.register_forward_pre_hook(_reshard_unless_training)
        if ctx.config.reshard == "microbatch":
            for chunk in cut.stage.chunk_bounds:
                _prefetch_forward(self._sharded(chunk))
        if cut.spec.kind.split_backward:
            for block in self._sharded(None):
                _accumulate_only(block)
            cut.stage.backward_sync = self._before_split_backward
            cut.stage.backward_end = self._after_split_backward
            cut.stage.gradients_final = self._reduce_split
        else:
            for block in self._sharded(None):  # FSDP2's default, whatever an earlier fit under zero bubble left
                block.set_is_last_backward(True)
            cut.stage.backward_sync = self._gradient_sync
            cut.stage.backward_end = cut.stage.gradients_final = None

    def _sharded(self, chunk: Optional[int]) -> list[FSDPModule]:
        """The sharded blocks of `chunk` (None: of the stage)."""
        stage = self.ctx.cut.stage
        indices = range(*stage.chunk_bounds[chunk]) if chunk is not None else stage.blocks()
        return [b for b in (stage._modules[str(i)] for i in indices) if isinstance(b, FSDPModule)]

    def _gradient_sync(self, chunk: int, last: bool) -> None:
        """Gradients accumulate unsharded over a step's micro-batches and are reduce-scattered once, in the
        chunk's last backward (as torch.distributed.pipelining's stage does); with reshard="step" the
        gathered weights are freed there too, not after every micro-batch's backward."""
        stage, per_step = self.ctx.cut.stage, self.ctx.config.reshard == "step"
        start, stop = stage.chunk_bounds[chunk]
        for index in range(start, stop):
            block = stage._modules[str(index)]
            if isinstance(block, FSDPModule):
                block.set_requires_gradient_sync(last, recurse=False)
                if per_step:
                    block.set_reshard_after_backward(last, recurse=False)

    def _before_split_backward(self, chunk: int, last: bool) -> None:
        """Before a W: the chunk's weights gathered again where a forward since freed them (reshard="microbatch"),
        as W's saved graph reads them; a no-op where they are still gathered."""
        for block in self._sharded(chunk):
            block.unshard()

    def _after_split_backward(self, chunk: int) -> None:
        """After a W: reshard="microbatch" frees the gathered weights (its gradients stay, unsharded, until REDUCE)."""
        if self.ctx.config.reshard == "microbatch":
            for block in self._sharded(chunk):
                block.reshard()

    def _reduce_split(self, chunk: int) -> None:
        """The chunk's last W has run: its accumulated gradients are reduce-scattered, its weights freed."""
        for block in self._sharded(chunk):
            _finish_backward(block)

    def switch_extras(self) -> None:
        """Refused, as `ShardedOptimizer`'s: the legality table refuses adaptive."""
        raise SettingError("repartition() with shard='full' is not built: train with shard='none' to move blocks", "shard")


def mixed_precision(trainer: Any, enabled: bool = True) -> MixedPrecisionPolicy:
    """FSDP2's precision for the Trainer's (`enabled`: the config's shard_mixed_precision).

    bf16-mixed: each block's weights gathered in bf16 (its forward and backward run in bf16) while the shards, the
    optimizer's master weights and state stay fp32 and gradients are reduce-scattered in fp32 (torchtitan's FSDP2
    default). Anything else: FSDP2's default, no cast. Under bf16-true / 16-true the model already is in that dtype:
    its gradients are reduced in it too, as shard='none' and 'optimizer' reduce theirs, so the three settings keep
    one update (an fp32 reduction would upcast every gradient, double the reduce-scatter's bytes and round the
    result back to the parameter's dtype anyway). 16-mixed (a GradScaler) is refused before spawning."""
    if enabled and getattr(getattr(trainer, "precision_plugin", None), "precision", None) == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def _prefetch_forward(blocks: list[FSDPModule]) -> None:
    """Each block's forward also starts the all-gather of the next block of its chunk, so that gather overlaps
    this block's compute (FSDP2's explicit forward prefetch, as torchtitan sets it; the backward prefetches
    implicitly). Each block is its own FSDP2 root, initialized at its first forward: done here for all, since a
    block prefetched by another has not run yet (private `FSDPState._lazy_init`, as `ShardedVersions` calls it)."""
    for block in blocks:
        fully_shard.state(block)._lazy_init()  # type: ignore[attr-defined]
    for block, following in zip(blocks, blocks[1:]):
        block.set_modules_to_forward_prefetch([following])


def _accumulate_only(block: FSDPModule) -> None:
    """A split backward's BI and W: FSDP2's post-backward (which fires after BI) keeps the gradients unsharded
    and unreduced and the weights gathered; `_finish_backward` reduces and frees them once W is done."""
    block.set_is_last_backward(False)
    block.set_requires_gradient_sync(False, recurse=False)
    block.set_reshard_after_backward(False, recurse=False)


def _finish_backward(block: FSDPModule) -> None:
    """FSDP2's end of a backward, run by hand after the step's last W of `block`: reduce-scatter the accumulated
    gradients, free the gathered weights, finalize the backward; then back to `_accumulate_only` for the next step.

    Private API (torch 2.x's `FSDPParamGroup.post_backward`, `FSDPState._root_post_backward_final_callback`), as
    torch.distributed.pipelining's stage calls them (`perform_reduce_grad`): FSDP2 has no public call for it, and its
    hooks run post-backward when a block's input gradient is done, i.e. after BI, before W has accumulated anything.
    Each block is its own FSDP2 root (sharded alone), so its state's context holds its own state only."""
    block.set_is_last_backward(True)
    block.set_requires_gradient_sync(True, recurse=False)
    block.set_reshard_after_backward(True, recurse=False)
    state = fully_shard.state(block)  # type: ignore[attr-defined]
    for each in state._state_ctx.all_states:
        for group in each._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()
    _accumulate_only(block)


def _reshard_unless_training(block: Any, args: Any) -> None:
    """reshard="step": a training forward keeps the gathered weights for the step's later micro-batches; an
    evaluation forward (no backward to free them, and an optimizer step may follow) frees them after itself."""
    block.set_reshard_after_forward(not (block.training and torch.is_grad_enabled()), recurse=False)


def _to(state: dict[str, Any], device: torch.device, local: bool = False, like: Optional[torch.Tensor] = None) -> dict[str, Any]:
    """An optimizer state's tensors on `device`. Tensor parallelism: `local` sends a DTensor's shard (a DTensor
    does not travel between processes: its mesh is this process's), `like` (the parameter) makes it one again."""
    out = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            v = (v.to_local() if local and isinstance(v, DTensor) else v).to(device)
            if isinstance(like, DTensor) and not isinstance(v, DTensor):
                v = DTensor.from_local(v, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride())
        out[k] = v
    return out
