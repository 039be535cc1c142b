"""Simulated vs measured iteration time per partition: the AutoPipe paper's Table II / Fig. 11 on CPU.

A small GPT (lightning_pipe.models.build_gpt; 4 layers = 10 sub-layer blocks by default) is trained
with our runtime (SequentialPipeline, 1F1B, m = 8 micro-batches) on 4 gloo processes with one
thread each, under 7 partitions: uniform (Megatron-LM's equal layers), dp, autopipe, parameters and
deliberately unbalanced ones (the splits whose simulated iteration is closest to 1.25x, 1.5x,
1.8x, 2x.. the best one). For each partition the measured iteration time (median over the timed
steps after warm-up, of the wall time from the first rank entering the step to the last one leaving
it; the optimizer step is not part of it, as it is not part of the simulator's iteration) is put
next to the simulator's prediction from a profile taken in the same job:

- profile: `profile_blocks(..., loss_fn=cross-entropy, inflight=4)`: the blocks run back to back as
  a stage does, 4 micro-batches in flight, each block timed between its neighbours, and the loss
  timed with the LM head (the last stage computes it). min(cores, processes) ranks profile at the
  same time while the others wait: each profiling rank has a core to itself, with a neighbour
  computing too, as in training; the per-block figure is the median over those ranks;
- shared cores: with more processes than cores (4 on 2) the simulator is told ``cores``
  (`CostModel.cores`): while k ranks compute, each runs at min(1, cores / k) of its profiled speed;
- link: latency and bandwidth fitted to a ping-pong (isend / irecv, as the Transport does) between
  ranks 0 and 1, message sizes 4 B .. 4 MB, while the other ranks wait;
- partitions are planned on rank 0 from that profile and link and broadcast.

Also simulated, to show what each ingredient is worth: the same with per-block profiles (each block
alone on one input, backward right after forward: hot caches), without the cores model, from a
profile with all ranks at once (contention baked into every block), and from rank 0 alone. Every
timed step is traced (`trace=True`: pure compute time, waits excluded), so the traced compute time
per rank can be compared with the simulated one.

Printed per partition: measured, simulated, error; then the Spearman rank correlation over the
partitions. Targets (issue): every partition within 10%, rank correlation 1.0. The same is repeated
with 2 processes (2 stages, a core each).

Timing hygiene (lightning_pipe.bench.launch.wait_for_quiet / quiet_segment): before the job and before
each measured segment, the script waits (polling every 20 s, up to --quiet-wait s) until no other
benchmark or test runs (`pgrep -f bench_runtime`, `pgrep -f pytest`) and the machine is idle; it
measures the CPU time other processes took during each segment ("foreign load", from /proc/stat
minus the ranks' own CPU time) and repeats a disturbed segment (up to --retries times), keeping the
least disturbed one. Run it under `flock /tmp/bench.lock` when other benchmarks share the machine.

This script measures (the processes: lightning_pipe.bench.launch.run_distributed) and saves what every
rank measured with --raw; the analysis, tables and pictures are lightning_pipe.bench.simulator_report,
which --from-raw runs on a saved file instead of measuring.

    python benchmarks/bench_simulator.py                      # 4 then 2 processes, pictures in docs/img
    python benchmarks/bench_simulator.py --worlds 4 --steps 20 --rounds 3
    python benchmarks/bench_simulator.py --raw run.pt         # also keep the measurements ...
    python benchmarks/bench_simulator.py --from-raw run.pt    # ... and analyse them again without measuring
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from lightning_pipe.bench import REPO, provenance, simulator_report  # noqa: E402
from lightning_pipe.bench.gpt import (  # noqa: E402
    add_common_arguments,
    add_model_arguments,
    block_kinds,
    build_model,
    lm_loss,
    make_batch,
    segment,
)
from lightning_pipe.bench.launch import (  # noqa: E402
    OTHER_JOBS,
    CpuClock,
    rank_zero_log,
    run_distributed,
    wait_for_quiet,
)
from lightning_pipe.bench.simulator_report import sizes_of  # noqa: E402
from lightning_pipe.profiling.link import ping_pong  # noqa: E402

METHODS = ("uniform", "dp", "autopipe", "parameters")
UNBALANCED = (1.25, 1.5, 1.8)  # simulated iteration of the extra splits, relative to the best split


# ---- profiles ----------------------------------------------------------------------------------
def profile_at_once(
    blocks: Sequence[nn.Module],
    sample: Any,
    target: Any,
    rank: int,
    world: int,
    repeats: int,
    profilers: int,
    inflight: int | None,
    name: str,
    mbs: int,
):
    """Profile every block, the loss timed with the last one (`loss_fn`); ranks < `profilers` at
    the same time while the others wait. ``inflight``: chain mode (see profile_blocks), None: each
    block alone. Every rank returns the same Profile: per block the median over the ranks that
    measured."""
    from lightning_pipe.profiling import Profile, profile_blocks

    dist.barrier()
    measured = None
    if rank < profilers:
        chain = inflight is not None
        measured = profile_blocks(
            blocks,
            sample,
            torch.device("cpu"),
            model=name,
            loss_fn=lambda out: lm_loss(out, target),
            inflight=inflight,
            repeats=max(1, repeats // inflight) if chain else repeats,
            warmup=1 if chain else 2,
        )
    parts: list = [None] * world
    dist.all_gather_object(parts, measured)
    parts = [p for p in parts if p is not None]
    field = lambda key: [statistics.median(p[i][key] for p in parts) for i in range(len(blocks))]  # noqa: E731
    return Profile(
        name,
        mbs,
        "float32",
        "cpu",
        field("forward"),
        field("backward"),
        field("activation_bytes"),
        field("param_bytes"),
        field("peak_memory"),
        [type(b).__name__ for b in blocks],
    )


# ---- partitions ----------------------------------------------------------------------------------
def all_splits(num_blocks: int, stages: int):
    from itertools import combinations

    for cuts in combinations(range(1, num_blocks), stages - 1):
        edges = (0, *cuts, num_blocks)
        yield tuple((edges[i], edges[i + 1]) for i in range(stages))


def choose_partitions(costs, kinds: Sequence[str], stages: int, m: int, count: int = 7) -> list[tuple[str, tuple]]:
    """(label, bounds): the named methods (a method that lands on an earlier one's split is folded
    into its label), then unbalanced splits at the UNBALANCED ratios of the best simulated time,
    then more of them until there are `count` distinct splits."""
    from lightning_pipe.planning import plan
    from lightning_pipe.schedules import build_schedule
    from lightning_pipe.simulation import simulate

    chosen: list[list] = []
    for method in METHODS:
        bounds = tuple(tuple(b) for b in plan(costs, stages, m, method=method, kinds=kinds).bounds)
        same = next((c for c in chosen if c[1] == bounds), None)
        if same is not None:
            same[0] += f" = {method}"
        else:
            chosen.append([method, bounds])
    schedule = build_schedule("1f1b", stages, m)
    timed = sorted((simulate(schedule, costs, b, critical_path=False).iteration_time, b) for b in all_splits(len(kinds), stages))
    best = timed[0][0]
    taken = {c[1] for c in chosen}
    ratios = list(UNBALANCED) + [2.0 + 0.3 * i for i in range(count)]
    for ratio in ratios:
        if len(chosen) >= count:
            break
        free = [(abs(t / best - ratio), b) for t, b in timed if b not in taken]
        if not free:
            break
        _, bounds = min(free)
        taken.add(bounds)
        chosen.append(["unbalanced-", bounds])
    # number the unbalanced ones 1, 2, 3 in order
    k = 0
    for c in chosen:
        if c[0].startswith("unbalanced-"):
            k += 1
            c[0] = f"unbalanced-{k}"
    return [(label, bounds) for label, bounds in chosen]


# ---- the distributed job -----------------------------------------------------------------------
def run_partition(model: nn.Sequential, bounds, rank: int, world: int, x, y, args: Any, steps: int, warmup: int) -> dict:
    """Train `steps` timed steps (after `warmup`) with this rank's stage of `bounds`; returns per
    step (start, end) on the machine-wide monotonic clock and the executor's trace records (every
    timed step is traced: a few clock reads per compute)."""
    from lightning_pipe.runtime.p2p import Transport
    from lightning_pipe.runtime.sequential import SequentialHost, SequentialPipeline
    from lightning_pipe.schedules import build_schedule

    a, b = bounds[rank]
    chunk = nn.Sequential(*[model[i] for i in range(a, b)])
    host = SequentialHost({rank: chunk}, world - 1, lm_loss)
    pipe = SequentialPipeline(build_schedule("1f1b", world, args.microbatches), rank, host, Transport(lambda r: r, torch.device("cpu")))
    pipe.executor.trace = True

    def step() -> tuple[float, float]:
        chunk.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        pipe.step(x, y)
        return t0, time.perf_counter()

    for _ in range(warmup):
        step()
    times, traces = [], []
    # CPU accounting of the timed steps: this rank's CPU seconds (gloo's threads included) and the
    # machine's, to tell extra work from cores left idle
    start = CpuClock.now()
    for _ in range(steps):
        times.append(step())
        traces.append(list(pipe.executor.records))
    end = CpuClock.now()
    chunk.zero_grad(set_to_none=True)
    machine = (end.busy - start.busy) if start.busy is not None else math.nan
    return {"times": times, "traces": traces, "cpu": (end.own - start.own, machine, end.wall - start.wall, steps)}


def simulator_job(rank: int, world: int, args: Any) -> dict:
    from lightning_pipe.profiling import Profile  # noqa: F401  (imported before timing)

    log = rank_zero_log(rank)
    model = build_model(args)
    blocks = list(model)
    kinds = block_kinds(model)
    x, y = make_batch(args)
    sample, target = x[: args.mbs], y[: args.mbs]
    cores = min(args.cores, world)
    link, _ = segment(lambda: ping_pong(rank), rank, world, args, log)
    # name -> (ranks profiling at once, chain mode); "main" is what the headline simulation uses
    kinds_of_profile = {"main": (cores, args.inflight), "hot": (cores, None), "lone": (1, args.inflight)}
    if world > cores:
        kinds_of_profile["all"] = (world, args.inflight)
    profiles, profile_loads = {}, {}
    for key, (profilers, inflight) in kinds_of_profile.items():
        profiles[key], profile_loads[key] = segment(
            lambda: profile_at_once(blocks, sample, target, rank, world, args.profile_repeats, profilers, inflight, "gpt", args.mbs),
            rank,
            world,
            args,
            log,
        )
    box = [None]
    if rank == 0:
        costs = profiles["main"].costs(link["bandwidth"], link["latency"], cores=args.cores)
        box = [{"link": link, "partitions": choose_partitions(costs, kinds, world, args.microbatches, args.partitions)}]
    dist.broadcast_object_list(box, 0)
    link, partitions = box[0]["link"], box[0]["partitions"]
    if rank == 0:
        log(
            f"  link: latency {link['latency'] * 1e6:.0f} us, bandwidth {link['bandwidth'] / 1e9:.2f} GB/s; "
            f"partitions: {', '.join(f'{l} {sizes_of(b)}' for l, b in partitions)}"
        )
    runs: dict[int, list] = {i: [] for i in range(len(partitions))}
    traces: dict[int, list] = {i: [] for i in range(len(partitions))}
    loads: dict[int, list] = {i: [] for i in range(len(partitions))}
    cpu: dict[int, list] = {i: [] for i in range(len(partitions))}
    for rnd in range(args.rounds):
        order = list(range(len(partitions)))
        order = order[rnd % len(order) :] + order[: rnd % len(order)]  # a different partition first each round
        for i in order:
            label, bounds = partitions[i]
            out, load = segment(
                lambda: run_partition(model, bounds, rank, world, x, y, args, args.steps, args.warmup), rank, world, args, log
            )
            runs[i].append(out["times"])
            traces[i].extend(zip(out["times"], out["traces"]))
            loads[i].append(load)
            cpu[i].append(out["cpu"])
            if rank == 0:
                log(f"  round {rnd + 1}/{args.rounds} {label:<24} done (foreign load {load:.2f} CPUs)")
    return {
        "rank": rank,
        "link": link,
        "profiles": profiles,
        "profile_loads": profile_loads,
        "partitions": partitions,
        "runs": runs,
        "loads": loads,
        "traces": traces,
        "cpu": cpu,
    }


# ---- main --------------------------------------------------------------------------------------
def explicit_options(p: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The options given on the command line (not left at their defaults)."""
    unset = object()
    given = argparse.Namespace(**{a.dest: unset for a in p._actions if a.dest != argparse.SUPPRESS})
    p.parse_args(argv, namespace=given)
    return {k for k, v in vars(given).items() if v is not unset}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", type=int, nargs="+", default=[4, 2], help="processes (= stages) per job")
    add_model_arguments(p, layers=4, vocab=2048)
    p.add_argument("--partitions", type=int, default=7)
    p.add_argument("--pictures", default=str(REPO / "docs" / "img"), help="folder for the pictures ('' for none)")
    p.add_argument("--inflight", type=int, default=4, help="micro-batches in flight in the chain-mode profile")
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="cores the processes share (the simulator's cores model)")
    p.add_argument("--raw", default="", help="save the measurements (torch.save) to this file")
    p.add_argument(
        "--from-raw",
        default="",
        help="analyse measurements saved with --raw instead of measuring (the saved run's options, but those given here)",
    )
    add_common_arguments(p)
    p.set_defaults(profile_repeats=16)  # timed samples per block; chain mode: 16 / inflight rounds
    args = p.parse_args()
    started = time.time()
    if args.from_raw:
        worlds, stored, origin = simulator_report.load_raw(args.from_raw)
        if stored is not None:  # the measuring run's options, overridden by those given now
            given = explicit_options(p, sys.argv[1:])
            args = argparse.Namespace(**{**stored, **{k: v for k, v in vars(args).items() if k in given or k not in stored}})
        print(f"re-analysis of {args.from_raw}" + (f", measured: {origin}" if origin else ""))
        print(simulator_report.header(args), flush=True)
        simulator_report.show(worlds, args)
        print(f"\ntotal {time.time() - started:.0f} s")
        return
    origin = provenance()
    print(origin)
    print(simulator_report.header(args), flush=True)
    analyses, raw = [], {}
    for world in args.worlds:
        print(f"\n== {world} processes ==", flush=True)
        wait_for_quiet(args.quiet_wait, args.max_foreign, poll=20.0, patterns=OTHER_JOBS, log=print)
        raw[world] = run_distributed(simulator_job, world, args, timeout=args.timeout, group_timeout=3600.0)
        if args.raw:
            simulator_report.save_raw(args.raw, raw, args, origin)
        analyses.append(simulator_report.show_world(raw[world], world, args))
    simulator_report.draw(analyses, args)
    print(f"\ntotal {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
