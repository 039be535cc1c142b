"""What must hold before any process starts: the model against the settings, the batch size, a
the Trainer's gradient accumulation and the checkpoint to resume from. Each failure is one `SettingError` naming the
setting or file, raised in the launching process (so nothing is spawned and nothing is written)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from ..errors import SettingError
from .stage import check_no_outside_parameters, find_pipeline

_LIGHTNING_CKPT_ALIASES = ("last", "best", "hpc", "registry")  # fit resolves these itself


def validate_inputs(strategy: Any, args: tuple, trainer: Optional[Any]) -> None:
    """Every trainer function passes the model, then its dataloaders; fit's fifth is ckpt_path."""
    config = strategy.config
    model = args[0] if args else None
    fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
    strategy.resume_path = str(args[4]) if fitting and len(args) > 4 and args[4] is not None else None
    if isinstance(model, nn.Module):
        path, pipeline = find_pipeline(model)
        check_no_outside_parameters(model, path)
        config.check_model(strategy.num_nodes * strategy.num_processes, len(pipeline))
        if strategy.resume_path is not None:
            check_checkpoint(strategy.resume_path, model)
    if fitting and len(args) > 1:
        config.check_batch_size(getattr(args[1], "batch_size", None))
        if config.planner is not None and isinstance(model, nn.Module):
            config.check_plannable(
                strategy.num_nodes * strategy.num_processes, len(find_pipeline(model)[1]), getattr(args[1], "batch_size", None)
            )
    accumulate = getattr(trainer, "accumulate_grad_batches", 1)
    if fitting and (isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1):
        raise SettingError(f"accumulate_grad_batches={accumulate!r}: must be an integer >= 1 (Trainer / trainer.accumulate_grad_batches)")
    if fitting and config.mode == "2bw":
        from .two_bw import check_trainer

        check_trainer(trainer, model)


def check_checkpoint(path: str, model: nn.Module) -> None:
    """The file exists, reads as a checkpoint and holds this model's keys and shapes."""
    if path in _LIGHTNING_CKPT_ALIASES:
        return
    where = Path(path)
    if not where.exists():
        raise SettingError(f"ckpt_path={path!r}: no such file or directory")
    from .checkpoint_sharded import is_sharded, read_meta

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
