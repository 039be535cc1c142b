"""`python -m lightning_pipe.plan recipe=<name> pipeline.stages=8`: plan without training.

Costs come from a saved profile (`plan.profile=.../profile.json`, as training writes one; the link
model of `trainer.accelerator`'s device unless pipeline.bandwidth / latency are set, as training
uses); else a CPU recipe's blocks are profiled here on the data's first micro-batch, as its training
run measures them (profile.json is written), and so is a model with no FLOP model, one that loops
over its blocks (the hf-* recipes' Hugging Face models: traced first); else (a GPU recipe of ours)
they come from the model's FLOPs (`lightning_pipe.planning.transformer_costs`). The
decision is training's own (`planning.entry.plan_run`): what this prints is what training runs on
the same costs. Prints the plan table and writes plan.json and the predicted timeline into the
Hydra run directory.
`pipeline.schedule=auto` first compares the candidate schedules and prints why it chose one.
`pipeline.planner=2bw` runs PipeDream-2BW's planner instead (cli/plan_2bw.py): the table of every
(w, d, b, r) considered.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch.utils.data import DataLoader

from ..config import PipelineConfig
from ..errors import SettingError
from ..frontend import TracedPipeline, trace
from ..lightning.autoplan import loader_sample, profile_pipeline
from ..lightning.stage import find_pipeline
from ..planning import transformer_costs
from ..planning.auto import adam_weight_copies, memory_line, stage_memory, version_share
from ..planning.entry import block_kinds, link_model, plan_run
from ..planning.gathers import with_gathers
from ..planning.tensor import split_by_tensor
from ..planning.two_bw_costs import hardware
from ..profiling import Profile
from ..runtime.tied import tied_blocks
from ..schedules.text import dump
from ..simulation.timelines import gantt
from . import errors, tune
from .paths import CONFIG_DIR
from .plan_2bw import plan_from_cli
from .train import named, pipeline_config


@hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base="1.3")
@errors.reported
def _main(cfg: DictConfig) -> None:
    out = Path(HydraConfig.get().runtime.output_dir)
    try:
        config = pipeline_config(cfg)
        if config.tune:  # AvgPipe's tuner: profile one setting, predict the grid, print the table
            result = tune.tune(cfg, config, out)
            print(result.table())
            print(f"chosen: M={result.chosen.microbatches}, N={result.chosen.pipelines}; written: {out / 'tune.json'}")
            return
        if config.planner == "2bw":  # PipeDream-2BW's planner: width, depth, b, recomputation
            result, beside = plan_from_cli(cfg, config, out)
            print(result.table())
            print(beside)
            print(f"written: {out / 'plan_2bw.json'}")
            return
        world = config.world(int(cfg.trainer.devices), int(cfg.trainer.get("num_nodes", 1)))
        stages = config.stages or config.topology(world).depth
        microbatch = max(1, int(cfg.data.batch_size) // config.microbatches)
        device = "cpu" if str(cfg.trainer.get("accelerator", "auto")) == "cpu" else "cuda"
        ties: Optional[list[list[int]]] = None  # blocks sharing a weight, where known before the model is traced
        if cfg.plan.profile:
            costs, kinds = Profile.load(cfg.plan.profile).costs(*link_model(config, device)), model_kinds(cfg, config.blocks)
            source = f"profile {cfg.plan.profile}"
        elif device == "cpu" or "name" not in cfg.model.get("model", {}):
            # a CPU recipe (planned on what its blocks cost here, as its training run measures them), or a model
            # with no FLOP model (a Hugging Face one): measure its blocks on this machine's CPU
            profile, name, ties = measured_profile(cfg, config)
            profile.save(out / "profile.json")
            costs, kinds = profile.costs(*link_model(config, device)), block_kinds(profile.block_names)
            traced = "name" not in cfg.model.get("model", {})
            what = f"(first, {len(kinds) - 2} repeated or their halves, last) " if traced else ""
            why = "no FLOP model of its blocks" if traced else "a CPU recipe: what its training run measures"
            source = (
                f"the {len(kinds)} blocks of {name} {what}profiled on this machine's CPU in one "
                f"process, micro-batch {profile.microbatch_size} x {cfg.data.seq_len} tokens ({why}); saved as "
                f"{out / 'profile.json'}, pipeline.profile= plans from it again"
                + (
                    ""
                    if device == "cpu"
                    else "; this recipe trains on GPUs: plan.profile=<its training run's profile.json> plans with its costs"
                )
            )
        else:
            extra = {k: v for k, v in (("bandwidth", config.bandwidth), ("latency", config.latency)) if v is not None}
            costs, kinds = transformer_costs(
                cfg.model.model.name, microbatch, int(cfg.data.seq_len), device_flops=float(cfg.plan.device_flops), **extra
            )
            source = (
                f"FLOPs of {cfg.model.model.name}, micro-batch {microbatch} x {cfg.data.seq_len} tokens, at plan.device_flops="
                f"{float(cfg.plan.device_flops):.3g} FLOP/s per device (an accelerator's rate"
                + (
                    "; this recipe trains on CPU: plan.profile=<its training run's profile.json> plans with measured costs)"
                    if device == "cpu"
                    else ")"
                )
            )
        costs = split_by_tensor(costs, kinds, config.tensor, vocab="name" in cfg.model.get("model", {}))  # ours: vocabulary split
        apart: list[list[int]] = []
        if config.shard == "full" and config.width > 1:  # FSDP2's gathers: rings on the link settings (no processes to measure)
            hw = hardware(world, int(cfg.trainer.devices), device, None, config.intra_bandwidth, config.inter_bandwidth, config.latency)
            costs = with_gathers(costs, config.width, config.reshard, config.microbatches, hw.collectives(config.width * config.tensor))
            apart = ties if ties is not None else model_ties(cfg, config.blocks)  # blocks sharing a weight on different ranks
        result = plan_run(costs, stages, config, kinds, config.memory_limit, apart=apart)
    except (ValueError, FileNotFoundError) as err:
        if isinstance(err, SettingError) and err.setting:
            err = named(err)
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    timeline = result.timeline(costs)
    copies = adam_weight_copies(config.shard, config.width, config.reshard)
    memory = stage_memory(timeline, copies, costs.runtime_bytes, version_share(config.shard, config.width))
    mesh = {"pp": stages, "dp": config.replicas, "tp": config.tensor, "shard": config.shard}
    summary = {"costs": source, **result.summary(), "mesh": mesh}
    summary["predicted_memory_bytes"] = {"per_rank": memory, "weight_copies": copies, "runtime_bytes": costs.runtime_bytes}
    (out / "plan.json").write_text(json.dumps(summary, indent=1))
    picture = gantt(
        timeline, out / "plan_timeline.png", title=f"predicted: {config.partition} plan, {timeline.schedule.name}, {stages} ranks"
    )
    print(f"costs: {source}")
    tp = f" x tp {config.tensor}" if config.tensor > 1 else ""
    print(f"mesh: pp {stages} x dp {config.replicas}{tp}" + (f", shard={config.shard}" if config.shard != "none" else ""))
    for lines in result.report():
        print(lines)
    print(memory_line(memory, config.shard, config.width, costs.runtime_bytes, config.reshard, config.tensor))
    written = [out / "plan.json", *([picture] if picture is not None else [])]
    if cfg.plan.get("dump_schedule"):
        text = dump(timeline.schedule)
        (out / "schedule.txt").write_text(text)
        written.append(out / "schedule.txt")
        print(text, end="")
    print(f"written: {', '.join(map(str, written))}")


def meta_module(cfg: DictConfig) -> Any:
    """The recipe's LightningModule, built as training builds it (on the meta device, unless the model builds itself)."""
    with torch.device("meta"):
        return instantiate(cfg.model)


