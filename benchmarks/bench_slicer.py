"""AutoPipe slicer (paper §III-C): start-up overhead and iteration time with and without slicing.

    python benchmarks/bench_slicer.py [--models gpt2-345m gpt2-1.3b] [--stages 2 4 8 16]
    flock /tmp/bench.lock python benchmarks/bench_slicer.py --measure   # real processes, ~3 min

Simulated on FLOP-based cost profiles (lightning_pipe.planning.transformer_costs) with the
AutoPipe plan of each depth, 1F1B, m = 2 x stages micro-batches: k and the figures of ours
(`choose_slicing`: every k simulated, the fastest kept) and of the paper's Algorithm 2
(`algorithm2_slicing`: its count, its schedule with the merged messages). Start-up = time until
the last stage starts its first forward. Target: start-up cut by >= 45% at >= 4 stages.

``--measure`` runs the runtime (`SequentialHost` + `Executor(trace=True)`, gloo, one thread per
process) with and without slicing and reads start-up and iteration time off the trace (one
machine-wide monotonic clock): at 2 ranks on real compute (the residual MLP of bench_runtime),
and at 4 and 8 ranks on emulated devices (blocks that sleep for their time, scaled with the rows
of the micro-batch, as a GPU leaves its host idle), each against the simulator on the same costs.
"""

from __future__ import annotations

import argparse
import os
import statistics

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import torch  # noqa: E402

from lightning_pipe.bench.emulated import EmulatedBlock  # noqa: E402
from lightning_pipe.planning import plan, transformer_costs  # noqa: E402
from lightning_pipe.planning.slicer import algorithm2_slicing, choose_slicing  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["gpt2-345m", "gpt2-762m", "gpt2-1.3b", "bert-large"])
    parser.add_argument("--stages", nargs="+", type=int, default=[2, 4, 8, 16])
    parser.add_argument("--microbatch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--pictures", default=None, help="folder for timelines of gpt2-345m at 4 stages, without and with slicing")
    parser.add_argument("--measure", action="store_true", help="measure on real processes (2 real, 4 and 8 emulated ranks)")
    parser.add_argument("--steps", type=int, default=12, help="--measure: timed steps per variant (in rounds of 4)")
    args = parser.parse_args()
    if args.measure:
        measure(args.steps)
        return
    print("simulated; ours = every k simulated, the fastest kept; alg2 = the paper's Algorithm 2 (count, schedule, merge)")
    print(
        f"{'model':<11} {'p':>3} {'m':>3} {'k':>3} {'start-up ms':>12} {'sliced':>9} {'cut':>6} {'iteration ms':>13} {'sliced':>9} {'gain':>6}"
        f" | {'alg2 k':>6} {'start-up':>9} {'cut':>6} {'iteration':>10} {'gain':>6}"
    )
    worst_cut = worst_alg2 = 1.0
    for name in args.models:
        seq = min(args.seq_len, 512) if name.startswith("bert") else args.seq_len
        costs, kinds = transformer_costs(name, args.microbatch, seq)
        for p in args.stages:
            m = 2 * p
            best = plan(costs, p, m, method="autopipe", kinds=kinds)
            s = choose_slicing(costs, best.bounds, m)
            if p >= 4:
                worst_cut = min(worst_cut, s.startup_cut)
            a = algorithm2_slicing(costs, best.bounds, m)
            if p >= 4:
                worst_alg2 = min(worst_alg2, a.startup_cut)
            gain = 1 - s.iteration_time / s.baseline_iteration_time
            print(
                f"{name:<11} {p:>3} {m:>3} {s.sliced:>3} {s.baseline_startup * 1e3:>12.2f} {s.startup * 1e3:>9.2f} {s.startup_cut:>6.1%} "
                f"{s.baseline_iteration_time * 1e3:>13.2f} {s.iteration_time * 1e3:>9.2f} {gain:>6.1%}"
                f" | {a.sliced:>6} {a.startup * 1e3:>9.2f} {a.startup_cut:>6.1%} {a.iteration_time * 1e3:>10.2f} "
                f"{1 - a.iteration_time / a.baseline_iteration_time:>6.1%}"
            )
    print(f"\nsmallest start-up cut at >= 4 stages: ours {worst_cut:.1%}, Algorithm 2 {worst_alg2:.1%} (target >= 45%)")
    if args.pictures:
        from lightning_pipe.planning.slicer import simulate_sliced
        from lightning_pipe.simulation.timelines import gantt

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


