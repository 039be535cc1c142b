"""Partitions of a small GPT (benchmarks.harness.gpt) measured on gloo processes against the simulator,
on profiles and a link taken in the same job. Results: docs/results/autopipe.md.

Default (AutoPipe's Table II / Fig. 11 on CPU): 1F1B m = 8 on 4, then 2, processes under 7 partitions
(the planners' and unbalanced ones); analysis: benchmarks.harness.simulator_report. ``--speedup``:
`autopipe` over `uniform` in training steps of a GPT with a heavy embedding / head on 2 processes.

    flock /tmp/bench.lock python -m benchmarks.bench_simulator   # 4 processes, then 2; ~3 min on a quiet machine
    python -m benchmarks.bench_simulator --raw run.pt             # also keep the measurements ...
    python -m benchmarks.bench_simulator --from-raw run.pt        # ... and analyse them again without measuring
    python -m benchmarks.bench_simulator --speedup                # ~2 min on a quiet machine
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from itertools import combinations

import torch
import torch.distributed as dist

from benchmarks.harness import REPO, gpt, simulator_report
from benchmarks.harness.bench import Bench, Table
from benchmarks.harness.gpt import add_model_arguments, block_kinds, build_model, lm_loss, make_batch, segment
from benchmarks.harness.launch import CpuClock, rank_zero_log
from benchmarks.harness.pipes import broadcast, gather, pipeline_steps, spans
from benchmarks.harness.trainer_runs import quiet_distributed, stage_pipeline
from lightning_pipe.planning import plan
from lightning_pipe.profiling import Profile, profile_blocks
from lightning_pipe.profiling.link import ping_pong
from lightning_pipe.schedules import build_schedule
from lightning_pipe.simulation import simulate

METHODS = ("uniform", "dp", "autopipe", "parameters")
UNBALANCED = (1.25, 1.5, 1.8)  # simulated iteration of the extra splits, relative to the best split
SPEEDUP = ("uniform", "autopipe")  # --speedup's partitions, and its settings
SPEEDUP_ARGS = dict(worlds=[2], layers=8, vocab=16384, rounds=3, steps=10, profile_repeats=10)


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
    shared = broadcast({"link": link, "partitions": choose_partitions(profiles["main"], link, model, world, args)} if rank == 0 else None)
    link, partitions = shared["link"], shared["partitions"]
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


def train_partition(model, bounds, rank: int, world: int, x, y, args) -> list[tuple[float, float, float]]:
    """Warm-up, then timed steps of this rank's stage (`pipeline_steps`), the tied gradients all-reduced."""
    chunk, pipe = stage_pipeline(model, bounds, rank, world, args.microbatches, lm_loss)
    opt, tie = torch.optim.SGD(chunk.parameters(), lr=1e-3), gpt.tied_allreduce(model, bounds, rank)
    return pipeline_steps(pipe, opt, x, y, args.warmup + args.steps, tie)[args.warmup :]


def speedup_job(rank: int, world: int, args) -> dict:
    log, model, (x, y) = rank_zero_log(rank), gpt.build_model(args), gpt.make_batch(args)
    link, _ = gpt.segment(lambda: ping_pong(rank), rank, world, args, log)
    run = lambda: gpt.gather_profile(list(model), x[: args.mbs], y[: args.mbs], rank, world, args.profile_repeats, False, "gpt", args.mbs)  # noqa: E731
    (profile, loss), profile_load = gpt.segment(run, rank, world, args, log)
    plan_all = lambda costs: {m: plan(costs, world, args.microbatches, method=m, kinds=gpt.block_kinds(model)) for m in SPEEDUP}
    plans = broadcast(plan_all(profile.costs(link["bandwidth"], link["latency"])) if rank == 0 else None)
    runs, loads = {m: [] for m in SPEEDUP}, {m: [] for m in SPEEDUP}
    for rnd in range(args.rounds):
        for m in SPEEDUP if rnd % 2 == 0 else SPEEDUP[::-1]:
            out, load = gpt.segment(lambda: train_partition(model, plans[m].bounds, rank, world, x, y, args), rank, world, args, log)
            runs[m].append(out), loads[m].append(load)
            log(f"  round {rnd + 1}/{args.rounds} {m:<9} done (foreign load {load:.2f} CPUs)")
    return {"link": link, "profile": profile, "loss": loss, "profile_load": profile_load, "plans": plans, "runs": runs, "loads": loads}


