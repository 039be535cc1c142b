"""`python -m lightning_pipe.plan recipe=<name> pipeline.stages=8`: plan without training.

Costs come from a saved profile (`pipeline.profile=.../profile.json`, as training writes one) or,
by default, from the model's FLOPs (`lightning_pipe.planning.transformer_costs`). Prints the plan
table and writes plan.json and the predicted timeline into the Hydra run directory.
`pipeline.schedule=auto` first compares the candidate schedules and prints why it chose one.
`pipeline.planner=2bw` runs PipeDream-2BW's planner instead (cli/plan_2bw.py): the table of every
(w, d, b, r) considered.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from ..errors import SettingError
from ..planning import plan, transformer_costs
from ..planning.auto import choose_schedule
from ..planning.replay import cached_schedule
from ..planning.slicer import choose_slicing, fixed_slicing, simulate_sliced
from ..profiling import Profile
from ..schedules import ScheduleSpec
from ..schedules.text import dump
from ..simulation import simulate
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
            result = plan_from_cli(cfg, config, out)
            print(result.table())
            print(f"written: {out / 'plan_2bw.json'}")
            return
        world = int(cfg.trainer.devices) * int(cfg.trainer.get("num_nodes", 1))
        stages = config.stages or config.topology(world).depth
        method = config.partition if isinstance(config.partition, str) else None
        microbatch = max(1, int(cfg.data.batch_size) // config.microbatches)
        if method is None:
            raise SettingError(f"partition={config.partition}: the plan command needs a method name (autopipe, dp, ...)", "partition")
        if cfg.plan.profile:
            costs, kinds = Profile.load(cfg.plan.profile).costs(config.bandwidth or 25e9, config.latency or 20e-6), None
            source = f"profile {cfg.plan.profile}"
        else:
            extra = {k: v for k, v in (("bandwidth", config.bandwidth), ("latency", config.latency)) if v is not None}
            costs, kinds = transformer_costs(
                cfg.model.model.name, microbatch, int(cfg.data.seq_len), device_flops=float(cfg.plan.device_flops), **extra
            )
            source = f"FLOPs of {cfg.model.model.name}, micro-batch {microbatch} x {cfg.data.seq_len} tokens"
        m = config.microbatches
        choice = None
        if config.auto:
            choice = choose_schedule(costs, stages, m, method=method, kinds=kinds, memory_limit=config.memory_limit, slicer=config.slicer)
            result, spec = choice.plan, ScheduleSpec.of(choice.chosen.schedule, **choice.chosen.schedule_options)
            slicing = fixed_slicing(costs, result.bounds, m, choice.chosen.sliced, spec.name) if choice.chosen.sliced else None
        else:
            spec = config.schedule_spec
            result = plan(costs, stages, m, method=method, schedule=spec.name, kinds=kinds, options=spec.kwargs)
            slicing = choose_slicing(costs, result.bounds, m, spec.name) if config.slicer else None
    except (ValueError, FileNotFoundError) as err:
        if isinstance(err, SettingError) and err.setting:
            err = named(err)
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    schedule, options = spec.name, spec.kwargs
    summary = {"costs": source, "plan": result.to_dict()}
    if choice is not None:
        summary["schedule_choice"] = choice.to_dict()
    if slicing is not None:
        summary["slicer"] = slicing.summary()
    (out / "plan.json").write_text(json.dumps(summary, indent=1))
    if options:
        timeline = simulate(cached_schedule(schedule, stages, m, tuple(sorted(options.items()))), costs, result.bounds)
    else:
        timeline = simulate_sliced(costs, result.bounds, m, slicing.sliced if slicing else 0, schedule)
    gantt(timeline, out / "plan_timeline.png", title=f"predicted: {method} plan, {timeline.schedule.name}, {stages} ranks")
    print(f"costs: {source}")
    if choice is not None:
        print(choice.table())
    print(result.table())
    if slicing is not None:
        print(
            f"slicer: cut {slicing.sliced} warm-up micro-batches in halves: start-up {slicing.baseline_startup * 1e3:.2f} -> "
            f"{slicing.startup * 1e3:.2f} ms, iteration {slicing.baseline_iteration_time * 1e3:.2f} -> {slicing.iteration_time * 1e3:.2f} ms"
        )
    written = [out / "plan.json", out / "plan_timeline.png"]
    if cfg.plan.get("dump_schedule"):
        text = dump(timeline.schedule)
        (out / "schedule.txt").write_text(text)
        written.append(out / "schedule.txt")
        print(text, end="")
    print(f"written: {', '.join(map(str, written))}")


def main() -> None:
    """`--dump-schedule` is `plan.dump_schedule=true` (Hydra takes no flags of its own kind)."""
    if "--dump-schedule" in sys.argv:
        sys.argv = [a for a in sys.argv if a != "--dump-schedule"] + ["plan.dump_schedule=true"]
    errors.run(_main)


if __name__ == "__main__":
    main()
