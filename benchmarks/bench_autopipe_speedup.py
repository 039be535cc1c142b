"""Measured speed-up of the `autopipe` partition over `uniform` (Megatron-LM's equal layers) on CPU: a
GPT with a heavy tied embedding / head (lightning_pipe.bench.gpt, vocabulary 16384) on 2 gloo processes,
1F1B, m = 8; link and profile (`gather_profile`) in the job, both partitions planned on rank 0 and
trained interleaved (pipeline step, tied-gradient all-reduce, SGD). Results: docs/autopipe.md (d).

    python benchmarks/bench_autopipe_speedup.py   # ~2 min on a quiet machine
    python benchmarks/bench_autopipe_speedup.py --vocab 32768 --layers 8 --rounds 3
    python benchmarks/bench_autopipe_speedup.py --quick
"""

from __future__ import annotations

import statistics
import time

from lightning_pipe.bench.harness import Bench, Table, pin_threads

pin_threads(1)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from lightning_pipe.bench.gpt import add_model_arguments, build_model, describe, gather_profile, lm_loss, make_batch, segment  # noqa: E402
from lightning_pipe.bench.launch import OTHER_JOBS, rank_zero_log, run_distributed, wait_for_quiet  # noqa: E402
from lightning_pipe.planning.entry import block_kinds  # noqa: E402

METHODS = ("uniform", "autopipe")


def train_partition(model: nn.Sequential, bounds, rank: int, world: int, x, y, args) -> list[tuple[float, float, float]]:
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


def speedup_job(rank: int, world: int, args) -> dict:
    from lightning_pipe.planning import plan
    from lightning_pipe.profiling.link import ping_pong

    log = rank_zero_log(rank)
    model = build_model(args)
    x, y = make_batch(args)
    link, _ = segment(lambda: ping_pong(rank), rank, world, args, log)
    run = lambda: gather_profile(list(model), x[: args.mbs], y[: args.mbs], rank, world, args.profile_repeats, False, "gpt", args.mbs)  # noqa: E731
    (profile, loss), profile_load = segment(run, rank, world, args, log)
    kinds = block_kinds([type(b).__name__ for b in model])
    box = [None]
    if rank == 0:
        costs = profile.costs(link["bandwidth"], link["latency"])
        box = [{m: plan(costs, world, args.microbatches, method=m, kinds=kinds) for m in METHODS}]
    dist.broadcast_object_list(box, 0)
    plans = box[0]
    runs, loads = {m: [] for m in METHODS}, {m: [] for m in METHODS}
    for rnd in range(args.rounds):
        for m in METHODS if rnd % 2 == 0 else METHODS[::-1]:
            out, load = segment(lambda: train_partition(model, plans[m].bounds, rank, world, x, y, args), rank, world, args, log)
            runs[m].append(out)
            loads[m].append(load)
            log(f"  round {rnd + 1}/{args.rounds} {m:<9} done (foreign load {load:.2f} CPUs)")
    return {"link": link, "profile": profile, "loss": loss, "profile_load": profile_load, "plans": plans, "runs": runs, "loads": loads}


def main() -> None:
    bench = Bench(
        __doc__, dict(layers=2, vocab=2048), rounds=3, steps=10, warmup=3, retries=2, max_foreign=0.15, quiet_wait=600.0, timeout=3600.0
    )
    p = bench.parser
    p.add_argument("--world", type=int, default=2, help="processes = pipeline stages")
    add_model_arguments(p, layers=8, vocab=16384)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--profile-repeats", type=int, default=10, help="profile_blocks repeats per block (after 2 warm-up)")
    args = bench.parse()
    batch = args.mbs * args.microbatches
    bench.say(f"gloo, {args.world} processes x 1 thread; {describe(args)} (batch {batch})")
    if bench.patient:
        wait_for_quiet(args.quiet_wait, args.max_foreign, poll=20.0, patterns=OTHER_JOBS, log=bench.log)
    results = run_distributed(speedup_job, args.world, args, timeout=args.timeout, group_timeout=3600.0)
    r0 = results[0]
    link, profile, plans = r0["link"], r0["profile"], r0["plans"]
    for m in METHODS:
        bench.log(plans[m].table())
    fb = lambda i, j: 1e3 * sum(profile.forward[i:j] + profile.backward[i:j])  # noqa: E731
    bench.say(
        f"link: latency {link['latency'] * 1e6:.0f} us, bandwidth {link['bandwidth'] / 1e9:.2f} GB/s; profile (both ranks at once, "
        f"foreign load {r0['profile_load']:.2f} CPUs): f+b per micro-batch: embedding {fb(0, 1):.2f} ms, layers {fb(1, -1):.1f} ms, "
        f"head {fb(-1, None):.1f} ms (of which the loss {1e3 * sum(r0['loss']):.1f} ms)\n"
    )
    rows = {}
    for m in METHODS:  # a step spans from the first rank's start to the last rank's end
        spans = [[r["runs"][m][rnd][s] for r in results] for rnd in range(len(r0["runs"][m])) for s in range(len(r0["runs"][m][rnd]))]
        iteration = statistics.median(max(e for _, e, _ in sp) - min(t for t, _, _ in sp) for sp in spans)
        step = statistics.median(max(e for _, _, e in sp) - min(t for t, _, _ in sp) for sp in spans)
        rows[m] = {"step": step, "iteration": iteration, "load": max(r0["loads"][m]), "n": len(spans)}
    t = Table("partition", "blocks per stage", "stage contents", "measured step ms", "samples/s", "pipeline iteration ms", "simulated ms",
              "foreign load", align="lllrrrrr")  # fmt: skip
    for m in METHODS:
        pl, r = plans[m], rows[m]
        t.add(m, list(pl.sizes), " / ".join(pl.contents(s) for s in range(pl.stages)), f"{r['step'] * 1e3:.1f}", f"{batch / r['step']:.1f}",
              f"{r['iteration'] * 1e3:.1f}", f"{pl.iteration_time * 1e3:.1f}", f"{r['load']:.2f}")  # fmt: skip
    bench.table(t)
    ratio = lambda key: rows["uniform"][key] / rows["autopipe"][key]  # noqa: E731
    bench.say(
        f"speed-up of autopipe over uniform: measured {ratio('step'):.3f}x (training step: samples/s), {ratio('iteration'):.3f}x "
        f"(pipeline step alone); simulated {plans['uniform'].iteration_time / plans['autopipe'].iteration_time:.3f}x "
        f"({rows['autopipe']['n']} timed steps per partition, medians)"
    )
    bench.keep("rows", rows)
    bench.finish()


if __name__ == "__main__":
    main()
