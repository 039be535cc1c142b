"""tensor=T: this rank's blocks split over the mesh's "tp" dimension, before the replicas' layer shards them
(FSDP2 over "dp" then holds 2-D shards, as torchtitan composes them).

Whose plan: the LightningModule's `parallelize_block(block, tp_mesh)` when it has one (as Lightning's
ModelParallelStrategy hands `configure_model` its mesh); else our GPT / BERT blocks' plan; else a Hugging Face
model's own `config.base_model_tp_plan`; a block with none of them is refused, naming the hook.
sequence_parallel=True: our plan only; its attention and MLP blocks are marked (`sequence_parallel`, the tensor
mesh) so the stage passes them the hidden state split over the sequence (lightning/stage.py) and the gradients
sum their norms' over the group (lightning/gradients.py). loss_parallel=True: our plan only (its head keeps the
logits split, runtime/tensor_parallel.py; the step runner runs training steps under it, lightning/steps.py).
"""

from __future__ import annotations

import copy
from typing import Any, Optional

from torch import nn

from ..errors import SettingError
from ..frontend.tensor_plan import hf_plan_of, hf_tensor_plan
from ..models.tensor_plan import OUR_BLOCKS, SEQUENCE_BLOCKS, tensor_plan
from ..runtime.host_memory import return_large_buffers
from ..runtime.tensor_parallel import Plan, parallelize_blocks
from .context import RankContext


def parallelize_stage(ctx: RankContext) -> None:
    size = ctx.config.tensor
    if size == 1:
        return
    cut, mesh = ctx.cut, ctx.groups.mesh(ctx.device.type)["tp"]
    hook = getattr(ctx.module, "parallelize_block", None)
    hf = hf_plan_of(_traced_root(cut.stage))
    if cut.pipeline is not None:  # global rank 0 hands the trained model back in these modules: split copies
        memo: dict = {}  # one memo: a weight two of the stage's blocks share (a tied embedding and head) stays shared
        for index, block in cut.stage.blocks().items():
            cut.stage._modules[str(index)] = copy.deepcopy(block, memo)

    sequence, ours_only = ctx.config.sequence_parallel, _ours_only(ctx.config)

    def plan_for(index: int, block: nn.Module) -> Optional[Plan]:
        if callable(hook) and not ours_only:
            hook(block, mesh)
            return None
        if ours_only:
            check_our_plan(block, index, hook, ours_only)
        try:
            plan = tensor_plan(block, size, sequence)
            if sequence and isinstance(block, SEQUENCE_BLOCKS):
                block.sequence_parallel = mesh  # the stage splits its input over the sequence (lightning/stage.py)
            if plan is None and hf is not None:
                plan = hf_tensor_plan(block, hf)
        except ValueError as err:
            raise SettingError(f"tensor={size}: {err}", "tensor") from None
        if plan is None:
            raise SettingError(
                f"tensor={size}: block {index} ({type(block).__name__}) has no tensor-parallel plan; define "
                "parallelize_block(self, block, tp_mesh) on your LightningModule (e.g. torch's parallelize_module with "
                "ColwiseParallel / RowwiseParallel), or set tensor=1",
                "tensor",
            )
        return plan

    parallelize_blocks(cut.stage.blocks(), mesh, plan_for)


def _ours_only(config: Any) -> Optional[str]:
    """The setting that needs our GPT / BERT blocks' plan, if one is on."""
    return "sequence_parallel" if config.sequence_parallel else "loss_parallel" if config.loss_parallel else None


def check_our_plan(block: nn.Module, index: int, hook: Any, setting: str) -> None:
    """sequence_parallel / loss_parallel: only our blocks' plan knows where the sequence is split and keeps the
    head's logits split over the vocabulary."""
    if callable(hook) or not isinstance(block, OUR_BLOCKS):
        raise SettingError(
            f"{setting}=True runs our GPT / BERT blocks' plan; block {index} ({type(block).__name__}) is split by "
            + ("your parallelize_block" if callable(hook) else "another plan")
            + f": set {setting}=False",
            setting,
        )


def check_tensor_plans(config: Any, model: Any, pipeline: nn.Sequential) -> None:
    """Before spawning: our blocks split over tensor=T (heads, hidden features, the vocabulary), in one line; only
    ours under sequence_parallel=True or loss_parallel=True."""
    size, ours_only = config.tensor, _ours_only(config)
    if size > 1 and ours_only:
        for index, block in enumerate(pipeline):
            check_our_plan(block, index, getattr(model, "parallelize_block", None), ours_only)
    if size == 1 or callable(getattr(model, "parallelize_block", None)):
        return
    for block in pipeline:
        try:
            tensor_plan(block, size)
        except ValueError as err:
            raise SettingError(f"tensor={size}: {err}", "tensor") from None


def keep_host_memory_returnable(ctx: RankContext) -> None:
    """tensor > 1 on CPU, before the model is profiled and cut: freed large buffers (a stage's whole weights once
    split, the blocks' all-reduce buffers) go back to the system (as FSDP2's layer does for its own buffers)."""
    if ctx.config.tensor > 1 and ctx.device.type == "cpu":
        return_large_buffers()


def _traced_root(stage: Any) -> Any:
    """The user's model behind a traced pipeline's blocks (they share its front end), else None."""
    return next((b.frontend.root for b in stage.blocks().values() if getattr(b, "frontend", None) is not None), None)
