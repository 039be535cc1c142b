"""PipeDream-2BW vs PipeDream-Flush (1F1B) vs GPipe vs one process: samples/s, measured and simulated.

Part ``real``: bench_runtime's residual MLP (lightning_pipe.bench.mlp) on 2 gloo processes at
m = 2 and 8; part ``emulated``: d = 2, 4, 8 processes of sleeping stages (SleepBlock) at m = d, 4d.
Per mode: samples/s, the simulator's step on the profiled costs, final weights against one process
(2BW: against the 2BW rule), per-rank traces and one step's timeline. Feeds docs/benchmarks_2bw.md
(method and results there).

    python benchmarks/bench_2bw.py
    python benchmarks/bench_2bw.py --part emulated --depths 2,4 --tf 8
    python benchmarks/bench_2bw.py --quick                  # smoke: both parts, m = d = 2, 2 steps
"""

from __future__ import annotations

import copy
import statistics
import time

from lightning_pipe.bench.harness import Bench, Table, ints, ms, pin_threads

pin_threads(1)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from lightning_pipe.bench import pipes  # noqa: E402
from lightning_pipe.bench.launch import timed_steps  # noqa: E402
from lightning_pipe.bench.mlp import loss_fn, make_data, make_model, single_job, stage_half, summarize  # noqa: E402
from lightning_pipe.bench.pipes import Clock, SleepBlock, equal_bounds  # noqa: E402

SCHEDULES = ["gpipe", "1f1b", "2bw"]
MODES = ["single", *SCHEDULES]


def model_of(cfg: dict, sleep: bool = True) -> nn.Sequential:
    """The real part's MLP, or the emulated part's sleeping blocks (``sleep=False``: without the sleeps)."""
    if cfg["kind"] != "emulated":
        return make_model(cfg)
    torch.manual_seed(0)
    model = nn.Sequential(*[SleepBlock(cfg["hidden"], *((cfg["t_f"], cfg["t_b"]) if sleep else (0.0, 0.0))) for _ in range(cfg["depth"])])
    with torch.no_grad():  # distinct weights per stage, so the final-weights check means something
        for block in model:
            block.scale.add_(0.1 * torch.randn(cfg["hidden"]))
    return model


def stage_of(model: nn.Sequential, rank: int, world: int) -> nn.Sequential:
    """Rank `rank`'s equal share of the blocks (keeps the whole model's block indices in its state)."""
    lo, hi = equal_bounds(len(model), world)[rank]
    return stage_half(model, rank) if world == 2 and len(model) % 2 == 0 else model[lo:hi]


# ---- workers -------------------------------------------------------------------------------------
def _pipeline(rank: int, world: int, cfg: dict, name: str) -> dict:
    """Train `cfg`'s model with schedule `name` on `world` ranks; per-step traces; 2BW's drain timed."""
    from lightning_pipe.layers import DoubleBuffer, Flush
    from lightning_pipe.runtime.p2p import Transport
    from lightning_pipe.runtime.sequential import SequentialHost
    from lightning_pipe.schedules import ScheduleSpec

    model, data, m = model_of(cfg), make_data(cfg), cfg["microbatches"]
    chunk = stage_of(model, rank, world)
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
        acts = executor.actions
        actions = [(acts[j].op.value, acts[j].microbatch, s, e) for j, s, e in executor.records if acts[j].op.is_compute]
        times = dict(
            step=t2 - t0, pipe=t1 - t0, executor=clock["executor"], copy=clock["copy"], opt=t2 - t1, busy=pipes.compute_seconds(executor)
        )
        trace.append(dict(times, t0=t0, t1=t1, t2=t2, actions=actions))  # t0..t2: one clock for all processes (the timeline)

    timing = timed_steps(step, cfg["steps"], cfg["warmup"], dist.barrier)
    t = time.perf_counter()
    layer.drain()  # 2BW: the last batch's remaining backwards and its update; flushing schedules: nothing
    dist.barrier()
    drain = time.perf_counter() - t
    mine = range(*equal_bounds(len(model), world)[rank])
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if int(k.split(".")[0]) in mine}
    return {"timing": timing, "params": state, "trace": trace[cfg["warmup"] :], "drain": drain}


def job(rank: int, world: int, mode: str, cfg: dict) -> dict:
    if mode == "single":
        return single_job(rank, world, cfg)
    if mode == "profile":  # the link at the one message size, every block at the micro-batch size
        x, y = make_data(cfg)[0]
        sizes = (4, cfg["rows"] * cfg["hidden"] * 4)
        return pipes.profile_job(rank, world, list(model_of(cfg)), x, y, [cfg["rows"]], sizes, loss_fn, cfg["profile_repeats"])
    return _pipeline(rank, world, cfg, mode)


