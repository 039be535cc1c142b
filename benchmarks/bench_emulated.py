"""Depth on EMULATED devices: every schedule at P = 2..16 ranks, measured against the simulator.

Each block is a PacedBlock (lightning_pipe.bench.emulated: it sleeps its time around a float64
Linear), everything else the real runtime over gloo, one process per rank, 8 blocks per rank. Per
(P, m, schedule): the median iteration, the simulator's ("plain", and with measure_messages' terms),
extra time per compute, exactness against one process; then the targets (within 5%, Spearman,
schedule="auto"'s pick, wave's share of its simulated gain). Feeds docs/emulated.md (all tables) and
docs/predictions.md (the summary); method there.

    flock /tmp/bench.lock python benchmarks/bench_emulated.py --json docs/emulated_results.json --markdown <file>
    python benchmarks/bench_emulated.py --quick     # smoke: P = 2, m = P, 2 steps
"""

from __future__ import annotations

import gc
import math
import statistics
import time

from lightning_pipe.bench.harness import Bench, Table, pin_threads

pin_threads(1)

import torch  # noqa: E402

from lightning_pipe.planning.auto import CANDIDATES  # noqa: E402

VARIANTS: tuple[tuple[str, dict[str, int]], ...] = (("gpipe", {}),) + CANDIDATES  # what auto weighs, and GPipe


def label(name: str, options: dict[str, int]) -> str:
    return name + "".join(f" {'v' if k == 'chunks' else 'W'}={v}" for k, v in sorted(options.items()))


def uniform_bounds(blocks: int, chunks: int) -> list[tuple[int, int]]:
    from lightning_pipe.planning import partition_blocks

    return [tuple(b) for b in partition_blocks("uniform", blocks, chunks).bounds]


def cases_for(p: int, blocks: int, multipliers: list[int], variants=VARIANTS) -> tuple[list[dict], list[dict]]:
    """The cases that run at depth p, and the skipped ones with the schedule's reason."""
    from lightning_pipe.errors import SettingError
    from lightning_pipe.schedules import ScheduleSpec

    run, skipped = [], []
    for k in multipliers:
        m = k * p
        for name, options in variants:
            case = {"p": p, "m": m, "schedule": name, "options": dict(options), "label": label(name, options)}
            try:
                spec = ScheduleSpec.of(name, **options)
                spec.check(p, blocks)
                spec.build(p, m)
            except (SettingError, ValueError) as err:
                skipped.append({**case, "reason": str(err)})
                continue
            run.append(case)
    return run, skipped


