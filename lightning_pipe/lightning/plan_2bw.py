"""planner=2bw in the strategy: PipeDream-2BW's planner chooses the run's shape at setup.

Runs in `AutoPipeStrategy.setup` before the topology exists (width and depth are its answer):
0. With tensor > 1 or shard="full" (the mesh priced, ours) every rank first times the collectives on
   the job's processes (`measured_collectives`), which price them in the plan.
1. Global rank 0 profiles every block at a few micro-batch sizes (`profile_sizes`), samples
   collated from the training dataset directly, the user's step run up to the pipeline call for
   the input and after it for the loss (as `autoplan.profile_pipeline`); RNG state and buffers are
   left as they were.
2. It plans (`planning.two_bw.plan_2bw`): every (w, d), schedule, b, recomputation; the chosen
   configuration re-partitioned by the configured partitioner (AutoPipe by default).
3. The choice is broadcast; every rank replaces its config: width, microbatches (g), schedule,
   recompute per stage and the partition as block counts. The DataLoaders then yield B / w rows
   per replica (`rebatched`). A failure (nothing fits) is raised on every rank as one SettingError.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import BatchSampler, DataLoader

from ..config import PipelineConfig
from ..errors import SettingError
from ..modes.two_bw import settings as two_bw_settings
from ..planning.collectives import CollectiveCosts
from ..planning.entry import block_kinds
from ..planning.two_bw import NoConfiguration, TwoBWPlan, plan_2bw, refiner
from ..planning.two_bw_costs import hardware, optimizer_factor
from ..profiling.collectives import measure_collectives
from ..profiling.runtime import runtime_bytes
from ..profiling.sized import profile_sizes
from .autoplan import dataset_sample, pipeline_input, step_loss
from .choice_2bw import TwoBWChoice
from .profile_precision import run_precision
from .stage import find_pipeline

PROFILE_SIZES = (1, 2, 4, 8, 16, 32)  # micro-batch sizes profiled (those <= the global batch)


def train_loader(trainer: Any) -> Optional[Any]:
    source = trainer.fit_loop._data_source
    try:
        loader = source.dataloader() if source.is_defined() else None
    except Exception:  # a user hook that needs more setup than we have
        return None
    return loader[0] if isinstance(loader, (list, tuple)) and loader else loader


@dataclass(frozen=True)
class Where:
    """Where planner=2bw plans: the job before its topology exists."""

    world: int  # processes in the job
    processes: int  # per node
    rank: int  # this process's global rank
    device: torch.device
    out_dir: Optional[Path]  # where the plan and the sized profile are written


def plan_in_setup(config: PipelineConfig, module: Any, where: Where, resumed: dict[str, Any]) -> tuple[TwoBWChoice, Optional[TwoBWPlan]]:
    """Plan on global rank 0, broadcast, return the choice on every rank (and the plan on rank 0).
    `resumed`: the run state of the checkpoint being resumed (`checkpoint.resumed_state`)."""
    two_bw_settings.check_applied(config)
    world = where.world
    trainer = module.trainer
    loader = train_loader(trainer)
    batch = config.global_batch or getattr(loader, "batch_size", None)
    box: list[Any] = [None]
    result: Optional[TwoBWPlan] = None
    resumed = resumed.get("plan_2bw")
    if resumed is not None and resumed["global_batch"] == batch and resumed["width"] * len(resumed["sizes"]) * config.tensor == world:
        # the resumed run's shape, not a new (noisy) plan: the same batches, partition and schedule
        saved = {**resumed, "recompute": tuple(resumed["recompute"]), "sizes": tuple(resumed["sizes"])}
        return TwoBWChoice(**saved), None
    # tensor > 1 or shard=full: their collectives priced as measured on this job's processes (every rank measures)
    collectives = measured_collectives(where) if world > 1 and (config.tensor > 1 or config.shard == "full") else (None, None)
    if where.rank == 0:
        try:
            if not batch:
                raise SettingError(
                    "planner=2bw needs the global batch: set global_batch, or give the training DataLoader a batch_size", "global_batch"
                )
            result = _plan(config, where, module, trainer, int(batch), collectives)
            c = result.chosen
            sizes = tuple(b - a for a, b in c.bounds)
            box = [TwoBWChoice(c.width, c.microbatches, c.microbatch_size, c.schedule, c.stage_recompute, sizes, int(batch))]
        except SettingError as err:
            box = [err]
        except NoConfiguration as err:
            box = [SettingError(str(err), err.setting)]
    if world > 1:
        dist.broadcast_object_list(box, 0)
    if isinstance(box[0], SettingError):
        raise box[0]
    return box[0], result


def measured_collectives(where: Where) -> tuple[CollectiveCosts, Optional[CollectiveCosts]]:
    """The collectives fitted on this job's processes (collective: every rank calls it): within a node on the
    ranks of each node, and across nodes on the whole job when there are several (`Hardware.collectives`)."""
    per_node = where.processes
    nodes = where.world // per_node
    if nodes == 1:
        return measure_collectives(None, where.device), None
    groups = [dist.new_group(list(range(n * per_node, (n + 1) * per_node))) for n in range(nodes)]  # every rank makes each
    intra = measure_collectives(groups[where.rank // per_node], where.device)
    inter = measure_collectives(None, where.device)
    for group in groups:
        dist.destroy_process_group(group)
    return intra, inter


def _plan(
    config: PipelineConfig,
    where: Where,
    module: Any,
    trainer: Any,
    batch: int,
    collectives: tuple[Optional[CollectiveCosts], Optional[CollectiveCosts]] = (None, None),
) -> TwoBWPlan:
    device = where.device
    _, pipeline = find_pipeline(module)
    blocks = list(pipeline)
    sizes = [s for s in PROFILE_SIZES if s <= batch] or [1]
    samples = {s: dataset_sample(trainer, s) for s in sizes}
    if any(v is None for v in samples.values()):
        raise SettingError(
            "planner=2bw profiles the blocks on samples of the training dataset, and it has none to index "
            "(a map-style dataset with __getitem__ and __len__ is needed)",
            "planner",
        )
    started = time.perf_counter()
    runtime = runtime_bytes(device, [module])
    with run_precision(trainer.precision_plugin, pipeline) as convert_input:  # the run's dtype, its autocast
        samples = {s: convert_input(v) for s, v in samples.items()}
        profile = _profile(module, pipeline, blocks, samples, sizes, device)
    profiled = time.perf_counter() - started
    limit = config.memory_limit
    if limit is None and device.type == "cuda":
        limit = float(torch.cuda.get_device_properties(device).total_memory)
    hw = hardware(
        where.world,
        where.processes,
        device.type,
        limit,
        config.intra_bandwidth,
        config.inter_bandwidth,
        config.latency,
        optimizer_factor(trainer.precision),
        runtime,
        shard_optimizer=config.shard == "optimizer",
        intra_collectives=collectives[0],
        inter_collectives=collectives[1],
    )
    kinds = block_kinds([type(b).__name__ for b in blocks])
    schedules = ("2bw", "1f1b", "gpipe") if config.auto else (config.schedule,)
    refine = refiner(config.partition, kinds)
    # tensor > 1 or shard=full: the user's tensor degree and shard, priced as the mesh search prices them (ours)
    fixed = (config.tensor, config.shard) if config.tensor > 1 or config.shard == "full" else None
    cost_model = two_bw_settings.cost_model(config)
    result = plan_2bw(profile, hw, batch, schedules, refine=refine, every_device=True, cost_model=cost_model, kinds=kinds, fixed_mesh=fixed)
    result.notes.append(f"profiled {len(blocks)} blocks at micro-batch sizes {sizes} in {profiled:.1f} s on {device}")
    out = where.out_dir
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        profile.save(out / "sized_profile.json")
        (out / "plan_2bw.json").write_text(json.dumps(result.to_dict(), indent=1))
    rank_zero_info(result.table())
    return result


def _profile(module: Any, pipeline: Any, blocks: list, samples: dict, sizes: list, device: torch.device) -> Any:
    """Every block at every micro-batch size in `sizes` (profiling.sized), from the samples' pipeline inputs."""
    inputs = {s: pipeline_input(module, pipeline, samples[s]) for s in sizes}
    module.log = lambda *a, **k: None  # type: ignore[method-assign]  # the user's step logs nothing here
    try:
        return profile_sizes(
            blocks,
            lambda s: inputs[s],
            sizes,
            device,
            model=type(module).__name__,
            repeats=2,
            loss_fn_of=lambda s: step_loss(module, pipeline, move_data_to_device(samples[s], device)),
        )
    finally:
        del module.log


