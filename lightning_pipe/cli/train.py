"""`python -m lightning_pipe.train recipe=<name> [overrides]`: train a recipe with AutoPipeStrategy.

Everything is built and checked before training starts (model, data, strategy, trainer, the fit of
the pipeline to the devices), so a bad setting is one line on stderr, exit code 2, and the run
directory Hydra made for it is removed again. Outputs (CSV / TensorBoard logs, checkpoints, the
resolved config) go to the Hydra run directory.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Optional

import hydra
import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from ..config import PipelineConfig
from ..errors import SettingError
from ..lightning import AutoPipeStrategy
from ..lightning.stage import PipelineSetupError, find_pipeline
from .paths import CONFIG_DIR


def _instantiate_all(group: Optional[DictConfig]) -> list[Any]:
    """Instantiate each non-null entry of a callbacks / logger group (skipping optional extras not installed)."""
    out = []
    for entry in (group or {}).values():
        if entry is None:
            continue
        entry = OmegaConf.to_container(entry, resolve=True)
        needs = entry.pop("_if_installed_", None)
        if needs and importlib.util.find_spec(needs) is None:
            continue
        out.append(instantiate(entry))
    return out


def _start_method(pipeline: DictConfig) -> str:
    method = pipeline.get("start_method", "auto")
    if method != "auto":
        return method
    # Lightning's popen launcher re-runs the command line in its children; under a Hydra multirun
    # that would re-run the whole sweep in each child, so sweeps start their workers with spawn.
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        return "spawn"
    return "popen"


def pipeline_config(cfg: DictConfig) -> PipelineConfig:
    """The checked `PipelineConfig` of `cfg.pipeline` (its `_target_`), start_method resolved."""
    node = OmegaConf.to_container(cfg.pipeline, resolve=True)
    node["start_method"] = _start_method(cfg.pipeline)
    try:
        return instantiate(node)
    except InstantiationException as err:
        if isinstance(err.__cause__, SettingError):
            raise err.__cause__ from None
        raise


def named(err: SettingError, *also: str) -> SettingError:
    """The error with the Hydra keys to change, e.g. `(pipeline.waves, trainer.devices)`."""
    keys = [f"pipeline.{err.setting}"] if err.setting else []
    return SettingError(f"{err} ({', '.join(keys + list(also))})", err.setting)


def build(cfg: DictConfig) -> tuple[L.LightningModule, L.LightningDataModule, L.Trainer]:
    """Model, data and trainer from a composed config; raises on any bad setting before work starts."""
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    try:
        config = pipeline_config(cfg)
    except SettingError as err:
        raise named(err) from None
    module = instantiate(cfg.model)
    max_seq_len = getattr(getattr(module, "config", None), "max_seq_len", None)
    datamodule = instantiate(cfg.data, max_seq_len=max_seq_len) if max_seq_len else instantiate(cfg.data)
    datamodule.setup("fit")  # reads the corpus now: a missing or empty one is an error before any process starts
    world = int(cfg.trainer.devices) * int(cfg.trainer.get("num_nodes", 1))
    _, blocks = find_pipeline(module)
    try:
        config.check_model(world, len(blocks))
        config.check_batch_size(cfg.data.batch_size, "data.batch_size")
    except SettingError as err:
        raise named(err, f"trainer.devices x trainer.num_nodes = {world}") from None
    trainer_kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    trainer = L.Trainer(
        strategy=AutoPipeStrategy.from_config(config),
        callbacks=_instantiate_all(cfg.get("callbacks")),
        logger=_instantiate_all(cfg.get("logger")) or False,
        **trainer_kwargs,
    )
    return module, datamodule, trainer


def _fail(message: str, run_dir: Optional[Path], created: bool) -> None:
    if created and run_dir is not None and run_dir.exists() and os.environ.get("LOCAL_RANK", "0") == "0":
        shutil.rmtree(run_dir, ignore_errors=True)  # nothing half-written from a run that never started
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


@hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> Optional[float]:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    # Hydra has just made this folder for this run (its .hydra/ and the job's .log) unless it holds more
    created = run_dir.exists() and all(p.name == ".hydra" or p.suffix == ".log" for p in run_dir.iterdir())
    try:
        module, datamodule, trainer = build(cfg)
    except (ValueError, FileNotFoundError, PipelineSetupError, InstantiationException) as err:
        if isinstance(err, InstantiationException) and err.__cause__ is not None:
            err = err.__cause__  # the model's or data module's own message, not Hydra's wrapper
        _fail(str(err).splitlines()[0] if str(err) else type(err).__name__, run_dir, created)
    if trainer.is_global_zero:
        (run_dir / "config_resolved.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
    if cfg.get("test_after_fit"):
        trainer.validate(module, datamodule=datamodule)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    if trainer.is_global_zero:
        shown = ", ".join(f"{k}={metrics[k]:.4f}" for k in ("train_loss", "val_loss", "val_ppl") if k in metrics)
        print(f"[lightning-pipe] {HydraConfig.get().runtime.choices.get('recipe')}: {shown}  (outputs: {run_dir})")
    return metrics.get("val_loss")


if __name__ == "__main__":
    main()