# ---- measured on real processes ----------------------------------------------------------------
class RowScaledBlock(EmulatedBlock):
    """An emulated block whose device time scales with the micro-batch's rows (`rows` = one whole
    micro-batch): the simulator's linear model, so a half occupies its rank for half the time."""

    def __init__(self, width: int, forward_s: float, backward_s: float, rows: int):
        super().__init__(width, forward_s, backward_s)
        self.rows = rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from lightning_pipe.bench.emulated import _Occupy

        share = x.shape[0] / self.rows
        return _Occupy.apply(x + torch.tanh(self.linear(x)), self.forward_s * share, self.backward_s * share)


def _stage(cfg: dict, rank: int) -> torch.nn.Module:
    if cfg["kind"] == "mlp":
        from lightning_pipe.bench.mlp import make_model

        model = make_model(cfg)
        per = len(model) // cfg["stages"]
        return model[rank * per : (rank + 1) * per]
    torch.manual_seed(rank)
    rows = cfg["batch"] // cfg["microbatches"]
    blocks = cfg["blocks_per_stage"]
    return torch.nn.Sequential(*[RowScaledBlock(cfg["hidden"], cfg["f"] / blocks, cfg["b"] / blocks, rows) for _ in range(blocks)])


def _schedule(p: int, m: int, variant: tuple[str, int]):
    from lightning_pipe.planning.slicer_algorithm2 import paper_schedule
    from lightning_pipe.schedules import build_schedule

    name, k = variant
    if name.startswith("alg2"):
        return paper_schedule(p, m, k, merge=not name.endswith("nomerge"))
    return build_schedule("1f1b", p, m + k)


