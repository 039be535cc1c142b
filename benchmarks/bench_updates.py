"""Weight-update variants of the residual MLP (benchmarks.harness.mlp) against GPipe / 1F1B on gloo
processes x 1 thread, at the engine level: samples/s, measured and simulated.

``2bw`` (docs/results/benchmarks_2bw.md): PipeDream-2BW vs 1F1B (Flush) vs GPipe vs one process on 2 processes
(``--part real``) and on d = 2, 4, 8 processes of sleeping stages (``emulated``); weight updates against
one process, per-rank traces, one step's timeline. ``avgpipe`` (docs/results/benchmarks_avgpipe.md): AvgPipe (N
pipelines, elastic averaging) vs plain GPipe / 1F1B at 256 rows per optimizer step, K = 2 stages: where
the time goes per worker, the staleness bound, "malloc kept" runs; N pipelines with devices of their own
simulated.

    python -m benchmarks.bench_updates 2bw
    python -m benchmarks.bench_updates 2bw --part emulated --depths 2,4 --tf 8
    python -m benchmarks.bench_updates avgpipe --retries 1 --budget 480
    python -m benchmarks.bench_updates {2bw,avgpipe} --quick   # smoke: 2bw m = d = 2; avgpipe N = M = 2, s = 1; 2 steps
"""

from __future__ import annotations

import copy
import os
import resource
import statistics
import time
from collections import deque
from itertools import count
from types import SimpleNamespace
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.harness import pipes
from benchmarks.harness.bench import Bench, Table, column_table, ints, ms
from benchmarks.harness.launch import proc_stat, timed_steps
from benchmarks.harness.mlp import keep_blocks, loss_fn, make_data, make_model, single_job, stage_half, summarize
from benchmarks.harness.pipes import Clock, compute_seconds, costs_at, equal_bounds, sleep_model, time_executor
from lightning_pipe.modes.avgpipe.engine import ElasticAveraging
from lightning_pipe.modes.flush.engine import Flush
from lightning_pipe.runtime.elastic import ReferenceLink, flat_into, flat_size
from lightning_pipe.runtime.p2p import Transport
from lightning_pipe.runtime.sequential import SequentialHost
from lightning_pipe.schedules import ScheduleSpec, build_schedule
from lightning_pipe.schedules.two_bw import pipedream_2bw
from lightning_pipe.simulation import CostModel, chunk_costs, simulate

SCHEDULES = ["gpipe", "1f1b", "2bw"]


def model_of(cfg: dict) -> nn.Sequential:
    """The MLP (2bw's real part, avgpipe), or 2bw's emulated part's sleeping blocks."""
    return sleep_model(cfg["depth"], cfg["hidden"], cfg["t_f"], cfg["t_b"]) if cfg.get("kind") == "emulated" else make_model(cfg)


def stage_of(cfg: dict, chunk: nn.Module, stage: int, stages: int, peer, **keys: float) -> tuple:
    """A stage's host, transport (``peer``: stage -> rank), SGD, and a Clock: ``keys`` and the time inside Executor.run."""
    clock = Clock(**keys)
    time_executor(clock)
    host = SequentialHost({stage: chunk}, stages - 1, loss_fn)
    return host, Transport(peer, torch.device("cpu")), torch.optim.SGD(chunk.parameters(), lr=cfg["lr"]), clock