# ---- the parent: references, simulation -----------------------------------------------------------
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
    from lightning_pipe.schedules import build_schedule
    from lightning_pipe.schedules.two_bw import pipedream_2bw
    from lightning_pipe.simulation import chunk_costs, simulate

    bounds = equal_bounds(costs.num_blocks, depth)
    f, b, _ = chunk_costs(costs, bounds)
    busy = [m * (fr + br) for fr, br in zip(f, b)]
    if name == "2bw":
        t = [simulate(pipedream_2bw(depth, m, batches=n), costs, bounds, critical_path=False).iteration_time for n in (3, 4)]
        return {"step": t[1] - t[0], "busy": busy}
    return {"step": simulate(build_schedule(name, depth, m), costs, bounds, critical_path=False).iteration_time, "busy": busy}


# ---- measuring -----------------------------------------------------------------------------------
def trace_stats(results: list[dict]) -> dict:
    """Per rank, the median over the timed steps of: the step, the pipeline part, compute, the rest of
    the executor's time (waiting for messages, issuing them, Python), 2BW's weight copy, the rest
    outside the executor, the optimizer step."""
    derived = {k: (lambda s, k=k: s[k]) for k in ("step", "pipe", "busy", "copy", "opt")}
    derived.update(waiting=lambda s: s["executor"] - s["busy"], outside=lambda s: s["pipe"] - s["executor"] - s["copy"])
    return {k: [statistics.median(f(s) for s in r["trace"]) for r in results] for k, f in derived.items()}


def update_error(results: list[dict], reference: dict, initial: dict) -> float:
    """Largest relative difference of the ranks' weight *changes* from the reference's (the weights
    hardly move in a short run: comparing them would not tell 2BW's stale update from SGD)."""
    err = 0.0
    for r in results:
        for k, v in r["params"].items():
            want = reference[k] - initial[k]
            err = max(err, ((v - initial[k]) - want).abs().max().item() / want.abs().max().clamp_min(1e-30).item())
    return err


def measure(bench: Bench, cfg: dict, modes: list[str], world: int, rounds: int, tag: str) -> dict:
    """Every mode in interleaved rounds; each mode's fastest run with its traces, and its worst weight error."""
    initial = {k: v.detach().clone() for k, v in model_of(cfg, sleep=False).state_dict().items()}
    refs = {rule: reference(cfg, rule) for rule in ("sgd", "2bw")}

    def one(mode: str, rep: int) -> dict:
        results, foreign = bench.run(job, 1 if mode == "single" else world, mode, cfg, label=f"{tag} {mode}")
        st = dict(summarize(mode, results, cfg), foreign=foreign, error=None)
        if mode != "single":
            st.update(error=update_error(results, refs["2bw" if mode == "2bw" else "sgd"], initial), trace=trace_stats(results))
            st.update(raw=[r["trace"] for r in results], drain=max(r["drain"] for r in results))
        if mode == "2bw":  # the check tells the rules apart: 2BW's updates are not plain SGD's
            st["vs_sgd"] = update_error(results, refs["sgd"], initial)
        extra = "".join(f", {k} {st[k]:.1e}" for k in ("error", "vs_sgd") if st.get(k) is not None)
        bench.log(
            f"  {tag} run {rep + 1}/{rounds} {mode:6s} {st['total']:8.1f} samples/s ({st['step_ms']:.1f} ms/step, foreign {foreign:.2f}{extra})"
        )
        return st

    return dict(zip(modes, pipes.best_runs(modes, rounds, one, "total", "error")))


def print_traces(bench: Bench, best: dict[str, dict], sims: dict[str, dict], depth: int) -> None:
    who, pair = " (rank 0 / rank 1)" if depth == 2 else " (ranks 0 / .. / d-1)", lambda vs: " / ".join(ms(v) for v in vs)
    t = Table(
        *"schedule;simulated step (no opt);measured pipeline step;simulated compute;measured compute;"
        "measured in executor, not computing;outside the executor (2BW: weight copy + rest);optimizer step".split(";")
    )
    for name in (n for n in SCHEDULES if n in best):
        tr, s = best[name]["trace"], sims[name]
        book = " / ".join(f"{ms(c)} + {ms(o)}" for c, o in zip(tr["copy"], tr["outside"])) if name == "2bw" else pair(tr["outside"])
        t.add(name, ms(s["step"]), pair(tr["pipe"]), pair(s["busy"]), pair(tr["busy"]), pair(tr["waiting"]), book, pair(tr["opt"]))
    bench.say()
    bench.table(t, f"per-step trace of the best run, median step, ms{who}; simulated compute per rank = m (f + b) of its stage:")