def _measure_job(rank: int, world: int, cfg: dict, variants: list) -> dict:
    import torch.distributed as dist
    import torch.nn.functional as F

    from lightning_pipe.profiling.link import ping_pong
    from lightning_pipe.runtime.executor import Executor
    from lightning_pipe.runtime.microbatch import signature, split_microbatches
    from lightning_pipe.runtime.p2p import Transport
    from lightning_pipe.runtime.sequential import SequentialHost

    link = ping_pong(rank) if cfg.get("ping") else None
    stage = _stage(cfg, rank)
    host = SequentialHost({rank: stage}, world - 1, lambda out, y: F.mse_loss(out, y))
    transport = Transport(lambda r: r, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(cfg["batch"], cfg["hidden"], generator=g), torch.randn(cfg["batch"], cfg["hidden"], generator=g)
    executors = {v: Executor(_schedule(world, cfg["microbatches"], v), rank, transport, trace=True) for v in variants}
    out: dict = {v: [] for v in variants}
    for rnd in range(cfg["rounds"]):
        for v in variants:
            ex = executors[v]
            for step in range(cfg["warmup"] + cfg["per_round"]):
                host.inputs, host.weights = split_microbatches(x, cfg["microbatches"], v[1])
                host.targets, _ = split_microbatches(y, cfg["microbatches"], v[1])
                host.losses = []
                stage.zero_grad(set_to_none=True)
                dist.barrier()
                ex.run(host, [signature(t) for t in host.inputs])
                if step >= cfg["warmup"]:
                    comp = [(ex.actions[i], s, e) for i, s, e in ex.records if ex.actions[i].op.is_compute]
                    out[v].append(
                        {
                            "first_f": min(s for a, s, _ in comp if a.op.value == "F"),
                            "start": min(s for _, s, _ in comp),
                            "end": max(e for _, _, e in comp),
                            "f": [(a.microbatch, e - s) for a, s, e in comp if a.op.value == "F"],
                            "b": [(a.microbatch, e - s) for a, s, e in comp if a.op.value == "B"],
                        }
                    )
    return {"steps": out, "link": link}


def _run(cfg: dict, variants: list) -> tuple[dict, dict]:
    """{variant: (median start-up, median iteration)} in seconds, and the raw records."""
    from lightning_pipe.bench.launch import run_undisturbed

    ranks, foreign = run_undisturbed(_measure_job, cfg["stages"], cfg, variants, retries=1, max_foreign=0.15, quiet_wait=60.0, timeout=900)
    print(f"  (segment of {cfg['stages']} ranks: other processes used {foreign:.2f} CPUs meanwhile)", flush=True)
    result = {}
    for v in variants:
        startups, iterations = [], []
        for i in range(len(ranks[0]["steps"][v])):
            steps = [r["steps"][v][i] for r in ranks]
            startups.append(steps[-1]["first_f"] - steps[0]["first_f"])
            iterations.append(max(s["end"] for s in steps) - min(s["start"] for s in steps))
        result[v] = (statistics.median(startups), statistics.median(iterations))
    return result, {"ranks": ranks}


def _print_rows(title: str, cfg: dict, costs, bounds, variants: list, measured: dict) -> None:
    from lightning_pipe.planning.slicer import simulate_sliced
    from lightning_pipe.planning.slicer_algorithm2 import simulate_paper

    m = cfg["microbatches"]
    print(f"\n{title}")
    print(
        f"{'variant':<16} {'k':>2} {'start-up ms':>12} {'simulated':>10} {'cut':>6} {'sim cut':>8} {'iteration ms':>13} {'simulated':>10} {'error':>7}"
    )
    base_meas, base_sim = measured[("off", 0)][0], simulate_sliced(costs, bounds, m, 0).startup
    for v in variants:
        name, k = v
        t = (
            simulate_paper(costs, bounds, m, k, merge=not name.endswith("nomerge"))
            if name.startswith("alg2")
            else simulate_sliced(costs, bounds, m, k)
        )
        su, it = measured[v]
        print(
            f"{name:<16} {k:>2} {su * 1e3:>12.2f} {t.startup * 1e3:>10.2f} {1 - su / base_meas:>6.1%} {1 - t.startup / base_sim:>8.1%} "
            f"{it * 1e3:>13.2f} {t.iteration_time * 1e3:>10.2f} {it / t.iteration_time - 1:>+7.1%}"
        )


def measure(steps: int) -> None:
    import subprocess

    from lightning_pipe.bench.launch import machine_description
    from lightning_pipe.planning.slicer_algorithm2 import algorithm2, stage_times
    from lightning_pipe.simulation import CostModel

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False).stdout.strip()
    import datetime

    print(f"run {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M:%S} UTC, commit {commit}; {machine_description()}")
    rounds = max(1, steps // 4)

    # -- 2 ranks, real compute: profile from an unsliced traced run, then every variant interleaved
    cfg = dict(
        kind="mlp", stages=2, hidden=512, mlp_ratio=4, blocks=8, batch=256, microbatches=4, rounds=1, per_round=6, warmup=2, ping=True
    )
    prof, raw = _run(cfg, [("off", 0)])
    steps0 = [r["steps"][("off", 0)] for r in raw["ranks"]]
    f = [statistics.median(d for s in st for _, d in s["f"]) for st in steps0]
    b = [statistics.median(d for s in st for _, d in s["b"]) for st in steps0]
    link = raw["ranks"][0]["link"]
    rows = cfg["batch"] // cfg["microbatches"]
    costs = CostModel(
        tuple(f), tuple(b), activation_bytes=(rows * cfg["hidden"] * 4.0,) * 2, latency=link["latency"], bandwidth=link["bandwidth"]
    )
    bounds = [(0, 1), (1, 2)]
    print(
        f"\nlink {link['latency'] * 1e6:.0f} us, {link['bandwidth'] / 1e9:.1f} GB/s; profile to choose k (traced, unsliced, median): "
        f"f = {[round(t * 1e3, 2) for t in f]} ms, b = {[round(t * 1e3, 2) for t in b]} ms per micro-batch of {rows} rows"
    )
    ours = choose_slicing(costs, bounds, cfg["microbatches"]).sliced
    alg2 = algorithm2(*stage_times(costs, bounds), cfg["microbatches"]).sliced
    variants = [("off", 0), ("ours", ours) if ours else ("ours-forced", 1), ("alg2", alg2)] + (
        [("alg2-nomerge", alg2)] if alg2 >= 2 else []
    )
    variants = list(dict.fromkeys(v if v[1] else ("off", 0) for v in variants))
    cfg.update(rounds=rounds, per_round=4, warmup=1, ping=False)
    measured, raw = _run(cfg, variants)
    steps0 = [r["steps"][("off", 0)] for r in raw["ranks"]]  # the simulated columns: the profile of this same run
    f = [statistics.median(d for s in st for _, d in s["f"]) for st in steps0]
    b = [statistics.median(d for s in st for _, d in s["b"]) for st in steps0]
    costs = CostModel(tuple(f), tuple(b), activation_bytes=costs.activation_bytes, latency=link["latency"], bandwidth=link["bandwidth"])
    print(
        f"profile of the measured run (unsliced steps, traced, median): f = {[round(t * 1e3, 2) for t in f]} ms, b = {[round(t * 1e3, 2) for t in b]} ms"
    )
    _print_rows(
        f"2 ranks, real compute (residual MLP, hidden 256, 8 blocks, batch 256, m = 4): k ours = {ours}, Algorithm 2 = {alg2}",
        cfg,
        costs,
        bounds,
        variants,
        measured,
    )
    for v in variants[1:]:
        ratios = []
        for st in [r["steps"] for r in raw["ranks"]]:
            for kind in ("f", "b"):
                whole = statistics.median(d for s in st[("off", 0)] for _, d in s[kind])
                half = statistics.median(d for s in st[v] for mb, d in s[kind] if mb < 2 * v[1])
                ratios.append(round(half / whole, 2))
        print(f"{v[0]}: a half's time / a whole micro-batch's (traced; rank 0 f, b, rank 1 f, b): {ratios} (the simulator assumes 0.5)")

    # -- 4 and 8 ranks, emulated devices
    for p in (4, 8):
        cfg = dict(
            kind="emulated",
            stages=p,
            hidden=16,
            blocks_per_stage=2,
            f=0.006,
            b=0.012,
            batch=8 * 2 * p,
            microbatches=2 * p,
            rounds=rounds,
            per_round=4,
            warmup=1,
        )
        rows = cfg["batch"] // cfg["microbatches"]
        costs = CostModel(
            (cfg["f"],) * p,
            (cfg["b"],) * p,
            activation_bytes=(rows * cfg["hidden"] * 4.0,) * p,
            latency=link["latency"],
            bandwidth=link["bandwidth"],
        )
        bounds = [(i, i + 1) for i in range(p)]
        ours = choose_slicing(costs, bounds, cfg["microbatches"]).sliced
        alg2 = algorithm2(*stage_times(costs, bounds), cfg["microbatches"]).sliced
        variants = [("off", 0), ("ours", ours), ("alg2", alg2)] + ([("alg2-nomerge", alg2)] if alg2 >= 2 else [])
        variants = list(dict.fromkeys(v if v[1] else ("off", 0) for v in variants))
        measured, _ = _run(cfg, variants)
        _print_rows(
            f"{p} ranks on EMULATED devices (blocks sleep for their time, scaled with the rows; f = 6 ms, b = 12 ms per stage "
            f"and micro-batch; m = {2 * p}): k ours = {ours}, Algorithm 2 = {alg2}",
            cfg,
            costs,
            bounds,
            variants,
            measured,
        )


if __name__ == "__main__":
    main()
