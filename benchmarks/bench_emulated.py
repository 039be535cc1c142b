"""Depth on EMULATED devices: every schedule at P = 2..16 ranks, measured against the simulator.

PacedBlocks (benchmarks.harness.emulated), 8 per rank, in the real runtime over gloo. Per (P, m,
schedule): the median iteration against the simulator's (plain, and with measure_messages' terms),
extra time per compute, exactness; then the targets. Method and tables: docs/results/emulated.md (the
summary: docs/results/predictions.md).

    flock /tmp/bench.lock python -m benchmarks.bench_emulated --json docs/results/emulated_results.json --markdown <file>
    python -m benchmarks.bench_emulated --quick     # smoke: P = 2, m = P, 2 steps
"""

from __future__ import annotations

import gc
import math
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.harness.bench import Bench, column_table, ms
from benchmarks.harness.emulated import emulated_model, fine_timer_slack
from benchmarks.harness.launch import CpuClock, foreign_load, run_distributed, wait_for_quiet
from benchmarks.harness.pipes import chunk_pipeline, pipeline_steps
from lightning_pipe.adaptive.stats import spearman
from lightning_pipe.errors import SettingError
from lightning_pipe.planning import partition_blocks
from lightning_pipe.planning.auto import CANDIDATES, choose_schedule
from lightning_pipe.profiling.link import ping_pong
from lightning_pipe.profiling.messages import MessageCosts, measure_messages
from lightning_pipe.runtime.p2p import Transport
from lightning_pipe.schedules import Op, ScheduleSpec, build_schedule
from lightning_pipe.simulation import CostModel, simulate

VARIANTS: tuple[tuple[str, dict[str, int]], ...] = (("gpipe", {}),) + CANDIDATES  # what auto weighs, and GPipe


def uniform_bounds(blocks: int, chunks: int) -> list[tuple[int, int]]:
    return [tuple(b) for b in partition_blocks("uniform", blocks, chunks).bounds]


def cases_for(p: int, blocks: int, multipliers: list[int], variants=VARIANTS) -> tuple[list[dict], list[dict]]:
    """The cases that run at depth p (with their chunk count), and the skipped ones with the schedule's reason."""
    run, skipped = [], []
    for m, (name, options) in ((k * p, variant) for k in multipliers for variant in variants):
        tag = "".join(f" {'v' if k == 'chunks' else 'W'}={v}" for k, v in sorted(options.items()))  # "wave W=2"
        case = {"p": p, "m": m, "schedule": name, "options": dict(options), "label": name + tag}
        try:
            spec = ScheduleSpec.of(name, **options)
            spec.check(p, blocks)
            spec.build(p, m)
        except (SettingError, ValueError) as err:
            skipped.append({**case, "reason": str(err)})
            continue
        run.append(dict(case, chunks=spec.chunk_count(p)))
    return run, skipped


