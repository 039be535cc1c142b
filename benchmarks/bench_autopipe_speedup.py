"""Measured speed-up of the `autopipe` partition over `uniform` (Megatron-LM's equal layers) on CPU.

A GPT whose token embedding and tied LM head are heavy (vocabulary 16384 by default against hidden
128: the head alone costs about as much as 8 transformer layers' worth of sub-layer blocks on its
stage) is trained on 2 gloo processes with one thread each, 1F1B, m = 8 micro-batches:

1. in the job, ranks 0 and 1 ping-pong to fit the link (latency, bandwidth) and both profile every
   block at the same time (`profile_blocks` with the loss as an extra block, `gather_profile`);
2. rank 0 plans the partition with `plan(method="autopipe")` and with `plan(method="uniform")`,
   both with block kinds, so uniform gives each stage the same number of layers, the embedding to
   the first and the head to the last stage;
3. both partitions are trained with the real runtime (SequentialPipeline), interleaved over
   --rounds rounds: a training step is the pipeline step, the all-reduce of the tied embedding /
   head gradient between the first and last stage (lightning_pipe.runtime.tied) and an SGD step.

Printed: samples/s of each (batch / median training step), the measured speed-up, the measured
speed-up of the pipeline step alone, and the simulated speed-up (the simulator's iteration times).

    python benchmarks/bench_autopipe_speedup.py
    python benchmarks/bench_autopipe_speedup.py --vocab 32768 --layers 8 --rounds 3

Timing hygiene as in bench_simulator.py (lightning_pipe.bench.launch.quiet_segment): waits for a quiet
machine (no bench_runtime / pytest, idle CPUs) before every measured segment and repeats disturbed
ones. The GPT and the common options are lightning_pipe.bench.gpt, shared with bench_simulator.py.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from lightning_pipe.bench import provenance  # noqa: E402
from lightning_pipe.bench.gpt import (  # noqa: E402
    add_common_arguments,
    add_model_arguments,
    block_kinds,
    build_model,
    describe,
    gather_profile,
    lm_loss,
    make_batch,
    segment,
)
from lightning_pipe.bench.launch import OTHER_JOBS, rank_zero_log, run_distributed, wait_for_quiet  # noqa: E402
from lightning_pipe.profiling.link import ping_pong  # noqa: E402

METHODS = ("uniform", "autopipe")


# ---- the profile (in the job) -------------------------------------------------------------------
# ---- training (in the job) ----------------------------------------------------------------------
def train_partition(model: nn.Sequential, bounds, rank: int, world: int, x, y, args: Any) -> list[tuple[float, float, float]]:
    """Warm-up, then timed training steps of this rank's stage; per step (start, pipeline end, step end)."""
    from lightning_pipe.runtime.p2p import Transport
    from lightning_pipe.runtime.sequential import SequentialHost, SequentialPipeline
    from lightning_pipe.runtime.tied import allreduce_tied, find_tied_parameters
    from lightning_pipe.schedules import build_schedule

    a, b = bounds[rank]
    chunk = nn.Sequential(*[model[i] for i in range(a, b)])
    tied = find_tied_parameters(model, tuple(bounds))
    groups = {}
    for t in tied:  # new_group is collective: every rank, same order
        group = dist.new_group(list(t.stages))
        if rank in t.stages:
            groups[t.index] = group
    host = SequentialHost({rank: chunk}, world - 1, lm_loss)
    pipe = SequentialPipeline(build_schedule("1f1b", world, args.microbatches), rank, host, Transport(lambda r: r, torch.device("cpu")))
    opt = torch.optim.SGD(chunk.parameters(), lr=1e-3)

    def step() -> tuple[float, float, float]:
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        pipe.step(x, y)
        t1 = time.perf_counter()
        allreduce_tied(tied, groups, rank)
        opt.step()
        return t0, t1, time.perf_counter()

    for _ in range(args.warmup):
        step()
    return [step() for _ in range(args.steps)]


