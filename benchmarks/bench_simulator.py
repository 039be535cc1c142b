"""Simulated vs measured iteration time per partition (AutoPipe's Table II / Fig. 11 on CPU): a small GPT
(bench/gpt.py), SequentialPipeline 1F1B m = 8 on 4, then 2, gloo processes under 7 partitions (the planners' and unbalanced
ones), each next to the simulator's prediction from profiles and a link taken in the same job. Analysis, tables and
pictures: lightning_pipe.bench.simulator_report. Results: docs/autopipe.md.

    flock /tmp/bench.lock python benchmarks/bench_simulator.py   # 4 processes, then 2; ~3 min on a quiet machine
    python benchmarks/bench_simulator.py --raw run.pt             # also keep the measurements ...
    python benchmarks/bench_simulator.py --from-raw run.pt        # ... and analyse them again without measuring
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from itertools import combinations

from lightning_pipe.bench.harness import Bench, ints, pin_threads

pin_threads(1)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lightning_pipe.bench import REPO, simulator_report  # noqa: E402
from lightning_pipe.bench.gpt import add_model_arguments, block_kinds, build_model, lm_loss, make_batch, segment  # noqa: E402
from lightning_pipe.bench.launch import CpuClock, rank_zero_log  # noqa: E402
from lightning_pipe.bench.pipes import gather  # noqa: E402
from lightning_pipe.bench.trainer_runs import quiet_distributed, stage_pipeline  # noqa: E402
from lightning_pipe.planning import plan  # noqa: E402
from lightning_pipe.profiling import Profile, profile_blocks  # noqa: E402
from lightning_pipe.profiling.link import ping_pong  # noqa: E402
from lightning_pipe.schedules import build_schedule  # noqa: E402
from lightning_pipe.simulation import simulate  # noqa: E402

METHODS = ("uniform", "dp", "autopipe", "parameters")
UNBALANCED = (1.25, 1.5, 1.8)  # simulated iteration of the extra splits, relative to the best split


def profile_at_once(model, x, y, rank: int, world: int, args, profilers: int, inflight):
    """Every block profiled, the loss timed with the last one, by ranks < `profilers` at once while the
    others wait (``inflight``: chain mode, None: each block alone); per block the median over them."""
    blocks, chain, repeats, measured = list(model), inflight is not None, args.profile_repeats, None
    dist.barrier()
    if rank < profilers:
        measured = profile_blocks(blocks, x[: args.mbs], torch.device("cpu"), model="gpt", loss_fn=lambda out: lm_loss(out, y[: args.mbs]),
                                  inflight=inflight, repeats=max(1, repeats // inflight) if chain else repeats, warmup=1 if chain else 2)  # fmt: skip
    parts = [p for p in gather(measured, world) if p is not None]
    field = lambda key: [statistics.median(p[i][key] for p in parts) for i in range(len(blocks))]  # noqa: E731
    keys = ("forward", "backward", "activation_bytes", "param_bytes", "peak_memory")
    return Profile("gpt", args.mbs, "float32", "cpu", *map(field, keys), [type(b).__name__ for b in blocks])


def choose_partitions(profile, link: dict, model, stages: int, args) -> list[tuple[str, tuple]]:
    """(label, bounds): the named methods (one landing on an earlier one's split is folded into its
    label), then unbalanced splits at the UNBALANCED ratios of the best simulated time, then more."""
    costs, kinds, named = profile.costs(link["bandwidth"], link["latency"], cores=args.cores), block_kinds(model), {}
    m, count = args.microbatches, args.partitions
    for method in METHODS:
        bounds = tuple(tuple(b) for b in plan(costs, stages, m, method=method, kinds=kinds).bounds)
        named[bounds] = f"{named[bounds]} = {method}" if bounds in named else method
    n, schedule = len(kinds), build_schedule("1f1b", stages, m)
    splits = [tuple(zip((0, *cuts), (*cuts, n))) for cuts in combinations(range(1, n), stages - 1)]
    timed = sorted((simulate(schedule, costs, b, critical_path=False).iteration_time, b) for b in splits)
    for i, ratio in enumerate(list(UNBALANCED) + [2.0 + 0.3 * i for i in range(count)]):
        free = [(abs(t / timed[0][0] - ratio), b) for t, b in timed if b not in named]
        if len(named) >= count or not free:
            break
        named[min(free)[1]] = f"unbalanced-{i + 1}"
    return [(label, bounds) for bounds, label in named.items()]


def run_partition(model, bounds, rank: int, world: int, x, y, args) -> dict:
    """Timed steps of this rank's stage of `bounds`, each traced; per step (start, end) and the CPU accounting."""
    chunk, pipe = stage_pipeline(model, bounds, rank, world, args.microbatches, lm_loss)
    pipe.executor.trace = True

    def step() -> tuple[float, float]:
        chunk.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        pipe.step(x, y)
        return t0, time.perf_counter()

    for _ in range(args.warmup):
        step()
    start = CpuClock.now()  # this rank's CPU seconds and the machine's: extra work vs idle cores
    times, traces = map(list, zip(*((step(), list(pipe.executor.records)) for _ in range(args.steps))))
    end = CpuClock.now()
    chunk.zero_grad(set_to_none=True)
    machine = (end.busy - start.busy) if start.busy is not None else math.nan
    return {"times": times, "traces": traces, "cpu": (end.own - start.own, machine, end.wall - start.wall, args.steps)}