def _pipeline(rank: int, world: int, cfg: dict, name: str) -> dict:
    """Train `cfg`'s model with schedule `name`, an equal share of its blocks per rank: per-step traces, 2BW's drain timed."""
    model, data, m = model_of(cfg), make_data(cfg), cfg["microbatches"]
    lo, hi = equal_bounds(len(model), world)[rank]
    chunk = model[lo:hi]
    host, transport, opt, clock = stage_of(cfg, chunk, rank, world, lambda r: r, copy=0.0)
    layer = pipes.schedule_layer(name, world, m, rank, transport, chunk, opt.step, trace=True)  # opt.step: 2BW's drain's update
    if name == "2bw":  # the live weights' copy before an update a batch still reads
        layer.versions.detach_live = clock.wrap(layer.versions.detach_live, "copy")
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
        acts, busy, inside = executor.actions, compute_seconds(executor), clock["executor"]
        actions = [(acts[j].op.value, acts[j].microbatch, s, e) for j, s, e in executor.records if acts[j].op.is_compute]
        # waiting: in the executor, not computing (messages, Python); outside: the layer's rest but 2BW's weight copy
        outside = t1 - t0 - inside - clock["copy"]
        times = dict(step=t2 - t0, pipe=t1 - t0, busy=busy, waiting=inside - busy, copy=clock["copy"], outside=outside)
        trace.append(dict(times, opt=t2 - t1, t0=t0, t1=t1, t2=t2, actions=actions))  # t0..t2: one clock for all processes (the timeline)

    timing = timed_steps(step, cfg["steps"], cfg["warmup"], dist.barrier)
    t = time.perf_counter()
    layer.drain()  # 2BW: the last batch's remaining backwards and its update; flushing schedules: nothing
    dist.barrier()
    drain = time.perf_counter() - t
    return {"timing": timing, "params": keep_blocks(model, set(range(lo, hi))), "trace": trace[cfg["warmup"] :], "drain": drain}


def job(rank: int, world: int, mode: str, cfg: dict) -> dict:
    if mode == "profile":  # the link at the activation sizes and every block at each micro-batch size, the ranks at once
        x, y = make_data(dict(cfg, batch=max(cfg["profile_rows"])))[0]
        blocks, rows = list(model_of(cfg)), cfg["profile_rows"]
        return pipes.profile_job(rank, world, blocks, x, y, rows, cfg["link_sizes"], loss_fn, cfg["profile_repeats"])
    if mode == "single":
        return single_job(rank, world, cfg)
    return _avgpipe(rank, world, cfg) if mode == "train" else _pipeline(rank, world, cfg, mode)


def reference(cfg: dict, rule: str) -> dict:
    """The final weights of the run's steps on one process (no sleeping): plain SGD ("sgd"), or the
    2BW rule ("2bw": batch b's gradient taken at W(max(b - 1, 0)) and applied to W(b))."""
    net, data = model_of(dict(cfg, t_f=0.0, t_b=0.0)), make_data(cfg)
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


def update_error(results: list[dict], reference: dict, initial: dict) -> float:
    """Largest relative difference of the ranks' weight *changes* from the reference's (the weights
    hardly move in a short run: comparing them would not tell 2BW's stale update from SGD)."""
    change = {k: reference[k] - initial[k] for k in initial}
    rel = lambda k, v: ((v - initial[k]) - change[k]).abs().max().item() / change[k].abs().max().clamp_min(1e-30).item()  # noqa: E731
    return max(rel(k, v) for r in results for k, v in r["params"].items())


def measure(bench: Bench, cfg: dict, modes: list[str], world: int, rounds: int, tag: str) -> dict:
    """Every mode in interleaved rounds; each mode's fastest run with its traces, and its worst weight error."""
    initial = {k: v.detach().clone() for k, v in model_of(dict(cfg, t_f=0.0, t_b=0.0)).state_dict().items()}
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
        figures = f"{st['total']:8.1f} samples/s ({st['step_ms']:.1f} ms/step, foreign {foreign:.2f}{extra})"
        bench.log(f"  {tag} run {rep + 1}/{rounds} {mode:6s} {figures}")
        return st

    return dict(zip(modes, pipes.best_runs(modes, rounds, one, "total", "error")))


def print_timeline(bench: Bench, best: dict[str, dict]) -> None:
    """One timed step (rank 0's median) of 1F1B and 2BW as each rank ran it: its computes (F / B, micro-batch; negative: the
    previous batch's), the end of the run and the optimizer step, in ms from rank 0's step start (one clock for all processes)."""
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
    medians = lambda run, key: [statistics.median(s[key] for s in steps) for steps in run["raw"]]  # per rank, of a step's times
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
        measured = best["2bw"]["total"] / best[other]["total"]
        bench.say(f"2bw/{other} at m={m}: measured {measured:.3f}x, simulated {sim[other] / sim['2bw']:.3f}x")
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
    title = "per-step trace of the best run, median step, ms (rank 0 / rank 1); simulated compute per rank = m (f + b) of its stage:"
    bench.table(t, title)
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
    link_sizes = (4, args.rows * base["hidden"] * 4)  # the one message size
    prof, foreign = bench.run(job, 2, "profile", dict(base, depth=2, profile_rows=[args.rows], link_sizes=link_sizes), label=label)
    c = costs_at(prof[0], args.rows, "bench-2bw")
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


