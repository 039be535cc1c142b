"""`python -m lightning_pipe.plan ... pipeline.planner=2bw`: PipeDream-2BW's planner without training.

Costs come from a saved sized profile (`plan.profile=.../sized_profile.json`, as a training run with
planner=2bw writes one) or from the model's FLOPs (`planning.sized.analytic_profile`). Prints the
table of candidates (the paper's Table 1 shape), the chosen mesh and its predicted memory per rank, and
writes plan_2bw.json. `pipeline.plan_mesh=true` also searches tensor and shard (planning/two_bw_mesh.py)
with the collectives priced on the bandwidth settings (no processes here to measure them on).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from ..errors import SettingError
from ..modes.two_bw import settings as two_bw_settings
from ..planning.entry import block_kinds
from ..planning.sized import SizedProfile, analytic_profile
from ..planning.two_bw import NoConfiguration, TwoBWPlan, plan_2bw, refiner
from ..planning.two_bw_costs import hardware, optimizer_factor

ANALYTIC_SIZES = (1, 2, 4, 8, 16, 32)


def schedules_of(config: Any) -> tuple[str, ...]:
    return ("2bw", "1f1b", "gpipe") if config.auto else (config.schedule,)


def plan_from_cli(cfg: DictConfig, config: Any, out: Path) -> tuple[TwoBWPlan, str]:
    """The plan, and one line with what the other cost functions (planner_2bw_cost) choose beside it."""
    per_node = int(cfg.trainer.devices)
    devices = per_node * int(cfg.trainer.get("num_nodes", 1))
    device_type = "cuda" if str(cfg.trainer.get("accelerator", "cpu")) in ("gpu", "cuda", "auto") else "cpu"
    if cfg.plan.profile:
        try:
            profile = SizedProfile.load(cfg.plan.profile)
        except (OSError, ValueError) as err:
            raise SettingError(f"profile={cfg.plan.profile!r}: not a sized profile ({err})", "profile") from None
        factor = 2.0
    else:
        if "name" not in cfg.model.get("model", {}):  # a Hugging Face model: no FLOP model of its blocks
            raise SettingError(
                "planner=2bw plans from FLOPs of our models (model.model.name) or a sized profile: give plan.profile=<the "
                "sized_profile.json a training run with pipeline.planner=2bw writes>",
                "planner",
            )
        profile = analytic_profile(cfg.model.model.name, ANALYTIC_SIZES, int(cfg.data.seq_len), device_flops=float(cfg.plan.device_flops))
        factor = optimizer_factor(cfg.trainer.get("precision", "32"))
    hw = hardware(
        devices,
        per_node,
        device_type,
        config.memory_limit,
        config.intra_bandwidth,
        config.inter_bandwidth,
        config.latency,
        factor,
        shard_optimizer=config.shard == "optimizer",
    )
    batch = config.global_batch or int(cfg.data.batch_size)
    kinds = profile.block_names if profile.source.startswith("analytic") else None
    own = two_bw_settings.cost_model(config)
    split = kinds or block_kinds(profile.block_names)  # which blocks tensor parallelism splits (plan_mesh)

    # the run's tensor and shard, priced as a training run prices them (tensor > 1 or shard=full: ours)
    fixed = (config.tensor, config.shard) if config.tensor > 1 or config.shard == "full" else None

    def planned(cost_model: str) -> TwoBWPlan:
        mesh = config.plan_mesh and cost_model == own  # the search over tensor and shard is the simulator's
        return plan_2bw(
            profile,
            hw,
            batch,
            schedules_of(config),
            refine=refiner(config.partition, kinds),
            cost_model=cost_model,
            mesh=mesh,
            kinds=split,
            fixed_mesh=fixed if cost_model == own and not mesh else None,
        )

    try:
        result = planned(own)
    except NoConfiguration as err:
        raise SettingError(str(err), err.setting) from None
    other_setting = next(k for k, v in two_bw_settings.PLANNER_COSTS.items() if v != own)
    try:  # the other cost functions' choice, printed beside (paper vs ours)
        other: Any = planned(two_bw_settings.PLANNER_COSTS[other_setting]).chosen
    except NoConfiguration as err:
        other = str(err).splitlines()[0]
    summary = {
        **result.to_dict(),
        "beside": {"planner_2bw_cost": other_setting, "chosen": other if isinstance(other, str) else other.to_dict()},
    }
    (out / "plan_2bw.json").write_text(json.dumps(summary, indent=1))
    return result, beside_line(result, other_setting, other)


def beside_line(result: TwoBWPlan, setting: str, other: Any) -> str:
    """What the other cost functions (`setting`) choose on the same profile and hardware: a candidate, or why none."""
    if isinstance(other, str):
        return f"planner_2bw_cost={setting}: no configuration ({other})"
    c = result.chosen
    return (
        f"planner_2bw_cost={setting} chooses w={other.width} d={other.depth} b={other.microbatch_size} g={other.microbatches} "
        f"{other.schedule} recompute={other.recompute} ({other.throughput:.1f} samples/s by its own cost functions) beside this "
        f"w={c.width} d={c.depth} b={c.microbatch_size} g={c.microbatches} {c.schedule} recompute={c.recompute}"
    )