def speedup(bench: Bench, args) -> None:
    bench.say(f"gloo, {args.worlds[0]} processes x 1 thread; {gpt.describe(args)} (batch {(batch := args.mbs * args.microbatches)})")
    results = quiet_distributed(bench, speedup_job, args.worlds[0], args)
    r0, link, profile, plans = results[0], results[0]["link"], results[0]["profile"], results[0]["plans"]
    bench.log("\n".join(plans[m].table() for m in SPEEDUP))
    fb = lambda i, j: 1e3 * sum(profile.forward[i:j] + profile.backward[i:j])  # noqa: E731
    bench.say(
        f"link: latency {link['latency'] * 1e6:.0f} us, bandwidth {link['bandwidth'] / 1e9:.2f} GB/s; profile (both ranks at once, foreign load "
        f"{r0['profile_load']:.2f} CPUs): f+b per micro-batch: embedding {fb(0, 1):.2f} ms, layers {fb(1, -1):.1f} ms, head {fb(-1, None):.1f} ms (of which the loss {1e3 * sum(r0['loss']):.1f} ms)\n"
    )
    rows = {}
    for m in SPEEDUP:  # a step spans from the first rank's start to the last rank's end
        its, steps = spans([[t for rnd in r["runs"][m] for t in rnd] for r in results])  # every round's steps, in order
        rows[m] = {"step": statistics.median(steps), "iteration": statistics.median(its), "load": max(r0["loads"][m]), "n": len(steps)}
    t = Table("partition", "blocks per stage", "stage contents", "measured step ms", "samples/s", "pipeline iteration ms", "simulated ms",
              "foreign load", align="lllrrrrr")  # fmt: skip
    for m, pl, r in ((m, plans[m], rows[m]) for m in SPEEDUP):
        t.add(m, list(pl.sizes), " / ".join(pl.contents(s) for s in range(pl.stages)), f"{r['step'] * 1e3:.1f}", f"{batch / r['step']:.1f}",
              f"{r['iteration'] * 1e3:.1f}", f"{pl.iteration_time * 1e3:.1f}", f"{r['load']:.2f}")  # fmt: skip
    bench.table(t)
    ratio = lambda key: rows["uniform"][key] / rows["autopipe"][key]  # noqa: E731
    bench.say(
        f"speed-up of autopipe over uniform: measured {ratio('step'):.3f}x (training step: samples/s), {ratio('iteration'):.3f}x (pipeline step alone); "
        f"simulated {plans['uniform'].iteration_time / plans['autopipe'].iteration_time:.3f}x ({rows['autopipe']['n']} timed steps per partition, medians)"
    )
    bench.keep("rows", rows)


def main() -> None:
    quick = dict(worlds=[2], layers=2, partitions=3, profile_repeats=4, pictures="", microbatches=2)
    bench = Bench(__doc__, quick, threads=1, rounds=2, steps=12, warmup=3, retries=2, max_foreign=0.15, quiet_wait=600.0, timeout=3600.0)
    p = bench.parser
    add_model_arguments(p, layers=4, vocab=2048)
    bench.options(worlds=([4, 2], "processes (= stages) per job"), microbatches=8, partitions=7, inflight=(4, "in the chain-mode profile"))
    bench.options(profile_repeats=(16, "per block; chain mode: / --inflight rounds"), pictures=(str(REPO / "docs" / "img"), "'': none"))
    bench.options(cores=(os.cpu_count() or 1, "cores the processes share (the simulator's cores model)"))
    bench.options(raw=("", "save the measurements (torch.save) here"), from_raw=("", "analyse --raw's (its options, but those given here)"))
    bench.options(speedup=(False, f"the speed-up of autopipe over uniform (defaults: {SPEEDUP_ARGS})"))
    args = bench.parse()
    if args.speedup:
        for key, value in SPEEDUP_ARGS.items() if not args.quick else ():
            setattr(args, key, value if getattr(args, key) == p.get_default(key) else getattr(args, key))
        speedup(bench, args)
        return bench.finish()
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
