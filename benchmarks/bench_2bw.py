"""PipeDream-2BW vs PipeDream-Flush (1F1B) vs GPipe vs one process: samples/s, measured and simulated.

``real``: the residual MLP (lightning_pipe.bench.mlp) on 2 gloo processes at m = 2 and 8; ``emulated``:
d = 2, 4, 8 processes of sleeping stages at m = d, 4d. Per mode: samples/s, the simulator's step on the
profiled costs, weight updates against one process (2BW: against the 2BW rule), per-rank traces and
one step's timeline. Feeds docs/benchmarks_2bw.md (method and results there).

    python benchmarks/bench_2bw.py
    python benchmarks/bench_2bw.py --part emulated --depths 2,4 --tf 8
    python benchmarks/bench_2bw.py --quick                  # smoke: both parts, m = d = 2, 2 steps
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe.bench import pipes
from lightning_pipe.bench.harness import Bench, Table, ms
from lightning_pipe.bench.launch import timed_steps
from lightning_pipe.bench.mlp import loss_fn, make_data, make_model, single_job, summarize
from lightning_pipe.bench.pipes import Clock, equal_bounds, sleep_model
from lightning_pipe.layers import DoubleBuffer, Flush
from lightning_pipe.runtime.p2p import Transport
from lightning_pipe.runtime.sequential import SequentialHost
from lightning_pipe.schedules import ScheduleSpec, build_schedule
from lightning_pipe.schedules.two_bw import pipedream_2bw
from lightning_pipe.simulation import CostModel, chunk_costs, simulate

SCHEDULES = ["gpipe", "1f1b", "2bw"]


def model_of(cfg: dict, sleep: bool = True) -> nn.Sequential:
    """The real part's MLP, or the emulated part's sleeping blocks (``sleep=False``: without the sleeps)."""
    if cfg["kind"] != "emulated":
        return make_model(cfg)
    return sleep_model(cfg["depth"], cfg["hidden"], *((cfg["t_f"], cfg["t_b"]) if sleep else (0.0, 0.0)))


def _pipeline(rank: int, world: int, cfg: dict, name: str) -> dict:
    """Train `cfg`'s model with schedule `name` on `world` ranks (an equal share of the blocks per
    rank); per-step traces; 2BW's drain timed."""
    model, data, m = model_of(cfg), make_data(cfg), cfg["microbatches"]
    lo, hi = equal_bounds(len(model), world)[rank]
    chunk = model[lo:hi]
    host = SequentialHost({rank: chunk}, world - 1, loss_fn)
    transport = Transport(lambda r: r, torch.device("cpu"))
    opt = torch.optim.SGD(chunk.parameters(), lr=cfg["lr"])
    clock = Clock(copy=0.0)
    pipes.time_executor(clock)  # time inside Executor.run vs the layer's bookkeeping
    if name == "2bw":  # opt.step: the drain's update (what the caller's optimizer step does)
        layer = DoubleBuffer(ScheduleSpec.of("2bw"), world, m, rank, transport, chunk, opt.step, trace=True)
        # the live weights' copy before an update a batch still reads
        layer.versions.detach_live = clock.wrap(layer.versions.detach_live, "copy")
    else:
        layer = Flush(ScheduleSpec.of(name), world, m, rank, transport, trace=True)
    trace: list[dict] = []

    def step(i: int) -> None:
        x, y = data[i % len(data)]
        clock.zero()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        executor = pipes.run_layer(layer, host, x, y, m)
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        acts, busy, inside = executor.actions, pipes.compute_seconds(executor), clock["executor"]
        actions = [(acts[j].op.value, acts[j].microbatch, s, e) for j, s, e in executor.records if acts[j].op.is_compute]
        # waiting: in the executor, not computing (messages, Python); outside: the layer's rest but 2BW's weight copy
        times = dict(
            step=t2 - t0, pipe=t1 - t0, busy=busy, waiting=inside - busy, copy=clock["copy"], outside=t1 - t0 - inside - clock["copy"]
        )
        trace.append(dict(times, opt=t2 - t1, t0=t0, t1=t1, t2=t2, actions=actions))  # t0..t2: one clock for all processes (the timeline)

    timing = timed_steps(step, cfg["steps"], cfg["warmup"], dist.barrier)
    t = time.perf_counter()
    layer.drain()  # 2BW: the last batch's remaining backwards and its update; flushing schedules: nothing
    dist.barrier()
    drain = time.perf_counter() - t
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if lo <= int(k.split(".")[0]) < hi}
    return {"timing": timing, "params": state, "trace": trace[cfg["warmup"] :], "drain": drain}


