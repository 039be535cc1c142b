"""AutoPipe slicer (paper §III-C): start-up and iteration time with and without slicing.

Simulated on FLOP-based profiles with each depth's AutoPipe plan, 1F1B, m = 2 x stages: ours
(`choose_slicing`) vs the paper's Algorithm 2. ``--measure``: the traced runtime (gloo) with and
without slicing at 2 ranks (the residual MLP) and 4 / 8 (emulated devices whose time scales with
the rows), against the simulator on the same costs. Feeds docs/results/autopipe.md.

    python -m benchmarks.bench_slicer --pictures docs/img
    flock /tmp/bench.lock python -m benchmarks.bench_slicer --measure   # real processes, ~3 min
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.harness.bench import Bench, Table
from benchmarks.harness.emulated import EmulatedBlock, _Occupy
from benchmarks.harness.mlp import make_model
from lightning_pipe.planning import plan, transformer_costs
from lightning_pipe.planning.slicer import algorithm2_slicing, choose_slicing, simulate_sliced
from lightning_pipe.planning.slicer_algorithm2 import algorithm2, paper_schedule, simulate_paper, stage_times
from lightning_pipe.profiling.link import ping_pong
from lightning_pipe.runtime.executor import Executor
from lightning_pipe.runtime.microbatch import signature, split_microbatches
from lightning_pipe.runtime.p2p import Transport
from lightning_pipe.runtime.sequential import SequentialHost
from lightning_pipe.schedules import build_schedule
from lightning_pipe.simulation import CostModel

pct = "{:.1%}".format


def simulated(bench: Bench, args) -> None:
    columns = "model p m k start-up_ms sliced cut iteration_ms sliced gain alg2_k start-up cut iteration gain"
    table = Table(*(c.replace("_", " ") for c in columns.split()))
    worst = [1.0, 1.0]
    for name in args.models:
        costs, kinds = transformer_costs(name, args.microbatch, min(args.seq_len, 512) if name.startswith("bert") else args.seq_len)
        for p in args.stages:
            best = plan(costs, p, 2 * p, method="autopipe", kinds=kinds)
            s, a = choose_slicing(costs, best.bounds, 2 * p), algorithm2_slicing(costs, best.bounds, 2 * p)
            if p >= 4:
                worst = [min(worst[0], s.startup_cut), min(worst[1], a.startup_cut)]
            ms2 = lambda *ts: [f"{1e3 * t:.2f}" for t in ts]  # noqa: E731
            row = [*ms2(s.baseline_startup, s.startup), pct(s.startup_cut), *ms2(s.baseline_iteration_time, s.iteration_time)]
            row += [pct(1 - s.iteration_time / s.baseline_iteration_time), a.sliced, *ms2(a.startup), pct(a.startup_cut)]
            table.add(name, p, 2 * p, s.sliced, *row, *ms2(a.iteration_time), pct(1 - a.iteration_time / a.baseline_iteration_time))
    bench.table(table, "simulated; ours = every k simulated, the fastest kept; alg2 = the paper's Algorithm 2 (count, schedule, merge)")
    bench.say(f"smallest start-up cut at >= 4 stages: ours {pct(worst[0])}, Algorithm 2 {pct(worst[1])} (target >= 45%)")
    if args.pictures:
        from lightning_pipe.simulation.timelines import gantt

        costs, kinds = transformer_costs("gpt2-345m", args.microbatch, args.seq_len)
        best = plan(costs, 4, 8, method="autopipe", kinds=kinds)
        for name, sliced in (("off", 0), ("on", choose_slicing(costs, best.bounds, 8).sliced)):
            t = simulate_sliced(costs, best.bounds, 8, sliced)
            title = f"gpt2-345m, 4 stages, 1F1B, m=8, slicer {name} (k={sliced}): start-up {t.startup * 1e3:.1f} ms, iteration {t.iteration_time * 1e3:.1f} ms"
            gantt(t, f"{args.pictures}/slicer_{name}.png", title=title)
        bench.log(f"pictures written to {args.pictures}")


class RowScaledBlock(EmulatedBlock):
    """An emulated block whose device time scales with the micro-batch's rows (`rows` = a whole
    micro-batch): the simulator's linear model, so a half occupies its rank for half the time."""

    def __init__(self, width: int, forward_s: float, backward_s: float, rows: int):
        super().__init__(width, forward_s, backward_s)
        self.rows = rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        share = x.shape[0] / self.rows
        return _Occupy.apply(x + torch.tanh(self.linear(x)), self.forward_s * share, self.backward_s * share)


