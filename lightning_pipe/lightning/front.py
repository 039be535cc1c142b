"""The front end's trace inside a run: the user's step on a sample micro-batch, before planning.

A model that loops over its blocks (`frontend`) is converted when the pipeline is first looked
for; how its forward is cut is learned from one run of the user's own `training_step`, on the
first samples of the training (or else validation) data, taken from the dataset directly so the
DataLoader's order is untouched. Before any process starts when `fit` got a DataLoader (a model
that cannot be cut is refused there), else in each process's setup.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.trainer.states import TrainerFn

from ..frontend import FrontendError, TracedPipeline, restore, trace
from .autoplan import loader_sample, sample_microbatch
from .stage import PipelineSetupError, find_pipeline

STEPS = {
    TrainerFn.FITTING: ("training_step", "fit_loop"),
    TrainerFn.VALIDATING: ("validation_step", "validate_loop"),
    TrainerFn.TESTING: ("test_step", "test_loop"),
    TrainerFn.PREDICTING: ("predict_step", "predict_loop"),
}


def _trace(module: Any, path: str, pipeline: TracedPipeline, batch: Any, step: str, sublayers: bool) -> None:
    try:
        trace(module, path, pipeline, batch, step, sublayers)
    except FrontendError as err:
        raise PipelineSetupError(str(err)) from None


def _step(trainer: Any) -> str:
    return STEPS.get(trainer.state.fn, STEPS[TrainerFn.FITTING])[0]


def ensure_traced(module: Any, trainer: Any, microbatches: int, blocks: Optional[str] = None, sublayers: bool = True) -> None:
    """In setup: trace the converted model (if it is one and was not traced before spawning), with
    the step this trainer function runs (training_step for fit, predict_step for predict ...)."""
    path, pipeline = find_pipeline(module, blocks)
    if not isinstance(pipeline, TracedPipeline) or pipeline.frontend.traced:
        return
    step, loop = STEPS.get(trainer.state.fn, STEPS[TrainerFn.FITTING])
    batch = None
    if loop != "fit_loop":
        source = getattr(trainer, loop)._data_source
        loader = source.dataloader() if source.is_defined() else None
        loader = loader[0] if isinstance(loader, (list, tuple)) and loader else loader
        if loader is not None and _indexable(getattr(loader, "dataset", None)):
            batch, _ = loader_sample(loader, loader.dataset, microbatches)
    else:
        batch, _ = sample_microbatch(trainer, microbatches)
    if batch is None:
        raise PipelineSetupError(
            f"{type(module).__name__}'s model loops over its blocks and is cut by running its {step} once on a sample, "
            "but the run has no dataset with indexable samples to take one from"
        )
    _trace(module, path, pipeline, batch, step, sublayers)


def _indexable(dataset: Any) -> bool:
    return dataset is not None and hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__") and len(dataset) > 0


def trace_before_spawn(
    module: Any, trainer: Any, loader: Any, microbatches: int, blocks: Optional[str] = None, sublayers: bool = True
) -> None:
    """Before spawning: trace on the first samples of `loader`'s dataset, if it has one to index."""
    path, pipeline = find_pipeline(module, blocks)
    if not isinstance(pipeline, TracedPipeline) or pipeline.frontend.traced:
        return
    loader = loader[0] if isinstance(loader, (list, tuple)) and loader else loader
    if not _indexable(getattr(loader, "dataset", None)):
        return
    batch, _ = loader_sample(loader, loader.dataset, microbatches)
    _trace(module, path, pipeline, batch, _step(trainer), sublayers)


def restore_model(module: Any) -> None:
    """Put the user's model back in place of its traced pipeline (after fit in the launching process)."""
    for name, child in list(module.named_children()):
        if isinstance(child, TracedPipeline):
            setattr(module, name, restore(child))
