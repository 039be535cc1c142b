"""The front end's trace inside a run: the user's step on a sample micro-batch, before planning.

A model that loops over its blocks (`frontend`) is converted when the pipeline is first looked
for; how its forward is cut is learned from one run of the user's own `training_step`, on the
first samples of the training (or else validation) data, taken from the dataset directly so the
DataLoader's order is untouched. Before any process starts when `fit` got a DataLoader (a model
that cannot be cut is refused there), else in each process's setup.
"""

from __future__ import annotations

from typing import Any, Optional

from ..frontend import FrontendError, TracedPipeline, restore, trace
from .autoplan import loader_sample, sample_microbatch
from .stage import PipelineSetupError, find_pipeline


def _trace(module: Any, path: str, pipeline: TracedPipeline, batch: Any) -> None:
    try:
        trace(module, path, pipeline, batch)
    except FrontendError as err:
        raise PipelineSetupError(str(err)) from None


def ensure_traced(module: Any, trainer: Any, microbatches: int, blocks: Optional[str] = None) -> None:
    """In setup: trace the converted model (if it is one and was not traced before spawning)."""
    path, pipeline = find_pipeline(module, blocks)
    if not isinstance(pipeline, TracedPipeline) or pipeline.frontend.traced:
        return
    batch, _ = sample_microbatch(trainer, microbatches)
    if batch is None:
        raise PipelineSetupError(
            f"{type(module).__name__}'s model loops over its blocks and is cut by running its training_step once on a sample, "
            "but the run has no training or validation dataset to take one from"
        )
    _trace(module, path, pipeline, batch)


def trace_before_spawn(module: Any, loader: Any, microbatches: int, blocks: Optional[str] = None) -> None:
    """Before spawning: trace on the first samples of `loader`'s dataset, if it has one to index."""
    path, pipeline = find_pipeline(module, blocks)
    if not isinstance(pipeline, TracedPipeline) or pipeline.frontend.traced:
        return
    dataset = getattr(loader, "dataset", None)
    if dataset is None or not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__") or len(dataset) == 0:
        return
    batch, _ = loader_sample(loader, dataset, microbatches)
    _trace(module, path, pipeline, batch)


def restore_model(module: Any) -> None:
    """Put the user's model back in place of its traced pipeline (after fit in the launching process)."""
    for name, child in list(module.named_children()):
        if isinstance(child, TracedPipeline):
            setattr(module, name, restore(child))