def simulator_job(rank: int, world: int, args) -> dict:
    log, model, (x, y), cores = rank_zero_log(rank), build_model(args), make_batch(args), min(args.cores, world)
    link, _ = segment(lambda: ping_pong(rank), rank, world, args, log)
    # name -> (ranks profiling at once, chain mode); "main": the headline simulation's; "all": where ranks outnumber cores
    variants = {"main": (cores, args.inflight), "hot": (cores, None), "lone": (1, args.inflight), "all": (world, args.inflight)}
    profiles, profile_loads = {}, {}
    for key, v in variants.items() if world > cores else list(variants.items())[:3]:
        profiles[key], profile_loads[key] = segment(lambda: profile_at_once(model, x, y, rank, world, args, *v), rank, world, args, log)
    box = [{"link": link, "partitions": choose_partitions(profiles["main"], link, model, world, args)} if rank == 0 else None]
    dist.broadcast_object_list(box, 0)
    link, partitions = box[0]["link"], box[0]["partitions"]
    log(f"  link: latency {link['latency'] * 1e6:.0f} us, bandwidth {link['bandwidth'] / 1e9:.2f} GB/s; partitions: "
        + ", ".join(f"{label} {simulator_report.sizes_of(b)}" for label, b in partitions))  # fmt: skip
    n = len(partitions)
    runs, traces, loads, cpu = ({i: [] for i in range(n)} for _ in range(4))
    for rnd in range(args.rounds):
        for i in [(rnd + j) % n for j in range(n)]:  # a different partition first each round
            out, load = segment(lambda: run_partition(model, partitions[i][1], rank, world, x, y, args), rank, world, args, log)
            for store, new in ((runs, [out["times"]]), (loads, [load]), (cpu, [out["cpu"]]), (traces, zip(out["times"], out["traces"]))):
                store[i].extend(new)
            log(f"  round {rnd + 1}/{args.rounds} {partitions[i][0]:<24} done (foreign load {load:.2f} CPUs)")
    return {"rank": rank, "link": link, "profiles": profiles, "profile_loads": profile_loads, "partitions": partitions, "runs": runs,
            "loads": loads, "traces": traces, "cpu": cpu}  # fmt: skip


def main() -> None:
    quick = dict(worlds=[2], layers=2, partitions=3, profile_repeats=4, pictures="", microbatches=2)
    bench = Bench(__doc__, quick, rounds=2, steps=12, warmup=3, retries=2, max_foreign=0.15, quiet_wait=600.0, timeout=3600.0)
    p = bench.parser
    p.add_argument("--worlds", type=ints, default=[4, 2], help="processes (= stages) per job, comma-separated")
    add_model_arguments(p, layers=4, vocab=2048)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--profile-repeats", type=int, default=16, help="timed samples per block; chain mode: / --inflight rounds")
    p.add_argument("--partitions", type=int, default=7)
    p.add_argument("--pictures", default=str(REPO / "docs" / "img"), help="folder for the pictures ('' for none)")
    p.add_argument("--inflight", type=int, default=4, help="micro-batches in flight in the chain-mode profile")
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="cores the processes share (the simulator's cores model)")
    p.add_argument("--raw", default="", help="save the measurements (torch.save) to this file")
    p.add_argument("--from-raw", default="", help="analyse measurements saved with --raw (the saved run's options, but those given here)")
    args = bench.parse()
    if args.from_raw:
        worlds, stored, origin = simulator_report.load_raw(args.from_raw)
        args = argparse.Namespace(**{**vars(args), **(stored or {}), **{k: v for k, v in vars(args).items() if v != p.get_default(k)}})
        bench.say(f"re-analysis of {args.from_raw}, measured: {origin}\n{simulator_report.header(args)}")
        with bench.recording():
            simulator_report.show(worlds, args)
        return bench.finish()
    bench.say(simulator_report.header(args))
    analyses, raw = [], {}
    with bench.recording():
        for world in args.worlds:
            print(f"\n== {world} processes ==", flush=True)
            raw[world] = quiet_distributed(bench, simulator_job, world, args)
            if args.raw:
                simulator_report.save_raw(args.raw, raw, args, bench.provenance)
            analyses.append(simulator_report.show_world(raw[world], world, args))
        simulator_report.draw(analyses, args)
    bench.finish()


if __name__ == "__main__":
    main()
