"""Measured speed-up of the `autopipe` partition over `uniform` (Megatron-LM's equal layers) on CPU: a
GPT with a heavy tied embedding / head (lightning_pipe.bench.gpt, vocabulary 16384) on 2 gloo processes,
1F1B, m = 8; link and profile (`gather_profile`) in the job, both partitions planned on rank 0 and
trained interleaved (pipeline step, tied-gradient all-reduce, SGD). Results: docs/autopipe.md (d).

    python benchmarks/bench_autopipe_speedup.py   # ~2 min on a quiet machine
    python benchmarks/bench_autopipe_speedup.py --quick
"""

from __future__ import annotations

import statistics

from lightning_pipe.bench.harness import Bench, Table, pin_threads

pin_threads(1)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lightning_pipe.bench import gpt  # noqa: E402
from lightning_pipe.bench.launch import rank_zero_log  # noqa: E402
from lightning_pipe.bench.pipes import pipeline_steps, spans  # noqa: E402
from lightning_pipe.bench.trainer_runs import quiet_distributed, stage_pipeline  # noqa: E402
from lightning_pipe.planning import plan  # noqa: E402
from lightning_pipe.profiling.link import ping_pong  # noqa: E402

METHODS = ("uniform", "autopipe")


def train_partition(model, bounds, rank: int, world: int, x, y, args) -> list[tuple[float, float, float]]:
    """Warm-up, then timed steps of this rank's stage (`pipeline_steps`), the tied gradients all-reduced."""
    chunk, pipe = stage_pipeline(model, bounds, rank, world, args.microbatches, gpt.lm_loss)
    opt, tie = torch.optim.SGD(chunk.parameters(), lr=1e-3), gpt.tied_allreduce(model, bounds, rank)
    return pipeline_steps(pipe, opt, x, y, args.warmup + args.steps, tie)[args.warmup :]


def speedup_job(rank: int, world: int, args) -> dict:
    log, model, (x, y) = rank_zero_log(rank), gpt.build_model(args), gpt.make_batch(args)
    link, _ = gpt.segment(lambda: ping_pong(rank), rank, world, args, log)
    run = lambda: gpt.gather_profile(list(model), x[: args.mbs], y[: args.mbs], rank, world, args.profile_repeats, False, "gpt", args.mbs)  # noqa: E731
    (profile, loss), profile_load = gpt.segment(run, rank, world, args, log)
    plan_all = lambda costs: {m: plan(costs, world, args.microbatches, method=m, kinds=gpt.block_kinds(model)) for m in METHODS}
    box = [plan_all(profile.costs(link["bandwidth"], link["latency"])) if rank == 0 else None]
    dist.broadcast_object_list(box, 0)
    plans = box[0]
    runs, loads = {m: [] for m in METHODS}, {m: [] for m in METHODS}
    for rnd in range(args.rounds):
        for m in METHODS if rnd % 2 == 0 else METHODS[::-1]:
            out, load = gpt.segment(lambda: train_partition(model, plans[m].bounds, rank, world, x, y, args), rank, world, args, log)
            runs[m].append(out), loads[m].append(load)
            log(f"  round {rnd + 1}/{args.rounds} {m:<9} done (foreign load {load:.2f} CPUs)")
    return {"link": link, "profile": profile, "loss": loss, "profile_load": profile_load, "plans": plans, "runs": runs, "loads": loads}


def main() -> None:
    quick = dict(layers=2, vocab=2048)
    bench = Bench(__doc__, quick, rounds=3, steps=10, warmup=3, retries=2, max_foreign=0.15, quiet_wait=600.0, timeout=3600.0)
    p = bench.parser
    p.add_argument("--world", type=int, default=2, help="processes = pipeline stages")
    gpt.add_model_arguments(p, layers=8, vocab=16384)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--profile-repeats", type=int, default=10, help="profile_blocks repeats per block (after 2 warm-up)")
    args = bench.parse()
    bench.say(f"gloo, {args.world} processes x 1 thread; {gpt.describe(args)} (batch {(batch := args.mbs * args.microbatches)})")
    results = quiet_distributed(bench, speedup_job, args.world, args)
    r0, link, profile, plans = results[0], results[0]["link"], results[0]["profile"], results[0]["plans"]
    bench.log("\n".join(plans[m].table() for m in METHODS))
    fb = lambda i, j: 1e3 * sum(profile.forward[i:j] + profile.backward[i:j])  # noqa: E731
    bench.say(
        f"link: latency {link['latency'] * 1e6:.0f} us, bandwidth {link['bandwidth'] / 1e9:.2f} GB/s; profile (both ranks at once, foreign load "
        f"{r0['profile_load']:.2f} CPUs): f+b per micro-batch: embedding {fb(0, 1):.2f} ms, layers {fb(1, -1):.1f} ms, head {fb(-1, None):.1f} ms (of which the loss {1e3 * sum(r0['loss']):.1f} ms)\n"
    )
    rows = {}
    for m in METHODS:  # a step spans from the first rank's start to the last rank's end
        its, steps = spans([[t for rnd in r["runs"][m] for t in rnd] for r in results])  # every round's steps, in order
        rows[m] = {"step": statistics.median(steps), "iteration": statistics.median(its), "load": max(r0["loads"][m]), "n": len(steps)}
    t = Table("partition", "blocks per stage", "stage contents", "measured step ms", "samples/s", "pipeline iteration ms", "simulated ms",
              "foreign load", align="lllrrrrr")  # fmt: skip
    for m, pl, r in ((m, plans[m], rows[m]) for m in METHODS):
        t.add(m, list(pl.sizes), " / ".join(pl.contents(s) for s in range(pl.stages)), f"{r['step'] * 1e3:.1f}", f"{batch / r['step']:.1f}",
              f"{r['iteration'] * 1e3:.1f}", f"{pl.iteration_time * 1e3:.1f}", f"{r['load']:.2f}")  # fmt: skip
    bench.table(t)
    ratio = lambda key: rows["uniform"][key] / rows["autopipe"][key]  # noqa: E731
    bench.say(
        f"speed-up of autopipe over uniform: measured {ratio('step'):.3f}x (training step: samples/s), {ratio('iteration'):.3f}x (pipeline step alone); "
        f"simulated {plans['uniform'].iteration_time / plans['autopipe'].iteration_time:.3f}x ({rows['autopipe']['n']} timed steps per partition, medians)"
    )
    bench.keep("rows", rows)
    bench.finish()


if __name__ == "__main__":
    main()