def job(rank: int, world: int, mode: str, cfg: dict) -> dict:
    if mode == "single":
        return single_job(rank, world, cfg)
    if mode == "profile":  # the link at the one message size, every block at the micro-batch size
        x, y = make_data(cfg)[0]
        sizes = (4, cfg["rows"] * cfg["hidden"] * 4)
        return pipes.profile_job(rank, world, list(model_of(cfg)), x, y, [cfg["rows"]], sizes, loss_fn, cfg["profile_repeats"])
    return _pipeline(rank, world, cfg, mode)


def reference(cfg: dict, rule: str) -> dict:
    """The final weights of the run's steps on one process (no sleeping): plain SGD ("sgd"), or the
    2BW rule ("2bw": batch b's gradient taken at W(max(b - 1, 0)) and applied to W(b))."""
    net, data = model_of(cfg, sleep=False), make_data(cfg)
    opt = torch.optim.SGD(net.parameters(), lr=cfg["lr"])
    previous = copy.deepcopy(net)  # W(b - 1)
    for b in range(cfg["warmup"] + cfg["steps"]):
        x, y = data[b % len(data)]
        at = net if rule == "sgd" or b == 0 else previous
        at.zero_grad(set_to_none=True)
        loss_fn(at(x), y).backward()
        if rule == "2bw":
            grads = [p.grad.clone() for p in at.parameters()]
            previous = copy.deepcopy(net)
            for p, g in zip(net.parameters(), grads):
                p.grad = g
        opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def simulated(name: str, depth: int, m: int, costs) -> dict:
    """Simulated time per step (no optimizer) and each rank's compute in it: the iteration of a
    flushing schedule; for 2BW the steady step T(k + 1) - T(k) of the unrolled run."""
    bounds = equal_bounds(costs.num_blocks, depth)
    f, b, _ = chunk_costs(costs, bounds)
    run = lambda schedule: simulate(schedule, costs, bounds, critical_path=False).iteration_time  # noqa: E731
    t = [run(pipedream_2bw(depth, m, batches=n)) for n in (3, 4)] if name == "2bw" else [0.0, run(build_schedule(name, depth, m))]
    return {"step": t[1] - t[0], "busy": [m * (fr + br) for fr, br in zip(f, b)]}


def medians(run: dict, key: str) -> list[float]:
    """Per rank, the median over the timed steps of one of a step's times (`_pipeline`)."""
    return [statistics.median(s[key] for s in steps) for steps in run["raw"]]


def update_error(results: list[dict], reference: dict, initial: dict) -> float:
    """Largest relative difference of the ranks' weight *changes* from the reference's (the weights
    hardly move in a short run: comparing them would not tell 2BW's stale update from SGD)."""
    change = {k: reference[k] - initial[k] for k in initial}
    rel = lambda k, v: ((v - initial[k]) - change[k]).abs().max().item() / change[k].abs().max().clamp_min(1e-30).item()  # noqa: E731
    return max(rel(k, v) for r in results for k, v in r["params"].items())


def measure(bench: Bench, cfg: dict, modes: list[str], world: int, rounds: int, tag: str) -> dict:
    """Every mode in interleaved rounds; each mode's fastest run with its traces, and its worst weight error."""
    initial = {k: v.detach().clone() for k, v in model_of(cfg, sleep=False).state_dict().items()}
    refs = {rule: reference(cfg, rule) for rule in ("sgd", "2bw")}

    def one(mode: str, rep: int) -> dict:
        results, foreign = bench.run(job, 1 if mode == "single" else world, mode, cfg, label=f"{tag} {mode}")
        st = dict(summarize(mode, results, cfg), mode=mode, foreign=foreign, error=None)
        if mode != "single":
            st.update(error=update_error(results, refs["2bw" if mode == "2bw" else "sgd"], initial), raw=[r["trace"] for r in results])
            st["drain"] = max(r["drain"] for r in results)
        if mode == "2bw":  # the check tells the rules apart: 2BW's updates are not plain SGD's
            st["vs_sgd"] = update_error(results, refs["sgd"], initial)
        extra = "".join(f", {k} {st[k]:.1e}" for k in ("error", "vs_sgd") if st.get(k) is not None)
        bench.log(
            f"  {tag} run {rep + 1}/{rounds} {mode:6s} {st['total']:8.1f} samples/s ({st['step_ms']:.1f} ms/step, foreign {foreign:.2f}{extra})"
        )
        return st

    return dict(zip(modes, pipes.best_runs(modes, rounds, one, "total", "error")))