def _stage(cfg: dict, rank: int) -> torch.nn.Module:
    if cfg["kind"] == "mlp":
        per = cfg["blocks"] // cfg["stages"]
        return make_model(cfg)[rank * per : (rank + 1) * per]
    torch.manual_seed(rank)
    rows, n = cfg["batch"] // cfg["microbatches"], cfg["blocks_per_stage"]
    return torch.nn.Sequential(*[RowScaledBlock(cfg["hidden"], cfg["f"] / n, cfg["b"] / n, rows) for _ in range(n)])


def _schedule(p: int, m: int, variant: tuple[str, int]):
    name, k = variant
    return paper_schedule(p, m, k, merge=not name.endswith("nomerge")) if name.startswith("alg2") else build_schedule("1f1b", p, m + k)


def _measure_job(rank: int, world: int, cfg: dict, variants: list) -> dict:
    link = ping_pong(rank) if cfg.get("ping") else None
    stage, m = _stage(cfg, rank), cfg["microbatches"]
    host = SequentialHost({rank: stage}, world - 1, lambda out, y: F.mse_loss(out, y))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(cfg["batch"], cfg["hidden"], generator=g), torch.randn(cfg["batch"], cfg["hidden"], generator=g)
    executors = {v: Executor(_schedule(world, m, v), rank, Transport(lambda r: r, torch.device("cpu")), trace=True) for v in variants}
    out: dict = {v: [] for v in variants}
    for _ in range(cfg["rounds"]):
        for v, ex in executors.items():
            for step in range(cfg["warmup"] + cfg["per_round"]):
                (host.inputs, host.weights), (host.targets, _) = split_microbatches(x, m, v[1]), split_microbatches(y, m, v[1])
                host.losses = []
                stage.zero_grad(set_to_none=True)
                dist.barrier()
                ex.run(host, [signature(t) for t in host.inputs])
                if step >= cfg["warmup"]:
                    acts = [(ex.actions[i], s, e) for i, s, e in ex.records if ex.actions[i].op.is_compute]
                    comp = [(a.op.value, a.microbatch, s, e) for a, s, e in acts]
                    out[v].append({k: [(mb, e - s) for op, mb, s, e in comp if op == k.upper()] for k in ("f", "b")})
                    out[v][-1].update(
                        first_f=min(s for op, _, s, _ in comp if op == "F"), start=min(c[2] for c in comp), end=max(c[3] for c in comp)
                    )
    return {"steps": out, "link": link}


def _run(bench: Bench, cfg: dict, variants: list) -> tuple[dict, list]:
    """{variant: (median start-up, median iteration)} in seconds, and every rank's records."""
    ranks, foreign = bench.run(_measure_job, cfg["stages"], cfg, variants, label=f"{cfg['stages']} ranks")
    bench.say(f"  (segment of {cfg['stages']} ranks: other processes used {foreign:.2f} CPUs meanwhile)")
    result = {}
    for v in variants:
        steps = list(zip(*(r["steps"][v] for r in ranks)))
        startups = [s[-1]["first_f"] - s[0]["first_f"] for s in steps]
        result[v] = (statistics.median(startups), statistics.median(max(x["end"] for x in s) - min(x["start"] for x in s) for s in steps))
    return result, ranks


def _profile(ranks: list, kind: str, v=("off", 0)) -> list[float]:
    """Per rank, the median traced time of a whole micro-batch's forward ("f") or backward ("b")."""
    return [statistics.median(d for s in r["steps"][v] for _, d in s[kind]) for r in ranks]


def _variants(costs: CostModel, bounds: list, m: int, force: bool) -> tuple[list, int, int]:
    ours, alg2 = choose_slicing(costs, bounds, m).sliced, algorithm2(*stage_times(costs, bounds), m).sliced
    variants = [("off", 0), ("ours", ours) if ours or not force else ("ours-forced", 1), ("alg2", alg2)]
    variants += [("alg2-nomerge", alg2)] if alg2 >= 2 else []
    return list(dict.fromkeys(v if v[1] else ("off", 0) for v in variants)), ours, alg2


def _print_rows(bench: Bench, title: str, m: int, costs, bounds, variants: list, measured: dict) -> None:
    table = Table("variant", "k", "start-up ms", "simulated", "cut", "sim cut", "iteration ms", "simulated", "error")
    base_meas, base_sim = measured[("off", 0)][0], simulate_sliced(costs, bounds, m, 0).startup
    for name, k in variants:
        alg2 = name.startswith("alg2")
        t = simulate_paper(costs, bounds, m, k, merge=not name.endswith("nomerge")) if alg2 else simulate_sliced(costs, bounds, m, k)
        su, it = measured[(name, k)]
        row = [f"{su * 1e3:.2f}", f"{t.startup * 1e3:.2f}", pct(1 - su / base_meas), pct(1 - t.startup / base_sim)]
        table.add(name, k, *row, f"{it * 1e3:.2f}", f"{t.iteration_time * 1e3:.2f}", f"{it / t.iteration_time - 1:+.1%}")
    bench.table(table, title)