def print_timeline(bench: Bench, best: dict[str, dict], names: tuple[str, ...] = ("1f1b", "2bw")) -> None:
    """One timed step (rank 0's median) of each schedule as each rank ran it: its computes (F / B and
    micro-batch; negative: the previous batch's), the end of the run and the optimizer step, in ms
    from rank 0's step start (one clock for all processes)."""
    bench.say("\ntimeline of one timed step (rank 0's median), ms from rank 0's step start; [x] = idle gap before a compute > 0.3 ms:\n")
    for name in (n for n in names if n in best):
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


# ---- the parts -----------------------------------------------------------------------------------
def profiled(bench: Bench, base: dict, label: str):
    """The blocks at the micro-batch size and the link, profiled on 2 ranks at once (printed); their CostModel."""
    prof, foreign = bench.run(job, 2, "profile", dict(base, depth=2, microbatches=1, batch=base["rows"]), label=label)
    c = pipes.costs_at(prof[0], base["rows"], "bench-2bw")
    f = lambda v: f"{v * 1e3:.2f}"  # noqa: E731
    bench.say(
        f"{label} (foreign load {foreign:.2f}): per block f {f(statistics.median(c.forward))} ms, b {f(statistics.median(c.backward))} ms "
        f"(last, with the loss: f {f(c.forward[-1])}, b {f(c.backward[-1])}); link {1e6 * c.latency:.0f} us + {c.bandwidth / 1e9:.2f} GB/s"
    )
    return c


def real_part(bench: Bench, args) -> None:
    base = dict(kind="real", hidden=512, mlp_ratio=1, blocks=8, rows=args.rows, steps=args.steps, warmup=args.warmup, lr=1e-3)
    base["profile_repeats"] = args.profile_repeats
    bench.say(f"\n## real processes: 2 ranks x 1 thread, gloo; {base}\n")
    costs = profiled(bench, base, "profile")
    for m in args.microbatches:
        cfg = dict(base, microbatches=m, batch=args.rows * m)
        best = measure(bench, cfg, MODES, 2, args.rounds, f"m={m}")
        bench.keep(f"real m={m}", {mode: {k: v for k, v in s.items() if k != "raw"} for mode, s in best.items()})
        sims = {name: simulated(name, 2, m, costs) for name in SCHEDULES}
        opt = max(best["1f1b"]["trace"]["opt"])  # the simulator has no optimizer: add the one measured
        sim_step = {name: s["step"] + opt for name, s in sims.items()}
        sim_step["single"] = m * (sum(costs.forward) + sum(costs.backward)) + 2 * opt  # m micro-batches on one process
        t = Table(
            *("mode", "samples/s", "ms/step", "simulated ms/step", "vs single", "simulated vs single"),
            *("weight updates (max rel. error vs reference)", "2BW drain (ms, excluded)", "other load (CPUs)"),
        )
        for mode, s in best.items():
            err = f"{s['error']:.1e} vs {'2BW rule' if mode == '2bw' else 'single (SGD)'}" if s["error"] is not None else ""
            t.add(
                mode, f"{s['total']:.1f}", f"{s['step_ms']:.1f}", ms(sim_step[mode]), f"{s['total'] / best['single']['total']:.2f}x",
                f"{sim_step['single'] / sim_step[mode]:.2f}x", err, ms(s["drain"]) if mode == "2bw" else "", f"{s['foreign']:.2f}",
            )  # fmt: skip
        title = (
            f"\n### m = {m} micro-batches of {args.rows} rows; best of {args.rounds} runs of {args.steps} timed steps after {args.warmup} "
            f"warm-up; simulated step = simulator + {ms(opt)} ms optimizer step (measured); 2BW: steady steps, the drain apart"
        )
        bench.table(t, title)
        for other in ("1f1b", "gpipe"):
            meas, simr = best["2bw"]["total"] / best[other]["total"], sim_step[other] / sim_step["2bw"]
            bench.say(f"2bw/{other} at m={m}: measured {meas:.3f}x, simulated {simr:.3f}x")
        with_drain = args.steps * cfg["batch"] / (args.steps * best["2bw"]["step_ms"] / 1e3 + best["2bw"]["drain"])
        bench.say(f"2bw at m={m} including its drain once over the {args.steps} timed steps: {with_drain:.1f} samples/s")
        print_traces(bench, best, sims, 2)
        if m == min(args.microbatches):
            print_timeline(bench, best)


