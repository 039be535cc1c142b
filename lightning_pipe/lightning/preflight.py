"""What must hold before any process starts: the model against the settings, the batch size, a
the Trainer's gradient accumulation and the checkpoint to resume from. Each failure is one `SettingError` naming the
setting or file, raised in the launching process (so nothing is spawned and nothing is written)."""

from __future__ import annotations

from dataclasses import fields
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

from ..config import PipelineConfig
from ..errors import SettingError
from ..modes.two_bw.settings import check_applied
from .compose import choose_layers
from .front import trace_before_spawn
from .metric_state import check_metrics
from .stage import PipelineSetupError, check_no_outside_parameters, find_pipeline
from .tensor import check_tensor_plans

_LIGHTNING_CKPT_ALIASES = ("last", "best", "hpc", "registry")  # fit resolves these itself
STRATEGY_SETTINGS = {f.name for f in fields(PipelineConfig)} - {"stages"}  # the strategy's keywords besides Lightning's


def strategy_config(settings: dict[str, Any]) -> PipelineConfig:
    """`AutoPipeStrategy(**settings)`'s config, checked; what a Trainer-built strategy cannot do is refused."""
    unknown = sorted(set(settings) - STRATEGY_SETTINGS)
    if unknown:
        raise SettingError(f"AutoPipeStrategy got unknown settings {unknown}; allowed: {sorted(STRATEGY_SETTINGS)}", unknown[0])
    if isinstance(settings.get("timeout"), timedelta):
        settings = {**settings, "timeout": settings["timeout"].total_seconds()}
    config = PipelineConfig(**{k: v for k, v in settings.items() if not (k == "timeout" and v is None)})
    if config.tune:
        raise SettingError(
            "tune=True: AvgPipe's tuner chooses how many processes run (pipelines x stages) before they start, which a "
            "Trainer's fixed devices cannot follow; run `python -m lightning_pipe.train ... pipeline.tune=true` (it profiles, "
            "then trains with the choice), or `python -m lightning_pipe.plan ... pipeline.tune=true` and pass the chosen "
            "pipelines= and microbatches= here",
            "tune",
        )
    return config


def validate_inputs(config: PipelineConfig, world: int, args: tuple, trainer: Optional[Any]) -> Optional[str]:
    """Every trainer function passes the model, then its dataloaders; fit's fifth is ckpt_path, which
    is returned (None when not fitting or not resuming). `world`: processes in the job."""
    model = args[0] if args else None
    fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
    resume_path = str(args[4]) if fitting and len(args) > 4 and args[4] is not None else None
    # a model created in configure_model(): its pipeline is checked in each process's setup, once built
    has_pipeline = isinstance(model, nn.Module) and not _built_in_each_process(model, config.blocks)
    if has_pipeline:
        path, pipeline = find_pipeline(model, config.blocks)
        if trainer is not None and len(args) > 1:  # a model looping over its blocks: cut (or refused) before spawning
            trace_before_spawn(model, trainer, args[1], config.microbatches, config.blocks, config.sublayers)
        check_no_outside_parameters(model, path)
        try:
            check_metrics(model)
        except ValueError as err:
            raise SettingError(str(err)) from None
        config.check_model(world, len(pipeline))
        check_tensor_plans(config, model, pipeline)
        if resume_path is not None:
            check_checkpoint(resume_path, model)
    if fitting and len(args) > 1:
        config.check_batch_size(getattr(args[1], "batch_size", None))
        if config.planner is not None:
            check_applied(config)
        if config.planner is not None and has_pipeline:
            config.check_plannable(world, len(find_pipeline(model, config.blocks)[1]), getattr(args[1], "batch_size", None))
    accumulate = getattr(trainer, "accumulate_grad_batches", 1)
    if fitting and (isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1):
        raise SettingError(f"accumulate_grad_batches={accumulate!r}: must be an integer >= 1 (Trainer / trainer.accumulate_grad_batches)")
    if fitting and len(args) > 3 and type(args[3]).__module__.startswith("lightning_pipe.data") and isinstance(model, nn.Module):
        from ..data.checks import check_model_vocab  # here: the strategy alone does not need the data package's imports

        try:  # every token id of the data (its tokenizer or token file) must be a row of the embedding
            check_model_vocab(model, args[3])
        except ValueError as err:
            raise SettingError(str(err)) from None
    if fitting:  # what the run's layers refuse (e.g. 2BW: gradient accumulation, fp16)
        choose_layers(config).check_trainer(config, trainer, model)
    return resume_path


def _built_in_each_process(model: nn.Module, blocks: Optional[str]) -> bool:
    """The model is created in `configure_model()` (Lightning calls it in each process, before setup)
    and holds no pipeline yet."""
    if not is_overridden("configure_model", model, LightningModule):
        return False
    try:
        find_pipeline(model, blocks)
    except PipelineSetupError:
        return True
    return False


def check_checkpoint(path: str, model: nn.Module) -> None:
    """The file exists, reads as a checkpoint and holds this model's keys and shapes."""
    if path in _LIGHTNING_CKPT_ALIASES:
        return
    where = Path(path)
    if not where.exists():
        raise SettingError(f"ckpt_path={path!r}: no such file or directory")
    from .checkpoint.sharded import is_sharded, read_meta

    try:
        if where.is_dir():
            if not is_sharded(where):
                raise SettingError(f"ckpt_path={path!r}: a directory that is not a sharded checkpoint (no meta.pt)")
            read_meta(where, weights_only=False)
            return
        try:  # mmap: the tensors are not read, a big checkpoint costs little to check
            checkpoint = torch.load(where, map_location="cpu", mmap=True, weights_only=False)
        except RuntimeError as err:
            if "mmap" not in str(err):
                raise
            checkpoint = torch.load(where, map_location="cpu", weights_only=False)
    except SettingError:
        raise
    except Exception as err:  # noqa: BLE001 - truncated zip, pickle garbage, ...: all mean "not readable"
        raise SettingError(f"ckpt_path={path!r}: not a readable checkpoint, truncated or corrupt? ({str(err).splitlines()[0]})") from None
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise SettingError(f"ckpt_path={path!r}: holds no 'state_dict': not a checkpoint written by Lightning")
    expected, saved = model.state_dict(), checkpoint["state_dict"]
    missing, unexpected = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
    if missing or unexpected:
        raise SettingError(f"ckpt_path={path!r} does not fit this model: missing keys {missing[:3]}, unexpected keys {unexpected[:3]}")
    for key, value in expected.items():
        if tuple(saved[key].shape) != tuple(value.shape):
            raise SettingError(
                f"ckpt_path={path!r} does not fit this model: {key} is {tuple(saved[key].shape)} there, {tuple(value.shape)} here"
            )