def rebatched(loader: Any, rows: int) -> Any:
    """`loader` yielding `rows` samples per batch (B / w per replica), its dataset, sampler, collate
    and workers kept. A loader that is not a plain DataLoader with batch_size is refused."""
    if not isinstance(loader, DataLoader) or getattr(loader, "batch_size", None) == rows:
        return loader
    cls = type(loader)  # torch's DataLoader or torchdata's StatefulDataLoader (same arguments)
    rebuildable = cls is DataLoader or (cls.__name__ == "StatefulDataLoader" and cls.__module__.startswith("torchdata"))
    if (
        not rebuildable or loader.batch_size is None or not isinstance(loader.batch_sampler, BatchSampler)
    ):  # batch_size: no custom batch_sampler
        raise SettingError(
            f"planner=2bw sets the batch size to {rows} rows per replica (global_batch / width), and this DataLoader "
            f"({type(loader).__name__}, batch_sampler {type(loader.batch_sampler).__name__}) cannot be rebuilt with another "
            "batch size: use a plain torch DataLoader (or torchdata's StatefulDataLoader) with batch_size",
            "planner",
        )
    extra = {"prefetch_factor": loader.prefetch_factor} if loader.num_workers > 0 else {}
    return cls(
        loader.dataset,
        batch_size=rows,
        sampler=loader.sampler,
        drop_last=loader.drop_last,
        collate_fn=loader.collate_fn,
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        persistent_workers=loader.persistent_workers,
        pin_memory_device=loader.pin_memory_device,
        **extra,
    )
