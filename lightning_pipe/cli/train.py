"""`python -m lightning_pipe.train recipe=<name> [overrides]`: train a recipe with AutoPipeStrategy.

Everything is built and checked before training starts (model, data, strategy, trainer, the fit of
the pipeline to the devices), so a bad setting is one line on stderr, exit code 2, and the run
directory Hydra made for it is removed again. Outputs (CSV / TensorBoard logs, checkpoints, the
resolved config) go to the Hydra run directory.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.fabric.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig, OmegaConf

from .. import faults
from ..config import PipelineConfig
from ..errors import SettingError
from ..lightning import AutoPipeStrategy
from ..lightning.stage import find_pipeline
from . import errors, loggers, tune
from .paths import CONFIG_DIR
from .quiet import lightning_lines_to_file, quiet_lightning

log = logging.getLogger("lightning_pipe.tune")


def _instantiate_all(group: Optional[DictConfig], name: str) -> list[Any]:
    """Instantiate each non-null entry of a callbacks / logger group (skipping optional extras not installed;
    a `_requires_` package missing is an error naming `name=<entry>`, see cli/loggers.py)."""
    loggers.check_required(group, name)
    out = []
    for entry in (group or {}).values():
        if entry is None:
            continue
        entry = OmegaConf.to_container(entry, resolve=True)
        needs = entry.pop("_if_installed_", None)
        entry.pop("_requires_", None)
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
    with torch.device("meta") if cfg.get("empty_init", True) else contextlib.nullcontext():  # no rank holds the whole model
        module = instantiate(cfg.model)
    # the model's context and vocabulary, which the data module checks its settings against (data.seq_len,
    # data.tokenizer / data.tokens: every id must be a row of the embedding)
    model_config = getattr(module, "config", None)
    context = getattr(model_config, "max_seq_len", None) or getattr(model_config, "max_position_embeddings", None)  # ours / HF's
    fits = {"max_seq_len": context, "model_vocab_size": getattr(model_config, "vocab_size", None)}
    datamodule = instantiate(cfg.data, **{k: v for k, v in fits.items() if v})
    datamodule.setup("fit")  # reads the corpus now: a missing or empty one is an error before any process starts
    trainer_kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    if HydraConfig.initialized() and not trainer_kwargs.get("default_root_dir"):
        # without a logger Lightning writes (plan.json, profiles) into the working directory: the run folder instead
        trainer_kwargs["default_root_dir"] = HydraConfig.get().runtime.output_dir
    callbacks, logger = _instantiate_all(cfg.get("callbacks"), "callbacks"), _instantiate_all(cfg.get("logger"), "logger")
    try:
        trainer = L.Trainer(strategy=AutoPipeStrategy.from_config(config), callbacks=callbacks, logger=logger or False, **trainer_kwargs)
    except SettingError as err:
        raise named(err, "trainer.devices", "trainer.num_nodes") from None
    except (MisconfigurationException, TypeError, ValueError, RuntimeError) as err:  # Lightning's checks of trainer.*
        where = ", ".join(f"trainer.{k}={cfg.trainer.get(k)}" for k in ("accelerator", "devices", "num_nodes"))
        raise SettingError(f"trainer: {str(err).splitlines()[0]} ({where})") from None
    world = config.world(trainer.num_devices, trainer.num_nodes)
    _, blocks = find_pipeline(module, config.blocks)  # a model looping over its blocks: converted here, traced in setup
    try:
        config.check_model(world, len(blocks))
        config.check_batch_size(cfg.data.batch_size, "data.batch_size")
    except SettingError as err:
        raise named(err, f"trainer.devices x trainer.num_nodes = {world}") from None
    return module, datamodule, trainer


def _tuned(cfg: DictConfig, run_dir: Path) -> None:
    """pipeline.tune=true: AvgPipe's tuner chooses M and N (once, in the launching process), and the
    config becomes the chosen job's."""
    try:
        config = pipeline_config(cfg)
        if not config.tune:
            return
        tune.check(cfg, config)
    except SettingError as err:
        raise named(err) from None
    stages = tune.depth(cfg, config)
    chosen = tune.tuned_before(cfg, config)
    if chosen is None:
        try:
            result = tune.tune(cfg, config, run_dir)
        except SettingError as err:
            raise named(err) from None
        log.info(result.table())
        log.info(f"tuner: M={result.chosen.microbatches}, N={result.chosen.pipelines} ({run_dir / 'tune.json'})")
        os.environ[tune.TUNED_ENV] = str(run_dir / "tune.json")  # the workers Lightning starts read the choice
        chosen = (result.chosen.microbatches, result.chosen.pipelines, result.partition)
    tune.apply(cfg, stages, *chosen)