def two_bw(bench: Bench, args) -> None:
    if any(m < 2 for m in args.microbatches):
        bench.error("2BW needs m >= d = 2")
    for real in (True, False):
        if args.part in ("real" if real else "emulated", "all"):
            run_part(bench, args, real)


# ---- avgpipe (above: 2bw; job, model_of and stage_of serve both)
K = 2  # stages per pipeline
S = 256  # samples (rows) per optimizer step, every configuration
STALE_MICROBATCHES = [4]  # M of the staleness runs
# glibc malloc kept from returning freed memory to the OS: the "malloc kept" variant (fresh pages for the
# elastic update's stage-sized temporaries are what its time is mostly spent on otherwise)
MALLOC = {"MALLOC_TRIM_THRESHOLD_": str(1 << 30), "MALLOC_MMAP_THRESHOLD_": str(1 << 30)}
SERIAL = count(1)  # runs so far: each run's store prefix


def _avgpipe(rank: int, world: int, cfg: dict) -> dict:
    n, m, pipeline, stage = cfg["pipelines"], cfg["microbatches"], rank // K, rank % K  # n = 0: a plain pipeline
    chunk = stage_half(make_model(cfg), stage)
    data = make_data(dict(cfg, batch=cfg["batch"] // max(n, 1)), seed=1234 + 7919 * pipeline)  # each pipeline's own batches
    host, transport, opt, clock = stage_of(cfg, chunk, stage, K, lambda s: pipeline * K + s, send=0.0, wait_ref=0.0)
    refs: list = []

    def link(numel: int, dtype: torch.dtype) -> ReferenceLink:
        store = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])  # the job's TCPStore (run_distributed's)
        made = ReferenceLink(*store, f"{cfg['prefix']}/{stage}/", stage, pipeline, n, numel, dtype, cfg["timeout"])
        made.send_delta = clock.wrap(made.send_delta, "send")  # building the message + the isend (+ reaping old ones)
        made.take_reference = clock.wrap(made.take_reference, "wait_ref")  # waiting for W_ref
        refs.append(made)
        return made

    mode = Flush(ScheduleSpec.of(cfg["schedule"]), K, m, stage, transport, trace=True)
    elastic = ElasticAveraging(chunk, pipeline, 1.0 / n, cfg["staleness"], link, rank=stage) if n else None
    # the elastic update's two halves and the optimizer step in the clock (the update's messages inside after_update)
    before, after = (clock.wrap(getattr(elastic, f"{k}_update") if n else lambda: None, k) for k in ("before", "after"))
    opt_step, trace, ref0 = clock.wrap(opt.step, "opt"), [], [0.0]
    ref_cpu = lambda: (proc_stat(refs[0].proc.pid) or (0, 0, 0.0))[2] if refs and refs[0].proc is not None else 0.0

    def step(i: int) -> None:
        if i == cfg["warmup"]:  # the first timed step: the reference process's CPU clock starts here
            ref0[0] = ref_cpu()
        x, y = data[i % len(data)]
        clock.zero()
        c0, t0 = time.process_time(), time.perf_counter()
        opt.zero_grad(set_to_none=True)
        busy = compute_seconds(pipes.run_layer(mode, host, x, y, m))
        before(), opt_step(), after()
        pull = clock["after"] - clock["send"] - clock["wait_ref"]
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        trace.append(dict(clock, step=wall, busy=busy, waiting=clock["executor"] - busy, pull=pull, cpu=cpu))

    timing = timed_steps(step, cfg["steps"], cfg["warmup"], dist.barrier)
    out = {"timing": timing, "trace": trace[cfg["warmup"] :], "ref_cpu": ref_cpu() - ref0[0], "pipeline": pipeline, "stage": stage}
    if elastic:
        elastic.drain()
        out["own"] = flat_into(elastic.params, torch.empty(flat_size(elastic.params)))
        out["reference"] = elastic.refs[elastic.iteration].clone()
        elastic.close()
    return out