def _data(rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(rows, width, generator=g, dtype=torch.float64)
    return x, torch.tanh(x.flip(1))


def reference_weights(cfg: dict) -> dict[str, torch.Tensor]:
    """One process, the same model (no sleeps), data, loss and SGD steps as every case."""
    model = emulated_model(cfg["blocks"], cfg["width"], 0.0, 0.0, seed=cfg["seed"], gain=cfg["gain"])
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
    x, y = _data(cfg["rows"], cfg["width"])
    for _ in range(cfg["warmup"] + cfg["steps"]):
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _job(rank: int, world: int, cfg: dict, cases: list[dict], reference: dict[str, torch.Tensor]) -> dict:
    slack = fine_timer_slack()
    if rank == 0:
        wait_for_quiet(cfg["quiet_wait"], 0.15, poll=5.0, log=lambda s: print(s, flush=True))
    dist.barrier()
    start = CpuClock.now()
    act_bytes = cfg["rows"] // (2 * world) * cfg["width"] * 8  # a boundary's message at m = 2P
    link = ping_pong(rank, sizes=(8, act_bytes, 1 << 16), repeats=40, warmup=5)
    msgs = measure_messages(list(range(world)), act_bytes, torch.device("cpu"), think=cfg["f"], sleep=True)  # sleeping per hop, as a rank
    transport = Transport(lambda r: r, torch.device("cpu"))
    x, y = _data(cfg["rows"], cfg["width"])
    out = []
    for case in cases:
        schedule = build_schedule(case["schedule"], world, case["m"], **case["options"])
        bounds = uniform_bounds(cfg["blocks"], schedule.num_chunks)
        model = emulated_model(cfg["blocks"], cfg["width"], cfg["f"], cfg["b"], seed=cfg["seed"], paced=True, gain=cfg["gain"])
        chunks, pipe, opt = chunk_pipeline(model, schedule, bounds, rank, transport, F.mse_loss, cfg["lr"])
        compute, size = [], [b - a for a, b in bounds]

        def extra() -> None:  # how long each compute occupied the rank beyond its emulated time (sleep
            # overshoot, the Linear, autograd, the executor's work around it)
            acts = [(pipe.executor.actions[i], e - s) for i, s, e in pipe.executor.records]
            extra = [t - (cfg["f"] if a.op is Op.FORWARD else cfg["b"]) * size[a.chunk] for a, t in acts if a.op.is_compute]
            compute.append((sum(extra), len(extra)))

        gc.collect()
        pipeline_steps(pipe, opt, x, y, cfg["warmup"])
        pipe.executor.trace = True
        spans = [(t0, t1) for t0, t1, _ in pipeline_steps(pipe, opt, x, y, cfg["steps"], extra)]
        mine = {k: v for k, v in model.state_dict().items() if any(a <= int(k.split(".")[0]) < b for a, b in (bounds[c] for c in chunks))}
        diff = max(((v - reference[k]).abs().max() / reference[k].abs().max().clamp(min=1e-30)).item() for k, v in mine.items())
        out.append({"spans": spans, "diff": diff, "extra": compute})
    end = CpuClock.now()
    own = [None] * world
    dist.all_gather_object(own, end.own - start.own)
    own_cpu = sum(own) / max(end.wall - start.wall, 1e-9)
    return dict(cases=out, link=link, messages=msgs, slack=slack, foreign=foreign_load(start, end, own=sum(own)), own_cpu=own_cpu)


KEYS = ("simulated", "simulated_msgs")  # the plain CostModel, and with measure_messages' terms


def costs_for(res: dict, m: int, key: str = "simulated"):
    """A depth's CostModel at m micro-batches: its emulated blocks and ping-pong link (key
    "simulated_msgs": with the message terms measured in its process group)."""
    cfg, link = res["config"], res["link"]
    act = (cfg["rows"] // m * cfg["width"] * 8.0,) * cfg["blocks"]
    costs = CostModel.uniform(cfg["blocks"], cfg["f"], cfg["b"], activation_bytes=act, latency=link["latency"], bandwidth=link["bandwidth"])
    return MessageCosts.from_dict(res["messages"]).apply(costs) if key == "simulated_msgs" else costs


def simulated(case: dict, costs) -> float:
    schedule = build_schedule(case["schedule"], case["p"], case["m"], **case["options"])
    return simulate(schedule, costs, uniform_bounds(costs.num_blocks, schedule.num_chunks), critical_path=False).iteration_time


def run_depth(bench: Bench, p: int, args) -> dict:
    """Every case at depth p in one process group: one record per case (measured, both simulations,
    exactness); printed."""
    blocks = args.blocks_per_rank * p
    cfg = dict(blocks=blocks, width=args.width, rows=args.rows, f=args.block_ms / 1e3, b=2 * args.block_ms / 1e3, lr=0.05, seed=3)
    # gain: deep stacks well-conditioned, exactness stays checkable at 1e-10 (emulated_model)
    cfg.update(gain=min(1.0, 16 / blocks), warmup=args.warmup, steps=args.steps, quiet_wait=args.quiet_wait)
    cases, skipped = cases_for(p, blocks, args.multipliers)
    reference = reference_weights(cfg)
    t = time.monotonic()
    ranks = run_distributed(_job, p, cfg, cases, reference, timeout=args.timeout, threads=1)
    zero, link = ranks[0], {k: ranks[0]["link"][k] for k in ("latency", "bandwidth")}
    res = dict(p=p, config=cfg, rows=[], skipped=skipped, link=link, messages=zero["messages"].to_dict())
    res.update(foreign_load=max(r["foreign"] for r in ranks), own_cpus=zero["own_cpu"], timer_slack_1us=zero["slack"],
               wall_s=time.monotonic() - t)  # fmt: skip
    for i, case in enumerate(cases):
        runs = [r["cases"][i] for r in ranks]  # this case on every rank
        its = [max(run["spans"][s][1] for run in runs) - t0 for s, (t0, _) in enumerate(runs[0]["spans"])]
        extra, diff = [e for run in runs for e in run["extra"]], max(run["diff"] for run in runs)
        row = dict(case, measured=statistics.median(its), measured_all=its, max_rel_diff=diff, exact=diff <= 1e-10)
        row["extra_per_compute"] = sum(e for e, _ in extra) / max(sum(n for _, n in extra), 1)
        res["rows"].append(dict(row, **{key: simulated(case, costs_for(res, case["m"], key)) for key in KEYS}))
    head = f"{blocks} blocks, {cfg['f'] * 1e3:g} / {cfg['b'] * 1e3:g} ms; link {link['latency'] * 1e6:.0f} us; other processes {res['foreign_load']:.2f} CPUs"
    bench.table(column_table(COLUMNS, res["rows"], "l" * len(COLUMNS)), f"\n#### P = {p} EMULATED ranks ({head})")
    for s in skipped:
        bench.say(f"m = {s['m']} {s['label']}: skipped ({s['reason']})")
    return res


def by_m(res: dict) -> list[tuple[int, list[dict]]]:
    """A depth's exact rows per m (an inexact case is excluded from every comparison)."""
    return [(m, [r for r in res["rows"] if r["m"] == m and r["exact"]]) for m in sorted({r["m"] for r in res["rows"]})]


COLUMNS = (
    ("m", lambda r: r["m"]), ("schedule", lambda r: r["label"]), ("chunks", lambda r: r["chunks"]),
    ("measured ms", lambda r: ms(r["measured"])), ("simulated ms", lambda r: ms(r["simulated"])),
    ("meas / sim", lambda r: f"{r['measured'] / r['simulated']:.3f}"), ("sim + msgs ms", lambda r: ms(r["simulated_msgs"])),
    ("meas / (sim + msgs)", lambda r: f"{r['measured'] / r['simulated_msgs']:.3f}"),
    ("extra per compute us", lambda r: f"{r['extra_per_compute'] * 1e6:.0f}"),
    ("exact", lambda r: f"{'yes' if r['exact'] else 'NO'} ({r['max_rel_diff']:.0e})"),
)  # fmt: skip


def auto_check(res: dict, key: str) -> list[dict]:
    """schedule="auto"'s pick among the schedules run, vs the measured fastest, per m."""
    found = []
    for m, rows in by_m(res):
        choice = choose_schedule(costs_for(res, m, key), res["p"], m, candidates=[(r["schedule"], r["options"]) for r in rows])
        pick = next(r for r in rows if r["schedule"] == choice.chosen.schedule and r["options"] == choice.chosen.schedule_options)
        fastest = min(rows, key=lambda r: r["measured"])
        same_cut = [tuple(b) for b in choice.chosen.plan.bounds] == uniform_bounds(res["config"]["blocks"], pick["chunks"])
        found.append(dict(p=res["p"], m=m, model=key, pick=pick["label"], pick_measured=pick["measured"], fastest=fastest["label"],
                          fastest_measured=fastest["measured"], gap=pick["measured"] / fastest["measured"] - 1, same_partition_as_run=same_cut))  # fmt: skip
    return found


def wave_shares(res: dict, key: str) -> list[dict]:
    """Wave's measured speed-up over 1F1B as a share of the simulated one, per m and wave variant."""
    found = []
    for m, rows in by_m(res):
        one = next((r for r in rows if r["label"] == "1f1b"), None)
        for r in (r for r in rows if one and r["schedule"] in ("wave", "hanayo")):
            meas, sim = one["measured"] / r["measured"] - 1, one[key] / r[key] - 1
            found.append(dict(p=res["p"], m=m, schedule=r["label"], model=key, measured_speedup=meas, simulated_speedup=sim,
                              share=meas / sim if sim > 1e-9 else None))  # fmt: skip
    return found


def errors(rows: list[dict], key: str) -> dict:
    """|measured / simulated - 1| of the exact rows: median, max, how many within 5%."""
    errs = [abs(r["measured"] / r[key] - 1) for r in rows if r["exact"]]
    return dict(within_5pct=sum(e <= 0.05 for e in errs), cases=len(errs), median_abs_error=statistics.median(errs) if errs else math.nan,
                max_abs_error=max(errs, default=math.nan))  # fmt: skip


def summary(results: list[dict]) -> dict:
    rho = lambda rows, key: spearman([r["measured"] for r in rows], [r[key] for r in rows]) if len(rows) > 1 else math.nan  # noqa: E731
    out: dict = {}
    mid = [res for res in results if res["p"] in (4, 8)]  # where auto and wave are checked
    for key in KEYS:
        out[key] = errors([r for res in results for r in res["rows"]], key)
        # a depth with every case inexact: listed under "inexact", nothing to compare
        out[key]["per_p"] = {res["p"]: errors(res["rows"], key) for res in results if any(r["exact"] for r in res["rows"])}
        out[key]["spearman"] = [{"p": res["p"], "m": m, "rho": rho(rows, key)} for res in results for m, rows in by_m(res)]
        out[key].update(auto=[a for res in mid for a in auto_check(res, key)], wave_share=[w for res in mid for w in wave_shares(res, key)])
    out["inexact"] = [f"P={r['p']} m={r['m']} {r['label']}: {r['max_rel_diff']:.1e}"
                      for res in results for r in res["rows"] if not r["exact"]]  # fmt: skip
    return out


def print_summary(bench: Bench, s: dict) -> None:
    line = lambda d: f"|error| median {d['median_abs_error']:.1%}, max {d['max_abs_error']:.1%}, within 5%: {d['within_5pct']}/{d['cases']}"  # noqa: E731
    for key in KEYS:
        v = s[key]
        bench.say(f"\n== targets, {'plain CostModel' if key == 'simulated' else 'CostModel with message costs'} (EMULATED devices) ==")
        bench.say("measured vs simulated, all P: " + line(v))
        for p, d in v["per_p"].items():
            bench.say(f"  P={p}: " + line(d))
        bench.say("Spearman per (P, m): " + ", ".join(f"{r['p']}/{r['m']}: {r['rho']:+.2f}" for r in v["spearman"]))
        for a in v["auto"]:
            cut = "" if a["same_partition_as_run"] else " (auto planned another partition than the run's uniform one)"
            bench.say(f"auto P={a['p']} m={a['m']}: pick {a['pick']} ({ms(a['pick_measured'])} ms), measured fastest {a['fastest']} "
                      f"({ms(a['fastest_measured'])} ms): gap {a['gap']:+.1%}{cut}")  # fmt: skip
        for w in v["wave_share"]:
            share = "n/a (no simulated gain)" if w["share"] is None else f"{w['share']:.0%}"
            bench.say(f"wave share P={w['p']} m={w['m']} {w['schedule']}: measured {w['measured_speedup']:+.1%}, simulated "
                      f"{w['simulated_speedup']:+.1%} over 1F1B: {share}")  # fmt: skip
    if s["inexact"]:
        bench.say("NOT EXACT (excluded): " + "; ".join(s["inexact"]))


def main() -> None:
    bench = Bench(__doc__, dict(ranks=[2], multipliers=[1]), threads=1, steps=4, warmup=1, quiet_wait=30.0, timeout=900.0)
    bench.parser.add_argument("--ranks", nargs="+", type=int, default=[2, 4, 8, 16])
    bench.parser.add_argument("--multipliers", nargs="+", type=int, default=[1, 2, 4], help="m = k x P for each k")
    bench.options(block_ms=(1.5, "forward ms per block (backward: twice)"), blocks_per_rank=8, width=16, rows=(64, "batch rows"))
    args = bench.parse()
    results = [run_depth(bench, p, args) for p in args.ranks]  # each printed as it ends
    s = summary(results)
    print_summary(bench, s)
    bench.keep("depths", results)
    bench.keep("summary", s)
    bench.finish()


if __name__ == "__main__":
    main()