class RunFolder:
    """The Hydra run folder of this job: removed again if the job fails before training a step
    (nothing half-written is left of a run that never trained). Only the first process does it."""

    def __init__(self, path: Path, multirun: bool) -> None:
        self.path, self.multirun = path, multirun
        # Hydra has just made it for this job (its .hydra/ and the job's .log) unless it holds more
        self.created = path.exists() and all(p.name == ".hydra" or p.suffix == ".log" for p in path.iterdir())
        self.trainer: Optional[L.Trainer] = None

    def remove_if_untrained(self) -> None:
        first = os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0"
        if not (first and self.created and self.path.exists()) or (self.trainer is not None and self.trainer.global_step > 0):
            return
        shutil.rmtree(self.path, ignore_errors=True)
        # and the folders above it that held only this run (outputs/<recipe>/, a sweep's multirun.yaml)
        parent, cwd = self.path.parent, Path.cwd().resolve()
        while parent.exists() and parent.resolve() != cwd and cwd in parent.resolve().parents:
            if any(p.name != "multirun.yaml" for p in parent.iterdir()):
                break
            shutil.rmtree(parent, ignore_errors=True)
            parent = parent.parent


def resume_from(ckpt_path: Optional[str], run_dir: Path, say: bool) -> Optional[str]:
    """`ckpt_path=last`: this run folder's checkpoints/last.ckpt when there is one (a requeued job,
    whose folder is its job id's), else a fresh start; any other value as given."""
    if ckpt_path != "last":
        return ckpt_path
    last = run_dir / "checkpoints" / "last.ckpt"
    if say:
        print(f"[lightning-pipe] ckpt_path=last: {'resuming from ' + str(last) if last.is_file() else 'no last.ckpt yet, starting fresh'}")
    return str(last) if last.is_file() else None


@hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base="1.3")
@errors.reported
def _main(cfg: DictConfig) -> Optional[float]:
    quiet_lightning(bool(cfg.get("verbose", False)))
    lightning_lines_to_file(bool(cfg.get("verbose", False)))
    hydra_cfg = HydraConfig.get()
    folder = RunFolder(Path(hydra_cfg.runtime.output_dir), hydra_cfg.mode == RunMode.MULTIRUN)
    faults.on_end(folder.remove_if_untrained)
    run_dir = folder.path
    _tuned(cfg, run_dir)
    module, datamodule, trainer = build(cfg)
    folder.trainer = trainer
    if trainer.is_global_zero:
        (run_dir / "config_resolved.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    trainer.fit(module, datamodule=datamodule, ckpt_path=resume_from(cfg.get("ckpt_path"), run_dir, trainer.is_global_zero))
    if cfg.get("test_after_fit"):
        trainer.validate(module, datamodule=datamodule)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    if trainer.is_global_zero:
        shown = ", ".join(f"{k}={metrics[k]:.4f}" for k in ("train_loss", "val_loss", "val_ppl") if k in metrics)
        print(f"[lightning-pipe] {hydra_cfg.runtime.choices.get('recipe')}: {shown}  (outputs: {run_dir})")
    return metrics.get("val_loss")


def main() -> Optional[float]:
    """`python -m lightning_pipe.train` and `lightning-pipe-train`: one `error: ...` line per failure."""
    return errors.run(_main)


if __name__ == "__main__":
    main()