def stub_link(numel: int, dtype: torch.dtype, reference: torch.Tensor):
    """A ReferenceLink without the reference: the mode's own work on a Δ and a W_ref, no messages
    (the Δ message is filled as the real link fills its reused buffer; a received W_ref is a reused
    buffer filled by a copy, as gloo fills the posted buffer)."""
    message, free, pending = torch.empty(numel + 1, dtype=dtype), [], deque()
    link = SimpleNamespace(pending=pending, max_sends=2, send_init=lambda ref: None, release=free.append)
    link.send_delta = lambda delta: message[1:].copy_(delta.detach())
    link.post_reference = lambda: pending.append(free.pop() if free else torch.empty(numel, dtype=dtype))
    link.take_reference = lambda: pending.popleft().copy_(reference)
    return link


def local_update(cfg: dict, stage: int, repeats: int = 30) -> dict:
    """ElasticAveraging's before_update + after_update on one stage's weights in this single-threaded process, with stub_link: the
    update's local work (copies, Δ, pull) without messages or waiting; median ms and minor page faults (fresh buffers) per update."""
    torch.set_num_threads(1)
    chunk = stage_half(make_model(cfg), stage)
    params = list(chunk.parameters())
    numel = sum(p.numel() for p in params)
    ref = flat_into(params, torch.empty(flat_size(params)))
    mode = ElasticAveraging(chunk, 0, 0.5, 0, lambda n, d: stub_link(n, d, ref), rank=stage)
    opt = torch.optim.SGD(params, lr=1e-6)
    for p in params:
        p.grad = torch.randn_like(p)
    clock, times, faults = Clock(), [], []
    before, after = clock.wrap(mode.before_update, "update"), clock.wrap(mode.after_update, "update")
    for _ in range(repeats + 3):
        clock.zero()
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        before(), opt.step(), after()
        times.append(clock["update"])
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    ms_, faults = 1e3 * statistics.median(times[3:]), statistics.median(faults[3:])
    return {"ms": ms_, "text": f"stage {stage} ({numel * 4 / 1e6:.1f} MB of weights) {ms_:.1f} ms, {faults:.0f} minor page faults"}


def avg_summary(results: list[dict], cfg: dict, foreign: float) -> dict:
    """Per key, the median over the timed steps per worker, then the mean over each stage's pipelines;
    samples/s, CPU use; with pipelines, the largest mean(W_n) vs W_ref over the stages (s = 0: equal, §3.2)."""
    stage = lambda k: [r for r in results if r["stage"] == k]
    med = lambda r, key: statistics.median(s[key] for s in r["trace"])
    keys = ("step", "busy", "waiting", "before", "opt", "send", "wait_ref", "pull", "cpu")
    stats = {key: [statistics.mean(med(r, key) for r in stage(k)) for k in range(K)] for key in keys}
    total = max(r["timing"][0] for r in results)
    wall, worker_cpu, ref_cpu = total / cfg["steps"], sum(med(r, "cpu") for r in results), sum(r["ref_cpu"] for r in results) / cfg["steps"]
    stats.update(samples=cfg["steps"] * cfg["batch"] / total, step_ms=1e3 * wall, foreign=foreign, worker_cpu=worker_cpu, ref_cpu=ref_cpu)
    stats["util"] = (worker_cpu + ref_cpu) / ((os.cpu_count() or 1) * wall)
    if cfg["pipelines"]:
        own = lambda k: torch.stack([r["own"] for r in stage(k)]).double().mean(0)
        ref = lambda k: stage(k)[0]["reference"].double()
        stats["invariant"] = max(((own(k) - ref(k)).abs().max() / ref(k).abs().max()).item() for k in range(K))
    return stats


def avg_run(bench: Bench, kind: str, cfg: dict, world: int, label: str) -> tuple[list[dict], float]:
    """bench.run with a store prefix of its own and, for "malloc kept", glibc's settings (the spawned
    workers and their reference processes read them at start)."""
    with mock.patch.dict(os.environ, MALLOC if cfg.get("malloc") else {}):
        return bench.run(job, world, kind, dict(cfg, prefix=f"bench_avgpipe/{os.getpid()}/{next(SERIAL)}"), label=label)


