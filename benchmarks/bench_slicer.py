"""AutoPipe slicer (paper §III-C): start-up overhead and iteration time with and without slicing.

    python benchmarks/bench_slicer.py [--models gpt2-345m gpt2-1.3b] [--stages 2 4 8 16]

Simulated on FLOP-based cost profiles (lightning_pipe.planning.transformer_costs) with the
AutoPipe plan of each depth, 1F1B, m = 2 x stages micro-batches. The slicer's count is the
simulator's choice (fastest iteration, then shortest start-up). Start-up = time until the last
stage starts its first forward. Target: start-up cut by >= 45% at >= 4 stages.
"""

from __future__ import annotations

import argparse

from lightning_pipe.planning import plan, transformer_costs
from lightning_pipe.planning.slicer import choose_slicing


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["gpt2-345m", "gpt2-762m", "gpt2-1.3b", "bert-large"])
    parser.add_argument("--stages", nargs="+", type=int, default=[2, 4, 8, 16])
    parser.add_argument("--microbatch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--pictures", default=None, help="folder for timelines of gpt2-345m at 4 stages, without and with slicing")
    args = parser.parse_args()
    print(
        f"{'model':<11} {'p':>3} {'m':>3} {'k':>3} {'start-up ms':>12} {'sliced':>9} {'cut':>6} {'iteration ms':>13} {'sliced':>9} {'gain':>6}"
    )
    worst_cut = 1.0
    for name in args.models:
        seq = min(args.seq_len, 512) if name.startswith("bert") else args.seq_len
        costs, kinds = transformer_costs(name, args.microbatch, seq)
        for p in args.stages:
            m = 2 * p
            best = plan(costs, p, m, method="autopipe", kinds=kinds)
            s = choose_slicing(costs, best.bounds, m)
            if p >= 4:
                worst_cut = min(worst_cut, s.startup_cut)
            gain = 1 - s.iteration_time / s.baseline_iteration_time
            print(
                f"{name:<11} {p:>3} {m:>3} {s.sliced:>3} {s.baseline_startup * 1e3:>12.2f} {s.startup * 1e3:>9.2f} {s.startup_cut:>6.1%} "
                f"{s.baseline_iteration_time * 1e3:>13.2f} {s.iteration_time * 1e3:>9.2f} {gain:>6.1%}"
            )
    print(f"\nsmallest start-up cut at >= 4 stages: {worst_cut:.1%} (target >= 45%)")
    if args.pictures:
        from lightning_pipe.planning.slicer import simulate_sliced
        from lightning_pipe.viz import gantt

        costs, kinds = transformer_costs("gpt2-345m", args.microbatch, args.seq_len)
        best = plan(costs, 4, 8, method="autopipe", kinds=kinds)
        k = choose_slicing(costs, best.bounds, 8).sliced
        for name, sliced in (("off", 0), ("on", k)):
            t = simulate_sliced(costs, best.bounds, 8, sliced)
            gantt(
                t,
                f"{args.pictures}/slicer_{name}.png",
                title=f"gpt2-345m, 4 stages, 1F1B, m=8, slicer {name} "
                f"(k={sliced}): start-up {t.startup * 1e3:.1f} ms, iteration {t.iteration_time * 1e3:.1f} ms",
            )
        print(f"pictures written to {args.pictures}")


if __name__ == "__main__":
    main()
