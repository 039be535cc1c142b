"""Depth on EMULATED devices: every schedule at P = 2..16 ranks, measured against the simulator.

    flock /tmp/bench.lock python benchmarks/bench_emulated.py            # ~17 min
    flock /tmp/bench.lock python benchmarks/bench_emulated.py --quick    # P = 2, 4, ~2 min

A 2-core machine cannot run 16 ranks of real compute, so every block here is an EMULATED device
(lightning_pipe.bench.emulated.EmulatedBlock): it sleeps for its forward / backward time, as a GPU
leaves its host idle, around a small float64 Linear that keeps the arithmetic real. Everything
else is the real runtime: SequentialPipeline / Executor / Transport over gloo p2p, one process and
one thread per rank, the schedules from build_schedule. One process group per P runs every case.

The model: 8 blocks per rank (8P blocks, so wave W = 4's 2PW chunks hold one block each), each
--block-ms forward and twice that backward. A rank's stage is 8 blocks at every P (weak scaling), so
the finest cut (wave W = 4: one block per chunk) is the same at every depth.

Cases: GPipe, 1F1B, interleaved v = 2, 4, wave W = 1, 2, 4 in our greedy order ("wave") and in
Hanayo's ("hanayo"), m = P, 2P, 4P micro-batches of a fixed batch (--rows). A combination the
schedule rejects is skipped with its reason. Each case: --warmup untimed steps, then --steps timed
ones, each after a barrier; iteration = the last rank's end of the step minus rank 0's start (one
machine-wide monotonic clock); the median is reported. SGD steps between (not timed). Each case's
final weights are compared with one process training the same model on the same data (float64):
a run that is not exact is flagged and never counted.

Predictions (lightning_pipe.simulation.simulate on the very schedule and the uniform partition the
run used): "plain" = the blocks' emulated times and the link of a ping-pong (latency + bytes /
bandwidth); "msgs" = the same with the message terms of lightning_pipe.profiling.messages.measure_messages
(send / receive overhead on the rank's thread, hand-off delay), measured in the same process group,
when that module exists. Printed: measured / simulated, Spearman's rank correlation across the
schedules per (P, m), schedule="auto"'s pick (P = 4, 8) vs the measured fastest, and wave's
measured speed-up over 1F1B as a share of the simulated one. Raw results: --json.

Timing hygiene: run under flock /tmp/bench.lock; each process group waits for a quiet machine
first and reports the CPUs other processes used while it ran (lightning_pipe.bench.launch).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

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


def _message_costs(world: int, nbytes: int, think: float):
    """lightning_pipe.profiling.messages.measure_messages on these ranks (the chain 0..P-1, messages of one
    boundary's size, sleeping `think` s per hop as an emulated rank does), if that module exists."""
    try:
        from lightning_pipe.profiling.messages import measure_messages
    except ImportError:
        return None
    return measure_messages(list(range(world)), nbytes, torch.device("cpu"), think=think, sleep=True)


def _job(rank: int, world: int, cfg: dict, cases: list[dict], reference: dict[str, torch.Tensor]) -> dict:
    import torch.distributed as dist
    import torch.nn.functional as F

    from lightning_pipe.bench.emulated import emulated_model, fine_timer_slack
    from lightning_pipe.bench.launch import CpuClock, foreign_load, wait_for_quiet
    from lightning_pipe.profiling.link import ping_pong
    from lightning_pipe.runtime.p2p import Transport
    from lightning_pipe.runtime.sequential import SequentialHost, SequentialPipeline
    from lightning_pipe.schedules import Op, build_schedule

    slack = fine_timer_slack() if cfg["timer_slack"] else False
    if rank == 0:
        wait_for_quiet(cfg["quiet_wait"], 0.15, poll=5.0, log=lambda s: print(s, flush=True))
    dist.barrier()
    start = CpuClock.now()
    act_bytes = cfg["rows"] // (2 * world) * cfg["width"] * 8  # a boundary's message at m = 2P
    link = ping_pong(rank, sizes=(8, act_bytes, 1 << 16), repeats=40, warmup=5)
    msgs = _message_costs(world, act_bytes, cfg["f"]) if cfg["messages"] else None
    transport = Transport(lambda r: r, torch.device("cpu"))
    x, y = _data(cfg["rows"], cfg["width"])
    out = []
    for case in cases:
        schedule = build_schedule(case["schedule"], world, case["m"], **case["options"])
        bounds = uniform_bounds(cfg["blocks"], schedule.num_chunks)
        model = emulated_model(cfg["blocks"], cfg["width"], cfg["f"], cfg["b"], seed=cfg["seed"], paced=cfg["paced"], gain=cfg["gain"])
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

    act = cfg["rows"] // m * cfg["width"] * 8.0
    return CostModel.uniform(
        cfg["blocks"],
        cfg["f"],
        cfg["b"],
        activation_bytes=(act,) * cfg["blocks"],
        latency=link["latency"] if link else 0.0,
        bandwidth=link["bandwidth"] if link else math.inf,
    )


def simulated(case: dict, costs, blocks: int) -> float:
    from lightning_pipe.schedules import build_schedule
    from lightning_pipe.simulation import simulate

    schedule = build_schedule(case["schedule"], case["p"], case["m"], **case["options"])
    return simulate(schedule, costs, uniform_bounds(blocks, schedule.num_chunks), critical_path=False).iteration_time


def run_depth(p: int, args, multipliers: list[int]) -> dict:
    from lightning_pipe.bench.launch import run_distributed

    blocks = args.blocks_per_rank * p
    cfg = {
        "blocks": blocks,
        "width": args.width,
        "rows": args.rows,
        "f": args.block_ms / 1e3,
        "b": 2 * args.block_ms / 1e3,
        "lr": 0.05,
        "seed": 3,
        "gain": min(1.0, 16 / blocks),  # deep stacks well-conditioned: exactness stays checkable at 1e-10 (emulated_model)
        "warmup": args.warmup,
        "steps": args.steps,
        "timer_slack": not args.default_slack,
        "messages": not args.no_messages,
        "quiet_wait": args.quiet_wait,
        "paced": args.block == "paced",
    }
    cases, skipped = cases_for(p, blocks, multipliers)
    for s in skipped:
        print(f"  P={p} m={s['m']} {s['label']}: skipped: {s['reason']}", flush=True)
    reference = reference_weights(cfg)
    t = time.monotonic()
    ranks = run_distributed(_job, p, cfg, cases, reference, timeout=args.timeout, threads=1)
    wall = time.monotonic() - t
    zero = ranks[0]
    link = zero["link"]
    msgs = zero["messages"]
    rows = []
    for i, case in enumerate(cases):
        steps = len(zero["cases"][i]["spans"])
        its = [max(r["cases"][i]["spans"][s][1] for r in ranks) - zero["cases"][i]["spans"][s][0] for s in range(steps)]
        diff = max(r["cases"][i]["diff"] for r in ranks)
        extra = sum(r["cases"][i]["extra"][s][0] for r in ranks for s in range(steps))
        count = sum(r["cases"][i]["extra"][s][1] for r in ranks for s in range(steps))
        costs = costs_for(cfg, case["m"], link)
        row = {
            **case,
            "chunks": _chunks(case),
            "measured": statistics.median(its),
            "measured_all": its,
            "simulated": simulated(case, costs, blocks),
            "max_rel_diff": diff,
            "exact": diff <= 1e-10,
            "extra_per_compute": extra / max(count, 1),
        }
        if msgs is not None:
            row["simulated_msgs"] = simulated(case, msgs.apply(costs), blocks)
        rows.append(row)
    return {
        "p": p,
        "config": cfg,
        "rows": rows,
        "skipped": skipped,
        "link": {"latency": link["latency"], "bandwidth": link["bandwidth"]} if link else None,
        "messages": _messages_dict(msgs),
        "foreign_load": max(r["foreign"] for r in ranks),
        "own_cpus": zero["own_cpu"],
        "timer_slack_1us": zero["slack"],
        "wall_s": wall,
    }


def _chunks(case: dict) -> int:
    from lightning_pipe.schedules import ScheduleSpec

    return ScheduleSpec.of(case["schedule"], **case["options"]).chunk_count(case["p"])


def _messages_dict(msgs) -> dict | None:
    if msgs is None:
        return None
    return msgs.to_dict()


def print_depth(res: dict) -> None:
    p, cfg = res["p"], res["config"]
    link = res["link"]
    print(
        f"\nP = {p} EMULATED ranks: {cfg['blocks']} blocks of f = {cfg['f'] * 1e3:g} ms, b = {cfg['b'] * 1e3:g} ms "
        f"({cfg['blocks'] // p} per rank); link {link['latency'] * 1e6:.0f} us, {link['bandwidth'] / 1e9:.2f} GB/s; "
        f"other processes used {res['foreign_load']:.2f} CPUs, ours {res['own_cpus']:.2f}; {res['wall_s']:.0f} s",
        flush=True,
    )
    if res["messages"]:
        from lightning_pipe.profiling.messages import MessageCosts

        msgs = MessageCosts.from_dict(res["messages"])
        delay = msgs.handoff_delay(costs_for(cfg, 2 * p, link))
        print(
            f"  message costs (measure_messages, sleeping {msgs.think * 1e3:g} ms per hop): {msgs.summary()}; hand-off delay {delay * 1e6:.0f} us"
        )
    has_msgs = any("simulated_msgs" in r for r in res["rows"])
    head = f"  {'m':>3} {'schedule':<13} {'chunks':>6} {'measured ms':>12} {'sim ms':>9} {'meas/sim':>9}"
    head += f" {'sim+msgs':>9} {'meas/sim+m':>10}" if has_msgs else ""
    print(head + f" {'extra/compute us':>16} {'exact':>6}")
    for r in res["rows"]:
        line = f"  {r['m']:>3} {r['label']:<13} {r['chunks']:>6} {r['measured'] * 1e3:>12.1f} {r['simulated'] * 1e3:>9.1f} {r['measured'] / r['simulated']:>9.3f}"
        if has_msgs:
            line += f" {r['simulated_msgs'] * 1e3:>9.1f} {r['measured'] / r['simulated_msgs']:>10.3f}"
        print(line + f" {r['extra_per_compute'] * 1e6:>16.0f} {'yes' if r['exact'] else 'NO ' + format(r['max_rel_diff'], '.1e'):>6}")
    for m in sorted({r["m"] for r in res["rows"]}):
        sub = [r for r in res["rows"] if r["m"] == m and r["exact"]]
        rho = correlation(sub, "simulated")
        text = f"  P={p} m={m}: Spearman measured vs simulated {rho:+.3f}"
        if has_msgs:
            text += f", vs simulated+msgs {correlation(sub, 'simulated_msgs'):+.3f}"
        print(text)


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
        found.append(
            {
                "p": p,
                "m": m,
                "model": key,
                "pick": chosen["label"],
                "pick_measured": chosen["measured"],
                "fastest": fastest["label"],
                "fastest_measured": fastest["measured"],
                "gap": chosen["measured"] / fastest["measured"] - 1,
                "same_partition_as_run": same_cut,
            }
        )
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
            meas = one["measured"] / r["measured"] - 1
            sim = one[key] / r[key] - 1
            found.append(
                {
                    "p": res["p"],
                    "m": m,
                    "schedule": lab,
                    "model": key,
                    "measured_speedup": meas,
                    "simulated_speedup": sim,
                    "share": meas / sim if sim > 1e-9 else None,
                }
            )
    return found


def summary(results: list[dict]) -> dict:
    keys = ["simulated"] + (["simulated_msgs"] if any("simulated_msgs" in r for res in results for r in res["rows"]) else [])
    out: dict = {}
    for key in keys:
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
            per_p[res["p"]] = {
                "median_abs_error": statistics.median(abs(e) for e in errs),
                "max_abs_error": max(abs(e) for e in errs),
                "within_5pct": sum(abs(e) <= 0.05 for e in errs),
                "cases": len(errs),
            }
        autos = [a for res in results if res["p"] in (4, 8) for a in auto_check(res, key)]
        waves = [w for res in results if res["p"] in (4, 8) for w in wave_shares(res, key)]
        out[key] = {
            "within_5pct": within,
            "cases": len(errors),
            "median_abs_error": statistics.median(abs(e) for e in errors) if errors else math.nan,
            "max_abs_error": max((abs(e) for e in errors), default=math.nan),
            "per_p": per_p,
            "spearman": rhos,
            "auto": autos,
            "wave_share": waves,
        }
    out["inexact"] = [
        f"P={r['p']} m={r['m']} {r['label']}: {r['max_rel_diff']:.1e}" for res in results for r in res["rows"] if not r["exact"]
    ]
    return out


def print_summary(s: dict) -> None:
    for key, v in s.items():
        if key == "inexact":
            continue
        name = "plain CostModel" if key == "simulated" else "CostModel with message costs"
        print(f"\n== targets, {name} (EMULATED devices) ==")
        print(
            f"measured vs simulated within 5%: {v['within_5pct']} of {v['cases']} cases; |error| median {v['median_abs_error']:.1%}, "
            f"max {v['max_abs_error']:.1%}"
        )
        for p, d in v["per_p"].items():
            print(
                f"  P={p}: |error| median {d['median_abs_error']:.1%}, max {d['max_abs_error']:.1%}, within 5%: {d['within_5pct']}/{d['cases']}"
            )
        print("Spearman per (P, m): " + ", ".join(f"{r['p']}/{r['m']}: {r['rho']:+.2f}" for r in v["spearman"]))
        for a in v["auto"]:
            cut = "" if a["same_partition_as_run"] else " (auto planned another partition than the run's uniform one)"
            print(
                f"auto P={a['p']} m={a['m']}: pick {a['pick']} ({a['pick_measured'] * 1e3:.1f} ms), measured fastest {a['fastest']} "
                f"({a['fastest_measured'] * 1e3:.1f} ms): gap {a['gap']:+.1%}{cut}"
            )
        for w in v["wave_share"]:
            share = "n/a (no simulated gain)" if w["share"] is None else f"{w['share']:.0%}"
            print(
                f"wave share P={w['p']} m={w['m']} {w['schedule']}: measured {w['measured_speedup']:+.1%}, simulated "
                f"{w['simulated_speedup']:+.1%} over 1F1B: {share}"
            )
    if s["inexact"]:
        print("NOT EXACT (excluded): " + "; ".join(s["inexact"]))


def markdown(results: list[dict]) -> str:
    """The per-depth tables as markdown (docs/emulated.md)."""
    out = []
    for res in results:
        cfg, link = res["config"], res["link"]
        has_msgs = any("simulated_msgs" in r for r in res["rows"])
        out.append(
            f"\n#### P = {res['p']} EMULATED ranks ({cfg['blocks']} blocks, {cfg['f'] * 1e3:g} / {cfg['b'] * 1e3:g} ms; link "
            f"{link['latency'] * 1e6:.0f} us; other processes {res['foreign_load']:.2f} CPUs)\n"
        )
        head = "| m | schedule | chunks | measured ms | simulated ms | meas / sim |"
        rule = "|---|---|---|---|---|---|"
        if has_msgs:
            head += " sim + msgs ms | meas / (sim + msgs) |"
            rule += "---|---|"
        out += [head + " extra per compute us | exact |", rule + "---|---|"]
        for r in res["rows"]:
            line = f"| {r['m']} | {r['label']} | {r['chunks']} | {r['measured'] * 1e3:.1f} | {r['simulated'] * 1e3:.1f} | {r['measured'] / r['simulated']:.3f} |"
            if has_msgs:
                line += f" {r['simulated_msgs'] * 1e3:.1f} | {r['measured'] / r['simulated_msgs']:.3f} |"
            out.append(line + f" {r['extra_per_compute'] * 1e6:.0f} | {'yes' if r['exact'] else 'NO'} ({r['max_rel_diff']:.0e}) |")
        for s in res["skipped"]:
            out.append(f"\nm = {s['m']} {s['label']}: skipped ({s['reason']})")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 4, 8, 16])
    parser.add_argument("--multipliers", nargs="+", type=int, default=[1, 2, 4], help="m = k x P for each k")
    parser.add_argument("--block-ms", type=float, default=1.5, help="forward ms per block (backward: twice)")
    parser.add_argument("--blocks-per-rank", type=int, default=8)
    parser.add_argument(
        "--block", choices=["paced", "sleep"], default="paced", help="PacedBlock (arithmetic inside the time) or EmulatedBlock"
    )
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--rows", type=int, default=64, help="batch rows (split into m micro-batches)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="P = 2, 4 and 3 timed steps")
    parser.add_argument("--default-slack", action="store_true", help="keep Linux's 50 us timer slack on sleeps")
    parser.add_argument("--no-messages", action="store_true", help="do not measure message costs")
    parser.add_argument("--quiet-wait", type=float, default=30.0, help="s to wait for a quiet machine per process group")
    parser.add_argument("--timeout", type=float, default=900.0, help="s per process group")
    parser.add_argument("--json", default=None, help="write the raw results here")
    parser.add_argument("--markdown", default=None, help="write the tables as markdown here")
    args = parser.parse_args()
    if args.quick:
        args.ranks, args.steps = [r for r in args.ranks if r <= 4], min(args.steps, 3)
    from lightning_pipe.bench import provenance

    print(f"bench_emulated (EMULATED devices): {provenance()}")
    print(f"command: {' '.join(['python'] + sys.argv)}")
    results = []
    for p in args.ranks:
        res = run_depth(p, args, args.multipliers)
        print_depth(res)
        results.append(res)
    s = summary(results)
    print_summary(s)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"provenance": provenance(), "command": " ".join(["python"] + sys.argv), "depths": results, "summary": s}, f, indent=1
            )
        print(f"raw results written to {args.json}")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(results))


if __name__ == "__main__":
    main()