def avg_label(c: dict) -> str:
    if not c["pipelines"]:
        return c["schedule"]
    return f"avg N={c['pipelines']}" + (f" s={c['staleness']}" if c["staleness"] else "") + (" malloc kept" if c.get("malloc") else "")


def configs_of(args, base: dict) -> list[dict]:
    cfg = lambda n, m, **kw: dict(base, pipelines=n, schedule="1f1b", microbatches=m, **kw)
    configs = []
    for m in args.microbatches:
        configs += [dict(cfg(0, m), schedule=name) for name in ("gpipe", "1f1b")] + [cfg(n, m) for n in args.pipelines]
    for m in STALE_MICROBATCHES:
        for n in args.stale_pipelines:
            configs += [cfg(n, m, staleness=s) for s in args.staleness]
            if m not in args.microbatches or n not in args.pipelines:  # the s = 0 base of the comparison
                configs.append(cfg(n, m))
    configs += [cfg(n, m, malloc=True) for m in args.malloc_microbatches for n in args.malloc_pipelines]  # glibc keeping freed memory
    return configs


def avg_measure(bench: Bench, args, configs: list[dict]) -> list[dict]:
    """Every configuration in interleaved rounds; per configuration one record: the configuration and
    its fastest run's figures, with the largest mean(W_n) vs W_ref over its runs."""

    def one(c: dict, rep: int) -> dict:
        tag = f"{avg_label(c)} M={c['microbatches']}"
        results, foreign = avg_run(bench, "train", c, K * max(c["pipelines"], 1), tag)
        st = avg_summary(results, c, foreign)
        inv = f", mean(W_n) vs W_ref {st['invariant']:.1e}" if "invariant" in st else ""
        figures = f"{st['samples']:7.1f} samples/s ({st['step_ms']:.1f} ms/step, CPU use {st['util']:.2f}, foreign {foreign:.2f}{inv})"
        bench.log(f"  run {rep + 1}/{args.rounds} {tag:18s} {figures}")
        return st

    stats = pipes.best_runs(configs, args.rounds, one, "samples", "invariant")
    bench.keep("best", {f"{avg_label(c)} M={c['microbatches']}": st for c, st in zip(configs, stats)})
    return list({(avg_label(c), c["microbatches"]): dict(c, **st) for c, st in zip(configs, stats)}.values())