def speedup_job(rank: int, world: int, args: Any) -> dict:
    log = rank_zero_log(rank)
    model = build_model(args)
    blocks, kinds = list(model), block_kinds(model)
    x, y = make_batch(args)
    link, _ = segment(lambda: ping_pong(rank), rank, world, args, log)
    (profile, loss), profile_load = segment(
        lambda: gather_profile(blocks, x[: args.mbs], y[: args.mbs], rank, world, args.profile_repeats, False, "gpt", args.mbs),
        rank,
        world,
        args,
        log,
    )
    box = [None]
    if rank == 0:
        from lightning_pipe.planning import plan

        costs = profile.costs(link["bandwidth"], link["latency"])
        box = [{"link": link, "plans": {m: plan(costs, world, args.microbatches, method=m, kinds=kinds) for m in METHODS}}]
    dist.broadcast_object_list(box, 0)
    plans = box[0]["plans"]
    if rank == 0:
        for m in METHODS:
            log(plans[m].table())
    runs = {m: [] for m in METHODS}
    loads = {m: [] for m in METHODS}
    for rnd in range(args.rounds):
        for m in METHODS if rnd % 2 == 0 else METHODS[::-1]:
            out, load = segment(lambda: train_partition(model, plans[m].bounds, rank, world, x, y, args), rank, world, args, log)
            runs[m].append(out)
            loads[m].append(load)
            if rank == 0:
                log(f"  round {rnd + 1}/{args.rounds} {m:<9} done (foreign load {load:.2f} CPUs)")
    return {
        "link": box[0]["link"],
        "profile": profile,
        "loss": loss,
        "profile_load": profile_load,
        "plans": plans,
        "runs": runs,
        "loads": loads,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="processes = pipeline stages")
    add_model_arguments(p, layers=8, vocab=16384)
    add_common_arguments(p)
    p.set_defaults(rounds=3, steps=10)
    args = p.parse_args()
    started = time.time()
    batch = args.mbs * args.microbatches
    print(provenance())
    print(f"gloo, {args.world} processes x 1 thread; {describe(args)} (batch {batch})", flush=True)
    wait_for_quiet(args.quiet_wait, args.max_foreign, poll=20.0, patterns=OTHER_JOBS, log=print)
    results = run_distributed(speedup_job, args.world, args, timeout=args.timeout, group_timeout=3600.0)
    r0 = results[0]
    link, profile, plans = r0["link"], r0["profile"], r0["plans"]
    print(
        f"\nlink: latency {link['latency'] * 1e6:.0f} us, bandwidth {link['bandwidth'] / 1e9:.2f} GB/s; profile (both ranks at once, "
        f"foreign load {r0['profile_load']:.2f} CPUs): f+b per micro-batch: embedding {1e3 * (profile.forward[0] + profile.backward[0]):.2f} ms, "
        f"layers {1e3 * sum(profile.forward[1:-1] + profile.backward[1:-1]):.1f} ms, head {1e3 * (profile.forward[-1] + profile.backward[-1]):.1f} ms "
        f"(of which the loss {1e3 * sum(r0['loss']):.1f} ms)"
    )
    rows = {}
    for m in METHODS:
        steps, iters = [], []
        for rnd in range(len(r0["runs"][m])):
            for s in range(len(r0["runs"][m][rnd])):
                spans = [r["runs"][m][rnd][s] for r in results]
                start = min(t for t, _, _ in spans)
                iters.append(max(e for _, e, _ in spans) - start)
                steps.append(max(e for _, _, e in spans) - start)
        rows[m] = {"step": statistics.median(steps), "iteration": statistics.median(iters), "load": max(r0["loads"][m]), "n": len(steps)}
    print(
        "\n| partition | blocks per stage | stage contents | measured step ms | samples/s | pipeline iteration ms | simulated ms | foreign load |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for m in METHODS:
        pl, r = plans[m], rows[m]
        print(
            f"| {m} | {list(pl.sizes)} | {' / '.join(pl.contents(s) for s in range(pl.stages))} | {r['step'] * 1e3:.1f} | "
            f"{batch / r['step']:.1f} | {r['iteration'] * 1e3:.1f} | {pl.iteration_time * 1e3:.1f} | {r['load']:.2f} |"
        )
    measured = rows["uniform"]["step"] / rows["autopipe"]["step"]
    pipeline = rows["uniform"]["iteration"] / rows["autopipe"]["iteration"]
    simulated = plans["uniform"].iteration_time / plans["autopipe"].iteration_time
    print(
        f"\nspeed-up of autopipe over uniform: measured {measured:.3f}x (training step: samples/s), {pipeline:.3f}x "
        f"(pipeline step alone); simulated {simulated:.3f}x"
    )
    print(f"({rows['autopipe']['n']} timed steps per partition, medians; total {time.time() - started:.0f} s)")


if __name__ == "__main__":
    main()