def print_timeline(bench: Bench, best: dict[str, dict]) -> None:
    """One timed step (rank 0's median) of 1F1B and 2BW as each rank ran it: its computes (F / B and
    micro-batch; negative: the previous batch's), the end of the run and the optimizer step, in ms
    from rank 0's step start (one clock for all processes)."""
    bench.say("\ntimeline of one timed step (rank 0's median), ms from rank 0's step start; [x] = idle gap before a compute > 0.3 ms:\n")
    for name in ("1f1b", "2bw"):
        raw = best[name]["raw"]
        k = sorted(range(len(raw[0])), key=lambda i: raw[0][i]["step"])[len(raw[0]) // 2]
        at = lambda t: f"{1e3 * (t - raw[0][k]['t0']):.1f}"  # noqa: E731, B023
        bench.say(f"{name}:")
        for rank, steps in enumerate(raw):
            st = steps[k]
            parts, last = [f"start {at(st['t0'])}"], st["t0"]
            for op, mb, a, b in st["actions"]:
                if op in ("F", "B"):
                    parts.append(f"{'[%.1f] ' % (1e3 * (a - last)) if a - last > 3e-4 else ''}{op}{mb} {at(a)}-{at(b)}")
                    last = b
            copied = f" (weight copy {1e3 * st['copy']:.1f})" if name == "2bw" else ""
            bench.say(f"  rank {rank}: " + " | ".join([*parts, f"run ends {at(st['t1'])}{copied}", f"opt to {at(st['t2'])}"]))
        bench.say()


def real_table(bench: Bench, args, m: int, best: dict, sims: dict, costs) -> None:
    """The real part at one m: the modes' table, 2BW's speed-ups and its drain, the traces (the timeline at the smallest m)."""
    opt = max(medians(best["1f1b"], "opt"))  # the simulator has no optimizer: add the one measured
    sim = {name: s["step"] + opt for name, s in sims.items()}
    sim["single"] = m * (sum(costs.forward) + sum(costs.backward)) + 2 * opt  # m micro-batches on one process
    t = Table(
        *("mode", "samples/s", "ms/step", "simulated ms/step", "vs single", "simulated vs single"),
        *("weight updates (max rel. error vs reference)", "2BW drain (ms, excluded)", "other load (CPUs)"),
    )
    for mode, s in best.items():
        err = f"{s['error']:.1e} vs {'2BW rule' if mode == '2bw' else 'single (SGD)'}" if s["error"] is not None else ""
        t.add(
            mode, f"{s['total']:.1f}", f"{s['step_ms']:.1f}", ms(sim[mode]), f"{s['total'] / best['single']['total']:.2f}x",
            f"{sim['single'] / sim[mode]:.2f}x", err, ms(s["drain"]) if mode == "2bw" else "", f"{s['foreign']:.2f}",
        )  # fmt: skip
    bench.table(t, f"\n### m = {m} micro-batches of {args.rows} rows; best of {args.rounds} runs of {args.steps} timed steps after "
                   f"{args.warmup} warm-up; simulated step = simulator + {ms(opt)} ms optimizer step (measured); 2BW: steady steps, the drain apart")  # fmt: skip
    for other in ("1f1b", "gpipe"):
        bench.say(
            f"2bw/{other} at m={m}: measured {best['2bw']['total'] / best[other]['total']:.3f}x, simulated {sim[other] / sim['2bw']:.3f}x"
        )
    with_drain = args.steps * args.rows * m / (args.steps * best["2bw"]["step_ms"] / 1e3 + best["2bw"]["drain"])
    bench.say(f"2bw at m={m} including its drain once over the {args.steps} timed steps: {with_drain:.1f} samples/s")
    pair = lambda vs: " / ".join(ms(v) for v in vs)  # noqa: E731
    med = lambda key: pair(medians(best[name], key))  # noqa: E731, B023
    t = Table(
        *"schedule;simulated step (no opt);measured pipeline step;simulated compute;measured compute;"
        "measured in executor, not computing;outside the executor (2BW: weight copy + rest);optimizer step".split(";")
    )
    for name in SCHEDULES:
        copied, outside = medians(best[name], "copy"), medians(best[name], "outside")
        book = " / ".join(f"{ms(c)} + {ms(o)}" for c, o in zip(copied, outside)) if name == "2bw" else pair(outside)
        t.add(name, ms(sims[name]["step"]), med("pipe"), pair(sims[name]["busy"]), med("busy"), med("waiting"), book, med("opt"))
    bench.say()
    bench.table(
        t, "per-step trace of the best run, median step, ms (rank 0 / rank 1); simulated compute per rank = m (f + b) of its stage:"
    )
    if m == min(args.microbatches):
        print_timeline(bench, best)


def run_part(bench: Bench, args, real: bool) -> None:
    """The real part (2 ranks, m from --microbatches) or the emulated one (d from --depths, m = factor x d):
    the blocks and the link profiled on 2 ranks at once, then every (d, m) measured and simulated."""
    base = dict(kind="real" if real else "emulated", hidden=512, rows=args.rows, lr=1e-3, profile_repeats=args.profile_repeats)
    if real:
        base.update(mlp_ratio=1, blocks=8, steps=args.steps, warmup=args.warmup)
        cases, rounds, label = [(2, m) for m in args.microbatches], args.rounds, "profile"
        bench.say(f"\n## real processes: 2 ranks x 1 thread, gloo; {base}\n")
    else:
        base.update(steps=args.emu_steps, warmup=args.emu_warmup, t_f=args.tf / 1e3, t_b=2 * args.tf / 1e3)
        cases, rounds, label = [(d, k * d) for d in args.depths for k in args.emu_factors], args.emu_repeats, "emulated profile"
        bench.say(f"\n## emulated devices (sleep): d processes, one sleeping block per stage; {base}\n")
    prof, foreign = bench.run(job, 2, "profile", dict(base, depth=2, microbatches=1, batch=args.rows), label=label)
    c = pipes.costs_at(prof[0], args.rows, "bench-2bw")
    f, b = statistics.median(c.forward), statistics.median(c.backward)
    bench.say(f"{label} (foreign load {foreign:.2f}): per block f {ms(f, 2)} ms, b {ms(b, 2)} ms (last, with the loss: f {ms(c.forward[-1], 2)}, "
              f"b {ms(c.backward[-1], 2)}); link {1e6 * c.latency:.0f} us + {c.bandwidth / 1e9:.2f} GB/s")  # fmt: skip
    t = Table(
        *("d", "m", "gpipe samples/s", "1f1b samples/s", "2bw samples/s", "2bw/1f1b measured", "2bw/1f1b simulated"),
        *("2bw/gpipe measured", "2bw/gpipe simulated", "2bw drain ms", "weight updates (max rel. error: sync vs SGD, 2bw vs 2BW rule)"),
        align="r" * 11,
    )
    for depth, m in cases:
        cfg = dict(base, depth=depth, microbatches=m, batch=args.rows * m)
        best = measure(bench, cfg, ["single"] * real + SCHEDULES, depth, rounds, f"m={m}" if real else f"emulated d={depth} m={m}")
        if not real:  # d sleeping blocks, the loss on the last
            fwd, bwd = (f,) * (depth - 1) + (c.forward[-1],), (b,) * (depth - 1) + (c.backward[-1],)
            c = CostModel(fwd, bwd, (c.activation_bytes[0],) * depth, (c.param_bytes[0],) * depth, c.bandwidth, c.latency)
        sims = {name: simulated(name, depth, m, c) for name in SCHEDULES}
        if real:
            real_table(bench, args, m, best, sims, c)
            continue
        cells = [f"{best[n]['total']:.0f} ({args.rows * m / sims[n]['step']:.0f})" for n in SCHEDULES]
        speedups = [x for o in ("1f1b", "gpipe") for x in (best["2bw"]["total"] / best[o]["total"], sims[o]["step"] / sims["2bw"]["step"])]
        errs = ", ".join(f"{n} {best[n]['error']:.0e}" for n in SCHEDULES)
        t.add(depth, m, *cells, *(f"{x:.3f}" for x in speedups), ms(best["2bw"]["drain"]), errs)
    if not real:
        bench.table(t, "\n### emulated devices (sleep): samples/s, measured (simulated); speed-up of 2BW over 1F1B (Flush) and GPipe")


def main() -> None:
    quick = dict(microbatches=[2], depths=[2], emu_factors=[1], emu_steps=2, emu_warmup=1, emu_repeats=1, profile_repeats=3)
    common = dict(rounds=3, steps=20, warmup=5, retries=2, budget=300.0, quiet_wait=10.0, timeout=300.0, max_foreign=0.1, pin=False)
    bench = Bench(__doc__, quick, threads=1, **common)
    bench.parser.add_argument("--part", choices=["real", "emulated", "all"], default="all")
    bench.options(rows=(64, "rows per micro-batch, both parts"), profile_repeats=30, microbatches=([2, 8], "real part: m values (>= 2)"))
    bench.options(depths=([2, 4, 8], "emulated part: d = processes"), tf=(5.0, "emulated part: forward sleep per stage, ms (backward 2x)"))
    bench.parser.set_defaults(emu_factors=[1, 4], emu_steps=8, emu_warmup=2, emu_repeats=1)  # emulated part: m = factor x d, one run each
    args = bench.parse()
    if any(m < 2 for m in args.microbatches):
        bench.error("2BW needs m >= d = 2")
    for real in (True, False):
        if args.part in ("real" if real else "emulated", "all"):
            run_part(bench, args, real)
    bench.finish()


if __name__ == "__main__":
    main()