def model_kinds(cfg: DictConfig, blocks: Optional[str] = None) -> list[str]:
    """The recipe's blocks' kinds, as training finds them (the model built on the meta device)."""
    return block_kinds([type(b).__name__ for b in find_pipeline(meta_module(cfg), blocks)[1]])


def model_ties(cfg: DictConfig, blocks: Optional[str] = None) -> list[list[int]]:
    """The blocks sharing a weight (a tied embedding and head) of the model built on the meta device: ours; a model
    cut by tracing holds its weights in its blocks only once traced (`measured_profile`)."""
    return tied_blocks(find_pipeline(meta_module(cfg), blocks)[1])


def measured_profile(cfg: DictConfig, config: PipelineConfig) -> tuple[Profile, str, list[list[int]]]:
    """(profile, the model's class name, the blocks sharing a weight) of a model that loops over its blocks: built
    as training builds it, traced on the data's first micro-batch and its blocks profiled on it on the CPU, in this
    process, as a training run profiles them on its ranks (the loss charged to the last block)."""
    ours = "name" in cfg.model.get("model", {})
    module = instantiate(cfg.model) if ours else meta_module(cfg)  # ours: a CPU recipe's small model, built to run
    path, pipeline = find_pipeline(module, config.blocks)
    if not ours and not isinstance(pipeline, TracedPipeline):
        raise SettingError(
            f"{type(module).__name__}: no FLOP model for its blocks (model.model.name names one of ours); plan from a "
            "training run's profile: plan.profile=.../profile.json"
        )
    model_config = getattr(module, "config", None)
    fits = {
        "max_seq_len": getattr(model_config, "max_seq_len", None) or getattr(model_config, "max_position_embeddings", None),
        "model_vocab_size": getattr(model_config, "vocab_size", None),
    }
    datamodule = instantiate(cfg.data, **{k: v for k, v in fits.items() if v})
    datamodule.setup("fit")
    loader = DataLoader(datamodule.train_dataset, batch_size=int(cfg.data.batch_size))
    batch, size = loader_sample(loader, loader.dataset, config.microbatches)
    if not ours:  # where the model is cut: one run of its training_step on the micro-batch
        trace(module, path, pipeline, batch, sublayers=config.sublayers)
    profile = profile_pipeline(module, pipeline, batch, torch.device("cpu"), 0, 1, type(module).__name__, size)
    ties = tied_blocks(pipeline)  # a traced model's blocks hold their weights now
    return profile, (type(pipeline.original).__name__ if not ours else cfg.model.model.name), ties


def main() -> None:
    """`--dump-schedule` is `plan.dump_schedule=true` (Hydra takes no flags of its own kind)."""
    if "--dump-schedule" in sys.argv:
        sys.argv = [a for a in sys.argv if a != "--dump-schedule"] + ["plan.dump_schedule=true"]
    errors.run(_main)


if __name__ == "__main__":
    main()