def emulated_part(bench: Bench, args) -> None:
    from lightning_pipe.simulation import CostModel

    t_f, t_b = args.tf / 1e3, 2 * args.tf / 1e3
    base = dict(kind="emulated", hidden=512, rows=args.rows, steps=args.emu_steps, warmup=args.emu_warmup, lr=1e-3, t_f=t_f, t_b=t_b)
    base["profile_repeats"] = args.profile_repeats
    bench.say(f"\n## emulated devices (sleep): d processes, one sleeping block per stage; {base}\n")
    c2 = profiled(bench, base, "emulated profile")  # the sleeping block, and the link between two processes
    f_blk, b_blk = statistics.median(c2.forward), statistics.median(c2.backward)
    t = Table(
        *("d", "m", "gpipe samples/s", "1f1b samples/s", "2bw samples/s", "2bw/1f1b measured", "2bw/1f1b simulated"),
        *("2bw/gpipe measured", "2bw/gpipe simulated", "2bw drain ms", "weight updates (max rel. error: sync vs SGD, 2bw vs 2BW rule)"),
        align="r" * 11,
    )
    for depth in args.depths:
        for m in (factor * depth for factor in args.emu_factors):
            cfg = dict(base, depth=depth, microbatches=m, batch=args.rows * m)
            fwd, bwd = (f_blk,) * (depth - 1) + (c2.forward[-1],), (b_blk,) * (depth - 1) + (c2.backward[-1],)
            costs = CostModel(fwd, bwd, (c2.activation_bytes[0],) * depth, (c2.param_bytes[0],) * depth, c2.bandwidth, c2.latency)
            best = measure(bench, cfg, SCHEDULES, depth, args.emu_repeats, f"emulated d={depth} m={m}")
            sims = {name: simulated(name, depth, m, costs) for name in SCHEDULES}
            print_traces(bench, best, sims, depth)
            cells = [f"{best[n]['total']:.0f} ({args.rows * m / sims[n]['step']:.0f})" for n in SCHEDULES]
            b2, s2 = best["2bw"]["total"], sims["2bw"]["step"]
            speedups = [x for o in ("1f1b", "gpipe") for x in (b2 / best[o]["total"], sims[o]["step"] / s2)]
            errs = ", ".join(f"{n} {best[n]['error']:.0e}" for n in SCHEDULES)
            t.add(depth, m, *cells, *(f"{x:.3f}" for x in speedups), ms(best["2bw"]["drain"]), errs)
    bench.table(t, "\n### emulated devices (sleep): samples/s, measured (simulated); speed-up of 2BW over 1F1B (Flush) and GPipe")


def main() -> None:
    quick = dict(microbatches=[2], depths=[2], emu_factors=[1], emu_steps=2, emu_warmup=1, emu_repeats=1, profile_repeats=3)
    common = dict(rounds=3, steps=20, warmup=5, retries=2, budget=300.0, quiet_wait=10.0, timeout=300.0, max_foreign=0.1, pin=False)
    bench = Bench(__doc__, quick, **common)
    p = bench.parser
    p.add_argument("--part", choices=["real", "emulated", "all"], default="all")
    p.add_argument("--rows", type=int, default=64, help="rows per micro-batch (batch = rows x m), both parts")
    p.add_argument("--profile-repeats", type=int, default=30)
    p.add_argument("--microbatches", type=ints, default=[2, 8], help="real part: m values (2BW needs m >= 2)")
    p.add_argument("--depths", type=ints, default=[2, 4, 8], help="emulated part: pipeline depths d = processes")
    p.add_argument("--tf", type=float, default=5.0, help="emulated part: forward sleep per stage and micro-batch, ms (backward twice)")
    p.set_defaults(emu_factors=[1, 4], emu_steps=8, emu_warmup=2, emu_repeats=1)  # emulated part: m = factor x d, one run each
    args = bench.parse()
    if any(m < 2 for m in args.microbatches):
        bench.error("2BW needs m >= d = 2")
    if args.part in ("real", "all"):
        real_part(bench, args)
    if args.part in ("emulated", "all"):
        emulated_part(bench, args)
    bench.finish()


if __name__ == "__main__":
    main()