def measure(bench: Bench, args) -> None:
    rounds, per_round = max(1, args.steps // 4), min(4, args.steps)
    # 2 ranks, real compute: profile from an unsliced traced run, then every variant interleaved
    cfg = dict(kind="mlp", stages=2, hidden=512, mlp_ratio=4, blocks=8, batch=256, microbatches=4)
    cfg.update(rounds=1, per_round=6, warmup=2, ping=True)
    rows, m, bounds = 64, 4, [(0, 1), (1, 2)]
    _, ranks = _run(bench, cfg, [("off", 0)])
    link = ranks[0]["link"]
    lk = {k: link[k] for k in ("latency", "bandwidth")}
    f, b = _profile(ranks, "f"), _profile(ranks, "b")
    costs = CostModel(tuple(f), tuple(b), activation_bytes=(rows * cfg["hidden"] * 4.0,) * 2, **lk)
    fmt = lambda ts: [round(t * 1e3, 2) for t in ts]  # noqa: E731
    head = f"link {link['latency'] * 1e6:.0f} us, {link['bandwidth'] / 1e9:.1f} GB/s; profile to choose k (traced, unsliced, median): "
    bench.say(head + f"f = {fmt(f)} ms, b = {fmt(b)} ms per micro-batch of {rows} rows")
    variants, ours, alg2 = _variants(costs, bounds, m, force=True)
    cfg.update(rounds=rounds, per_round=per_round, warmup=1, ping=False)
    measured, ranks = _run(bench, cfg, variants)
    f, b = _profile(ranks, "f"), _profile(ranks, "b")  # the simulated columns: the profile of this same run
    costs = CostModel(tuple(f), tuple(b), activation_bytes=costs.activation_bytes, **lk)
    bench.say(f"profile of the measured run (unsliced steps, traced, median): f = {fmt(f)} ms, b = {fmt(b)} ms")
    title = f"2 ranks, real compute (residual MLP, hidden 512, 8 blocks, batch 256, m = 4): k ours = {ours}, Algorithm 2 = {alg2}"
    _print_rows(bench, title, m, costs, bounds, variants, measured)
    for v in variants[1:]:
        half = lambda r, kind: statistics.median(d for s in r["steps"][v] for mb, d in s[kind] if mb < 2 * v[1])  # noqa: E731
        ratios = [round(half(r, kind) / _profile([r], kind)[0], 2) for r in ranks for kind in ("f", "b")]
        bench.say(f"{v[0]}: a half's time / a whole micro-batch's (traced; rank 0 f, b, rank 1 f, b): {ratios} (the simulator assumes 0.5)")
    # 4 and 8 ranks, emulated devices
    for p in (4,) if args.quick else (4, 8):
        cfg = dict(kind="emulated", stages=p, hidden=16, blocks_per_stage=2, f=0.006, b=0.012, batch=16 * p, microbatches=2 * p)
        cfg.update(rounds=rounds, per_round=per_round, warmup=1)
        costs = CostModel((cfg["f"],) * p, (cfg["b"],) * p, activation_bytes=(8 * cfg["hidden"] * 4.0,) * p, **lk)
        bounds = [(i, i + 1) for i in range(p)]
        variants, ours, alg2 = _variants(costs, bounds, 2 * p, force=False)
        measured, _ = _run(bench, cfg, variants)
        title = (
            f"{p} ranks on EMULATED devices (blocks sleep for their time, scaled with the rows; f = 6 ms, b = 12 ms per stage "
            f"and micro-batch; m = {2 * p}): k ours = {ours}, Algorithm 2 = {alg2}"
        )
        _print_rows(bench, title, 2 * p, costs, bounds, variants, measured)


def main() -> None:
    quick = dict(models=["gpt2-345m"], stages=[2, 4])
    bench = Bench(__doc__, quick, threads=1, steps=12, retries=1, max_foreign=0.15, quiet_wait=60.0, timeout=900.0)
    bench.parser.add_argument("--models", nargs="+", default=["gpt2-345m", "gpt2-762m", "gpt2-1.3b", "bert-large"])
    bench.parser.add_argument("--stages", nargs="+", type=int, default=[2, 4, 8, 16])
    bench.options(microbatch=4, seq_len=1024, pictures=(None, "folder for timelines of gpt2-345m at 4 stages, without and with slicing"))
    bench.options(measure=(False, "measure on real processes (2 real, 4 and 8 emulated ranks)"))
    args = bench.parse()
    (measure if args.measure else simulated)(bench, args)
    bench.finish()


if __name__ == "__main__":
    main()