def avg_simulated(records: dict, m: int, costs, elastic: float, pipelines: list[int]) -> list[dict]:
    """The simulated rows of one M (ms): GPipe and 1F1B on K devices, AvgPipe with N x K devices; each
    with the measured optimizer step (the simulator has none) and for AvgPipe the elastic update."""
    sim = lambda name, rows: 1e3 * simulate(build_schedule(name, K, m), costs(rows), equal_bounds(costs(rows).num_blocks, K)).iteration_time
    opt = 1e3 * max(records[("1f1b", m)]["opt"])
    rows = [dict(label=name, n=0, it=sim(name, S // m)) for name in ("gpipe", "1f1b")]
    rows += [dict(label=f"avg N={n}", n=n, it=sim("1f1b", S // (n * m))) for n in pipelines]
    ref = {r["label"]: r["it"] + opt for r in rows[:2]}
    for r in rows:
        n, total = max(r["n"], 1), r["it"] + opt + (1e3 * elastic if r["n"] else 0.0)
        r.update(m=m, devices=K * n, rows=S // (n * m), with_opt=r["it"] + opt, total=total if r["n"] else None, samples=1e3 * S / total)
        r.update(vs_1f1b=f"{ref['1f1b'] / total:.2f}x", vs_gpipe=f"{ref['gpipe'] / total:.2f}x")
        r["vs_plain"] = f"{ref['1f1b'] / (r['it'] + opt):.2f}x" if r["n"] else None
    return rows


def avgpipe(bench: Bench, args) -> None:
    base = dict(hidden=512, mlp_ratio=1, blocks=8, batch=S, steps=args.steps, warmup=args.warmup, lr=1e-3, timeout=args.timeout)
    base["staleness"] = 0
    bench.say(f"S = {S} samples per step; K = {K} stages; {base}\n")
    configs = configs_of(args, base)
    # the profile: blocks at every micro-batch size used, the link at the activation sizes
    rows = sorted({S // (max(c["pipelines"], 1) * c["microbatches"]) for c in configs})
    sizes = (4, *sorted({r * base["hidden"] * 4 for r in rows} | {1 << 20, 1 << 22}))
    profile = dict(base, profile_rows=rows, link_sizes=sizes, profile_repeats=args.profile_repeats)
    prof, foreign = avg_run(bench, "profile", profile, K, "profile")
    costs = lambda rows: costs_at(prof[0], rows, "bench-avgpipe")
    blocks = (f"{r} rows: block f {ms(statistics.median(costs(r).forward))} b {ms(statistics.median(costs(r).backward))} ms" for r in rows)
    link = f"link {1e6 * prof[0]['link']['latency']:.0f} us + {prof[0]['link']['bandwidth'] / 1e9:.2f} GB/s"
    bench.say(f"profile (foreign load {foreign:.2f}): {link}; " + ", ".join(blocks))
    bench.keep("profile", {"link": prof[0]["link"]})
    locals_ = [local_update(base, k) for k in range(K)]  # the elastic update's local work, one process, no messages
    works = ", ".join(u["text"] for u in locals_)
    bench.say(f"elastic update's local work (before_update + after_update without messages, one quiet process): {works}")
    records = avg_measure(bench, args, configs)
    by_key = {(avg_label(r), r["microbatches"]): r for r in records}
    main_ = [r for r in records if not r["staleness"] and not r.get("malloc") and r["microbatches"] in args.microbatches]
    malloc, extra = [r for r in records if r.get("malloc")], [r for r in records if r["staleness"] or r.get("malloc")]
    pair = lambda v: " / ".join(ms(x) for x in v)
    per = lambda key: lambda r: pair(r[key])  # stage 0 / stage 1
    elastic = lambda key, fmt=pair: lambda r: fmt(r[key]) if r["pipelines"] else ""
    vs = lambda name: lambda r: f"{r['samples'] / by_key[(name, r['microbatches'])]['samples']:.2f}x"
    procs = lambda r: f"{K * max(r['pipelines'], 1)}" + (f" + {K} ref" if r["pipelines"] else "")
    columns = [
        ("config", avg_label), ("M", "microbatches"), ("rows / micro-batch", lambda r: S // (max(r["pipelines"], 1) * r["microbatches"])),
        ("worker + reference processes", procs), ("samples/s", "samples", ".1f"), ("ms/step", "step_ms", ".1f"), ("vs 1F1B (same M)", vs("1f1b")),
        ("vs GPipe (same M)", vs("gpipe")), ("CPU use (of all cores)", "util", ".2f"), ("mean(W_n) vs W_ref", "invariant", ".0e"), ("foreign load", "foreign", ".2f"),
    ]  # fmt: skip
    title = f"samples/s at S = {S} samples per step (best of {args.rounds}, {args.steps} timed steps)"
    bench.table(column_table(columns, main_ + malloc), f"\n## measured on {os.cpu_count()} shared cores: {title}")
    columns = [
        ("config", avg_label), ("M", "microbatches"), ("step", per("step")), ("compute", per("busy")), ("executor, not computing", per("waiting")),
        ("optimizer", per("opt")), ("elastic: copy", elastic("before")), ("Δ + send", elastic("send")), ("wait W_ref", elastic("wait_ref")),
        ("pull + rest", elastic("pull")), ("worker CPU", per("cpu")), ("ref CPU (sum)", elastic("ref_cpu", ms)),
    ]  # fmt: skip
    title = "\n## where the time goes, per worker and step, ms (stage 0 / stage 1; median step, mean over the pipelines)"
    bench.table(column_table(columns, main_ + extra), title)
    elastic_s = max(u["ms"] for u in locals_) / 1e3
    rows = [row for m in args.microbatches for row in avg_simulated(by_key, m, costs, elastic_s, args.pipelines)]
    columns = [
        ("config", "label"), ("M", "m"), ("devices", "devices"), ("rows / micro-batch", "rows"), ("simulated pipeline iteration, ms", "it", ".1f"),
        ("+ optimizer", "with_opt", ".1f"), ("+ elastic update", "total", ".1f"), ("samples/s (simulated, with elastic)", "samples", ".0f"),
        ("vs 1F1B on 2 devices", "vs_1f1b"), ("vs GPipe on 2 devices", "vs_gpipe"), ("vs 1F1B without the elastic update", "vs_plain"),
    ]  # fmt: skip
    title = f"\n## SIMULATED, not measured: N pipelines with K = {K} devices of their own each, vs the plain pipeline on {K} devices"
    bench.table(column_table(columns, rows), title)
    if args.staleness:
        m = STALE_MICROBATCHES[0]
        rows = [by_key[(avg_label(dict(pipelines=n, staleness=s)), m)] for n in args.stale_pipelines for s in [0, *args.staleness]]
        vs0 = lambda r: f"{r['samples'] / by_key[(avg_label(dict(r, staleness=0)), m)]['samples']:.3f}x"
        columns = [
            ("N", "pipelines"), ("M", "microbatches"), ("s", "staleness"), ("samples/s", "samples", ".1f"), ("vs s = 0", vs0),
            ("wait W_ref, ms", per("wait_ref")), ("ms/step", "step_ms", ".1f"),
        ]  # fmt: skip
        title = "\n## staleness s (measured, shared cores): samples/s, best run; time per step waiting for W_ref (stage 0 / stage 1)"
        bench.table(column_table(columns, rows, align="r" * 7), title)


DEFAULTS = {  # experiment -> its defaults of the options both have (given on the command line: those)
    "2bw": dict(rounds=3, warmup=5, budget=300.0, microbatches=[2, 8], profile_repeats=30),
    "avgpipe": dict(rounds=2, warmup=4, budget=600.0, microbatches=[2, 4], profile_repeats=20),
}


def main() -> None:
    quick = dict(microbatches=[2], depths=[2], emu_factors=[1], emu_steps=2, emu_warmup=1, emu_repeats=1, profile_repeats=3, staleness=[1])
    quick.update(dict.fromkeys(("pipelines", "stale_pipelines", "malloc_pipelines", "malloc_microbatches"), [2]))
    common = dict(steps=20, retries=2, max_foreign=0.1, quiet_wait=10.0, timeout=300.0, pin=False)
    bench = Bench(__doc__, quick, threads=1, **common, **dict.fromkeys(("rounds", "warmup", "budget")))
    bench.experiment(DEFAULTS)
    bench.parser.add_argument("--microbatches", type=ints, help="m values: 2bw's real part (>= 2; 2,8), avgpipe's per pipeline (2,4)")
    bench.parser.add_argument("--profile-repeats", type=int, help="2bw: 30, avgpipe: 20")
    bench.parser.add_argument("--part", choices=["real", "emulated", "all"], default="all", help="2bw")
    bench.options(rows=(64, "2bw: rows per micro-batch, both parts"), depths=([2, 4, 8], "2bw emulated part: d = processes"))
    bench.options(tf=(5.0, "2bw emulated part: forward sleep per stage, ms (backward 2x)"))
    # 2bw's emulated part: m = factor x d, one run each
    bench.parser.set_defaults(emu_factors=[1, 4], emu_steps=8, emu_warmup=2, emu_repeats=1)
    bench.options(pipelines=([1, 2, 4], "avgpipe: N values"), staleness=([1, 2], "avgpipe: staleness bounds s besides 0, at M = 4"))
    bench.options(stale_pipelines=([2, 4], "avgpipe: N of the staleness runs"))
    bench.options(malloc_pipelines=([2, 4], "avgpipe: N values run again with glibc malloc keeping freed memory"))
    bench.options(malloc_microbatches=([4], "avgpipe: M values of the malloc runs ('' for none)"))
    args = bench.parse()
    (two_bw if args.experiment == "2bw" else avgpipe)(bench, args)
    bench.finish()


if __name__ == "__main__":
    main()
