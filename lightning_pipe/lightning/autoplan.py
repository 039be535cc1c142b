"""`partition="autopipe"` (or any planner): profile the blocks on the real ranks, then plan.

Runs in the strategy's setup, before the model is cut:
1. A sample micro-batch is taken from the training dataset directly (not through the DataLoader,
   whose sampler state must stay untouched for exact training) and the user's own step is run up
   to the pipeline call, which gives the pipeline's input.
2. Each rank profiles its share of the blocks (a uniform cut) on its own device, the shares are
   all-gathered, so every rank holds the same profile and computes the same plan.
3. The random-number state and the blocks' buffers are restored afterwards, so profiling leaves no
   trace in training.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..planning.partition import partition_blocks
from ..profiler import Profile, profile_blocks
from .stage import _Handoff

log = logging.getLogger(__name__)


def sample_microbatch(trainer: Any, size: int) -> Optional[Any]:
    """`size` samples of the training (or else validation) dataset, collated as the DataLoader would."""
    for source in (trainer.fit_loop._data_source, trainer.validate_loop._data_source):
        try:
            loader = source.dataloader() if source.is_defined() else None
        except Exception:  # a user hook that needs more setup than we have: fall back
            loader = None
        loader = loader[0] if isinstance(loader, (list, tuple)) and loader else loader
        dataset = getattr(loader, "dataset", None)
        if dataset is None or not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__") or len(dataset) == 0:
            continue
        collate = getattr(loader, "collate_fn", None) or torch.utils.data.default_collate
        return collate([dataset[i] for i in range(min(size, len(dataset)))])
    return None


def pipeline_input(module: Any, pipeline: nn.Sequential, batch: Any) -> Any:
    """Run the user's training_step on `batch` until it calls the pipeline; return the call's input."""

    def stop(_module: nn.Module, args: tuple) -> None:
        raise _Handoff(args[0])

    handle = pipeline.register_forward_pre_hook(stop)
    module.log = lambda *a, **k: None  # type: ignore[method-assign]  # no logging outside the loop
    try:
        with torch.no_grad():
            module.training_step(batch, 0)
    except _Handoff as handoff:
        return handoff.value
    finally:
        handle.remove()
        del module.log
    raise RuntimeError("training_step never called the pipeline; call self.<pipeline>(x) in it")


def profile_pipeline(module: Any, pipeline: nn.Sequential, batch: Any, device: torch.device, rank: int, world: int,
                     model_name: str, microbatch_size: int, repeats: int = 3) -> Profile:
    blocks = list(pipeline)
    mine = range(*partition_blocks("uniform", len(blocks), world).bounds[rank]) if world > 1 else range(len(blocks))
    buffers = [{n: b.detach().clone() for n, b in blk.named_buffers()} for blk in blocks]
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        x = pipeline_input(module, pipeline, batch)
        measured = profile_blocks(blocks, x, device, model=model_name, repeats=repeats, warmup=1, indices=list(mine))
    for blk, saved in zip(blocks, buffers):  # e.g. BatchNorm statistics: as if never run
        for n, b in blk.named_buffers():
            b.data.copy_(saved[n])
    parts = [None] * world
    if world > 1:
        dist.all_gather_object(parts, measured)
    else:
        parts = [measured]
    merged = {i: v for part in parts for i, v in part.items()}
    field = lambda name: [merged[i][name] for i in range(len(blocks))]  # noqa: E731
    dtype = str(next((p.dtype for p in pipeline.parameters()), torch.float32)).replace("torch.", "")
    return Profile(model_name, microbatch_size, dtype, device.type, field("forward"), field("backward"),
                   field("activation_bytes"), field("param_bytes"), field("peak_memory"),
                   [type(b).__name__ for b in blocks])