# ---- one process group per depth -------------------------------------------------------------------
def _data(rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(rows, width, generator=g, dtype=torch.float64)
    return x, torch.tanh(x.flip(1))


def reference_weights(cfg: dict) -> dict[str, torch.Tensor]:
    """One process, the same model (no sleeps), data, loss and SGD steps as every case."""
    import torch.nn.functional as F

    from lightning_pipe.bench.emulated import emulated_model

    model = emulated_model(cfg["blocks"], cfg["width"], 0.0, 0.0, seed=cfg["seed"], gain=cfg["gain"])
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
    x, y = _data(cfg["rows"], cfg["width"])
    for _ in range(cfg["warmup"] + cfg["steps"]):
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _job(rank: int, world: int, cfg: dict, cases: list[dict], reference: dict[str, torch.Tensor]) -> dict:
    import torch.distributed as dist
    import torch.nn.functional as F

    from lightning_pipe.bench.emulated import emulated_model, fine_timer_slack
    from lightning_pipe.bench.launch import CpuClock, foreign_load, wait_for_quiet
    from lightning_pipe.profiling.link import ping_pong
    from lightning_pipe.profiling.messages import measure_messages
    from lightning_pipe.runtime.p2p import Transport
    from lightning_pipe.runtime.sequential import SequentialHost, SequentialPipeline
    from lightning_pipe.schedules import Op, build_schedule

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
        chunks = {c: model[bounds[c][0] : bounds[c][1]] for c in schedule.chunks_of(rank)}
        host = SequentialHost(chunks, schedule.num_chunks - 1, F.mse_loss)
        pipe = SequentialPipeline(schedule, rank, host, transport)
        params = [q for c in chunks.values() for q in c.parameters()]
        opt = torch.optim.SGD(params, lr=cfg["lr"])
        spans, compute = [], []
        gc.collect()
        for step in range(cfg["warmup"] + cfg["steps"]):
            opt.zero_grad(set_to_none=True)
            timed = step >= cfg["warmup"]
            pipe.executor.trace = timed
            dist.barrier()
            t0 = time.perf_counter()
            pipe.step(x, y)
            t1 = time.perf_counter()
            opt.step()
            if timed:
                spans.append((t0, t1))
                # how long each compute occupied the rank beyond its emulated time (sleep overshoot,
                # the Linear, autograd, the executor's work around it)
                acts = pipe.executor.actions
                extra = [
                    (e - s) - (cfg["f"] if acts[i].op is Op.FORWARD else cfg["b"]) * (bounds[acts[i].chunk][1] - bounds[acts[i].chunk][0])
                    for i, s, e in pipe.executor.records
                    if acts[i].op.is_compute
                ]
                compute.append((sum(extra), len(extra)))
        pipe.executor.trace = False
        mine = {k: v for k, v in model.state_dict().items() if any(a <= int(k.split(".")[0]) < b for a, b in (bounds[c] for c in chunks))}
        diff = max(((v - reference[k]).abs().max() / reference[k].abs().max().clamp(min=1e-30)).item() for k, v in mine.items())
        out.append({"spans": spans, "diff": diff, "extra": compute})
    end = CpuClock.now()
    own = [None] * world
    dist.all_gather_object(own, end.own - start.own)
    return {
        "cases": out,
        "link": link,
        "messages": msgs,
        "slack": slack,
        "foreign": foreign_load(start, end, own=sum(own)),
        "own_cpu": sum(own) / max(end.wall - start.wall, 1e-9),
    }


# ---- predictions, tables ----------------------------------------------------------------------------
def costs_for(cfg: dict, m: int, link: dict | None):
    from lightning_pipe.simulation import CostModel

    act, (latency, bandwidth) = cfg["rows"] // m * cfg["width"] * 8.0, (link["latency"], link["bandwidth"]) if link else (0.0, math.inf)
    return CostModel.uniform(
        cfg["blocks"], cfg["f"], cfg["b"], activation_bytes=(act,) * cfg["blocks"], latency=latency, bandwidth=bandwidth
    )


def simulated(case: dict, costs, blocks: int) -> float:
    from lightning_pipe.schedules import build_schedule
    from lightning_pipe.simulation import simulate

    schedule = build_schedule(case["schedule"], case["p"], case["m"], **case["options"])
    return simulate(schedule, costs, uniform_bounds(blocks, schedule.num_chunks), critical_path=False).iteration_time


def run_depth(bench: Bench, p: int, args, multipliers: list[int]) -> dict:
    from lightning_pipe.bench.launch import run_distributed

    blocks = args.blocks_per_rank * p
    cfg = dict(blocks=blocks, width=args.width, rows=args.rows, f=args.block_ms / 1e3, b=2 * args.block_ms / 1e3, lr=0.05, seed=3)
    # gain: deep stacks well-conditioned, exactness stays checkable at 1e-10 (emulated_model)
    cfg.update(gain=min(1.0, 16 / blocks), warmup=args.warmup, steps=args.steps, quiet_wait=args.quiet_wait)
    cases, skipped = cases_for(p, blocks, multipliers)
    for s in skipped:
        bench.log(f"  P={p} m={s['m']} {s['label']}: skipped: {s['reason']}")
    reference = reference_weights(cfg)
    t = time.monotonic()
    ranks = run_distributed(_job, p, cfg, cases, reference, timeout=args.timeout, threads=1)
    wall = time.monotonic() - t
    zero, rows = ranks[0], []
    link, msgs = zero["link"], zero["messages"]
    for i, case in enumerate(cases):
        steps = len(zero["cases"][i]["spans"])
        its = [max(r["cases"][i]["spans"][s][1] for r in ranks) - zero["cases"][i]["spans"][s][0] for s in range(steps)]
        diff = max(r["cases"][i]["diff"] for r in ranks)
        extra = sum(r["cases"][i]["extra"][s][0] for r in ranks for s in range(steps))
        count = sum(r["cases"][i]["extra"][s][1] for r in ranks for s in range(steps))
        costs = costs_for(cfg, case["m"], link)
        row = dict(case, chunks=_chunks(case), measured=statistics.median(its), measured_all=its, simulated=simulated(case, costs, blocks))
        row.update(max_rel_diff=diff, exact=diff <= 1e-10, extra_per_compute=extra / max(count, 1))
        rows.append(dict(row, simulated_msgs=simulated(case, msgs.apply(costs), blocks)))
    link = {"latency": link["latency"], "bandwidth": link["bandwidth"]} if link else None
    out = dict(p=p, config=cfg, rows=rows, skipped=skipped, link=link, messages=msgs.to_dict())
    return dict(out, foreign_load=max(r["foreign"] for r in ranks), own_cpus=zero["own_cpu"], timer_slack_1us=zero["slack"], wall_s=wall)


def _chunks(case: dict) -> int:
    from lightning_pipe.schedules import ScheduleSpec

    return ScheduleSpec.of(case["schedule"], **case["options"]).chunk_count(case["p"])


def print_depth(bench: Bench, res: dict) -> None:
    from lightning_pipe.profiling.messages import MessageCosts

    p, cfg, link = res["p"], res["config"], res["link"]
    msgs = MessageCosts.from_dict(res["messages"])
    bench.log(f"P = {p}: ours {res['own_cpus']:.2f} CPUs, {res['wall_s']:.0f} s; message costs (sleeping {msgs.think * 1e3:g} ms per hop): "
              f"{msgs.summary()}; hand-off delay {msgs.handoff_delay(costs_for(cfg, 2 * p, link)) * 1e6:.0f} us")  # fmt: skip
    t = Table(
        "m", "schedule", "chunks", "measured ms", "simulated ms", "meas / sim", "sim + msgs ms", "meas / (sim + msgs)", "extra per compute us",
        "exact", align="l" * 10,
    )  # fmt: skip
    for r in res["rows"]:
        t.add(
            r["m"], r["label"], r["chunks"], f"{r['measured'] * 1e3:.1f}", f"{r['simulated'] * 1e3:.1f}", f"{r['measured'] / r['simulated']:.3f}",
            f"{r['simulated_msgs'] * 1e3:.1f}", f"{r['measured'] / r['simulated_msgs']:.3f}", f"{r['extra_per_compute'] * 1e6:.0f}",
            f"{'yes' if r['exact'] else 'NO'} ({r['max_rel_diff']:.0e})",
        )  # fmt: skip
    title = (
        f"\n#### P = {p} EMULATED ranks ({cfg['blocks']} blocks, {cfg['f'] * 1e3:g} / {cfg['b'] * 1e3:g} ms; link "
        f"{link['latency'] * 1e6:.0f} us; other processes {res['foreign_load']:.2f} CPUs)"
    )
    bench.table(t, title)
    for s in res["skipped"]:
        bench.say(f"m = {s['m']} {s['label']}: skipped ({s['reason']})")
    for m in sorted({r["m"] for r in res["rows"]}):
        sub = [r for r in res["rows"] if r["m"] == m and r["exact"]]
        bench.log(
            f"  P={p} m={m}: Spearman measured vs simulated {correlation(sub, 'simulated'):+.3f}, vs simulated+msgs {correlation(sub, 'simulated_msgs'):+.3f}"
        )


def correlation(rows: list[dict], key: str) -> float:
    from lightning_pipe.bench.stats import spearman

    return spearman([r["measured"] for r in rows], [r[key] for r in rows]) if len(rows) > 1 else math.nan


# ---- the targets -------------------------------------------------------------------------------------
def auto_check(res: dict, key: str) -> list[dict]:
    """schedule="auto"'s pick among the schedules run, vs the measured fastest, per m."""
    from lightning_pipe.planning.auto import choose_schedule

    p, cfg = res["p"], res["config"]
    found = []
    for m in sorted({r["m"] for r in res["rows"]}):
        rows = [r for r in res["rows"] if r["m"] == m and r["exact"]]
        costs = costs_for(cfg, m, res["link"])
        if key == "simulated_msgs":
            from lightning_pipe.profiling.messages import MessageCosts

            costs = MessageCosts.from_dict(res["messages"]).apply(costs)
        choice = choose_schedule(costs, p, m, candidates=[(r["schedule"], r["options"]) for r in rows])
        chosen = next(r for r in rows if r["schedule"] == choice.chosen.schedule and r["options"] == choice.chosen.schedule_options)
        same_cut = [tuple(b) for b in choice.chosen.plan.bounds] == uniform_bounds(cfg["blocks"], chosen["chunks"])
        fastest = min(rows, key=lambda r: r["measured"])
        found.append(dict(p=p, m=m, model=key, pick=chosen["label"], pick_measured=chosen["measured"]))
        found[-1].update(fastest=fastest["label"], fastest_measured=fastest["measured"], gap=chosen["measured"] / fastest["measured"] - 1)
        found[-1]["same_partition_as_run"] = same_cut
    return found


def wave_shares(res: dict, key: str) -> list[dict]:
    """Wave's measured speed-up over 1F1B as a share of the simulated one, per m and wave variant."""
    found = []
    for m in sorted({r["m"] for r in res["rows"]}):
        rows = {r["label"]: r for r in res["rows"] if r["m"] == m and r["exact"]}
        one = rows.get("1f1b")
        if one is None:
            continue
        for lab, r in rows.items():
            if r["schedule"] not in ("wave", "hanayo"):
                continue
            meas, sim = one["measured"] / r["measured"] - 1, one[key] / r[key] - 1
            found.append(dict(p=res["p"], m=m, schedule=lab, model=key, measured_speedup=meas, simulated_speedup=sim))
            found[-1]["share"] = meas / sim if sim > 1e-9 else None
    return found


def summary(results: list[dict]) -> dict:
    out: dict = {}
    for key in ("simulated", "simulated_msgs"):
        rows = [r for res in results for r in res["rows"] if r["exact"]]
        errors = [r["measured"] / r[key] - 1 for r in rows]
        within = sum(abs(e) <= 0.05 for e in errors)
        rhos = []
        for res in results:
            for m in sorted({r["m"] for r in res["rows"]}):
                sub = [r for r in res["rows"] if r["m"] == m and r["exact"]]
                rhos.append({"p": res["p"], "m": m, "rho": correlation(sub, key)})
        per_p = {}
        for res in results:
            errs = [r["measured"] / r[key] - 1 for r in res["rows"] if r["exact"]]
            if not errs:  # every case of this depth inexact: listed under "inexact", nothing to compare
                continue
            per_p[res["p"]] = {"median_abs_error": statistics.median(abs(e) for e in errs), "max_abs_error": max(abs(e) for e in errs)}
            per_p[res["p"]].update(within_5pct=sum(abs(e) <= 0.05 for e in errs), cases=len(errs))
        autos = [a for res in results if res["p"] in (4, 8) for a in auto_check(res, key)]
        waves = [w for res in results if res["p"] in (4, 8) for w in wave_shares(res, key)]
        median = statistics.median(abs(e) for e in errors) if errors else math.nan
        out[key] = dict(within_5pct=within, cases=len(errors), median_abs_error=median)
        out[key].update(
            max_abs_error=max((abs(e) for e in errors), default=math.nan), per_p=per_p, spearman=rhos, auto=autos, wave_share=waves
        )
    out["inexact"] = [
        f"P={r['p']} m={r['m']} {r['label']}: {r['max_rel_diff']:.1e}" for res in results for r in res["rows"] if not r["exact"]
    ]
    return out


def print_summary(bench: Bench, s: dict) -> None:
    for key, v in s.items():
        if key == "inexact":
            continue
        bench.say(f"\n== targets, {'plain CostModel' if key == 'simulated' else 'CostModel with message costs'} (EMULATED devices) ==")
        bench.say(
            f"measured vs simulated within 5%: {v['within_5pct']} of {v['cases']} cases; |error| median {v['median_abs_error']:.1%}, "
            f"max {v['max_abs_error']:.1%}"
        )
        for p, d in v["per_p"].items():
            bench.say(
                f"  P={p}: |error| median {d['median_abs_error']:.1%}, max {d['max_abs_error']:.1%}, within 5%: {d['within_5pct']}/{d['cases']}"
            )
        bench.say("Spearman per (P, m): " + ", ".join(f"{r['p']}/{r['m']}: {r['rho']:+.2f}" for r in v["spearman"]))
        for a in v["auto"]:
            cut = "" if a["same_partition_as_run"] else " (auto planned another partition than the run's uniform one)"
            bench.say(
                f"auto P={a['p']} m={a['m']}: pick {a['pick']} ({a['pick_measured'] * 1e3:.1f} ms), measured fastest {a['fastest']} "
                f"({a['fastest_measured'] * 1e3:.1f} ms): gap {a['gap']:+.1%}{cut}"
            )
        for w in v["wave_share"]:
            share = "n/a (no simulated gain)" if w["share"] is None else f"{w['share']:.0%}"
            bench.say(
                f"wave share P={w['p']} m={w['m']} {w['schedule']}: measured {w['measured_speedup']:+.1%}, simulated "
                f"{w['simulated_speedup']:+.1%} over 1F1B: {share}"
            )
    if s["inexact"]:
        bench.say("NOT EXACT (excluded): " + "; ".join(s["inexact"]))


def main() -> None:
    bench = Bench(__doc__, dict(ranks=[2], multipliers=[1]), steps=4, warmup=1, quiet_wait=30.0, timeout=900.0)
    p = bench.parser
    p.add_argument("--ranks", nargs="+", type=int, default=[2, 4, 8, 16])
    p.add_argument("--multipliers", nargs="+", type=int, default=[1, 2, 4], help="m = k x P for each k")
    p.add_argument("--block-ms", type=float, default=1.5, help="forward ms per block (backward: twice)")
    p.add_argument("--blocks-per-rank", type=int, default=8)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--rows", type=int, default=64, help="batch rows (split into m micro-batches)")
    args = bench.parse()
    results = []
    for p in args.ranks:
        results.append(run_depth(bench, p, args, args.multipliers))
        print_depth(bench, results[-1])
    s = summary(results)
    print_summary(bench, s)
    bench.keep("depths", results)
    bench.keep("summary", s)
    bench.finish()


if __name__ == "__main__":
    main()
