"""`python -m lightning_pipe.plan recipe=<name> pipeline.stages=8`: plan without training.

Costs come from a saved profile (`pipeline.profile=.../profile.json`, as training writes one) or,
by default, from the model's FLOPs (`lightning_pipe.planning.transformer_costs`). Prints the plan
table and writes plan.json and the predicted timeline into the Hydra run directory.
`pipeline.schedule=auto` first compares the candidate schedules and prints why it chose one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from ..planning import plan, transformer_costs
from ..planning.auto import choose_schedule
from ..planning.replay import cached_schedule
from ..planning.slicer import choose_slicing, fixed_slicing, simulate_sliced
from ..simulator import simulate
from ..profiler import Profile
from ..viz import gantt
from .paths import CONFIG_DIR


@hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    pipe = cfg.pipeline
    world = int(cfg.trainer.devices) * int(cfg.trainer.get("num_nodes", 1))
    stages = int(pipe.stages) if pipe.stages else world // int(pipe.width)
    method = pipe.partition if isinstance(pipe.partition, str) else None
    microbatch = max(1, int(cfg.data.batch_size) // int(pipe.microbatches))
    try:
        if method is None:
            raise ValueError(f"pipeline.partition={list(pipe.partition)}: the plan command needs a method name (autopipe, dp, ...)")
        if cfg.plan.profile:
            costs, kinds = Profile.load(cfg.plan.profile).costs(pipe.bandwidth or 25e9, pipe.latency or 20e-6), None
            source = f"profile {cfg.plan.profile}"
        else:
            extra = {k: v for k, v in (("bandwidth", pipe.bandwidth), ("latency", pipe.latency)) if v is not None}
            costs, kinds = transformer_costs(cfg.model.model.name, microbatch, int(cfg.data.seq_len),
                                             device_flops=float(cfg.plan.device_flops), **extra)
            source = f"FLOPs of {cfg.model.model.name}, micro-batch {microbatch} x {cfg.data.seq_len} tokens"
        m, schedule = int(pipe.microbatches), str(pipe.schedule).lower()
        options = {"interleaved": {"chunks": int(pipe.chunks)}, "wave": {"waves": int(pipe.waves)}}.get(schedule, {})
        choice = None
        if schedule == "auto":
            choice = choose_schedule(costs, stages, m, method=method, kinds=kinds, memory_limit=pipe.get("memory_limit"), slicer=pipe.slicer)
            result, schedule, options = choice.plan, choice.chosen.schedule, choice.chosen.schedule_options
            slicing = fixed_slicing(costs, result.bounds, m, choice.chosen.sliced, schedule) if choice.chosen.sliced else None
        else:
            result = plan(costs, stages, m, method=method, schedule=schedule, kinds=kinds, options=options)
            if pipe.slicer and options:
                raise ValueError(f"pipeline.slicer=true works with pipeline.schedule=gpipe or 1f1b, not {schedule!r}")
            slicing = choose_slicing(costs, result.bounds, m, schedule) if pipe.slicer else None
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    out = Path(HydraConfig.get().runtime.output_dir)
    summary = {"costs": source, "plan": result.to_dict()}
    if choice is not None:
        summary["schedule_choice"] = choice.to_dict()
    if slicing is not None:
        summary["slicer"] = {"sliced": slicing.sliced, "startup": slicing.startup, "baseline_startup": slicing.baseline_startup,
                             "iteration_time": slicing.iteration_time, "baseline_iteration_time": slicing.baseline_iteration_time}
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
        print(f"slicer: cut {slicing.sliced} warm-up micro-batches in halves: start-up {slicing.baseline_startup * 1e3:.2f} -> "
              f"{slicing.startup * 1e3:.2f} ms, iteration {slicing.baseline_iteration_time * 1e3:.2f} -> {slicing.iteration_time * 1e3:.2f} ms")
    print(f"written: {out / 'plan.json'}, {out / 'plan_timeline.png'}")


if __name__ == "__main__":
    main()
