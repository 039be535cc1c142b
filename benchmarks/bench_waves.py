"""Wave (Hanayo) and interleaved 1F1B vs our 1F1B vs torch.distributed.pipelining's multi-chunk schedules.

Every run trains bench_runtime.py's balanced residual MLP (lightning_pipe.bench.mlp; default 16
blocks, hidden 512, float32, MSE, SGD) on the same batches of m micro-batches of --rows rows, on 2
gloo processes with one thread each:

- ``ours-1f1b``          SequentialPipeline over build_schedule("1f1b", 2, m): 8 blocks per rank;
- ``ours-wave{W}``       build_schedule("wave", 2, m, waves=W): 4W chunks of 16/4W blocks, placed
                         down and up the 2 ranks W times (rank 0 holds chunks 0, 3, 4, 7, ...);
- ``ours-interleaved{v}`` build_schedule("interleaved", 2, m, chunks=v): 2v chunks round-robin;
- ``torch-interleaved``  PipelineStage x 4 (4 blocks each; rank r holds stages r and r + 2) with
                         ScheduleInterleaved1F1B;
- ``torch-zbv``          the same 4 stages in the V placement (rank 0: stages 0 and 3, rank 1:
                         stages 1 and 2) with ScheduleZBVZeroBubble (backward split into input and
                         weight gradients, the weight part filling bubbles).

All multi-chunk schedules of ours and torch's cut the model into equal block ranges. A step is
forward, backward and SGD step; samples/s = steps x batch / wall time of the timed steps, best of
--repeats interleaved runs. Every run's final weights are compared with a one-process run on the
same data (bench_runtime's ``single``).

Simulated speed-ups: first a 2-process job measures the link (lightning_pipe.bench.launch.ping_pong: isend /
irecv as our Transport uses them, 4 B and the one message size of this model, an activation of
rows x hidden floats) and profiles every block at the micro-batch size on both ranks at once
(lightning_pipe.profiling.profile_blocks; the MSE loss is profiled as an extra block and folded into
the last block). lightning_pipe.simulate replays each of our schedules on that CostModel; the
simulated step is the simulated iteration plus the measured optimizer step (the same for every
schedule: each rank holds half the weights in all of them).

Our runs are traced per action (Executor trace=True) and the time the compute thread spends inside
isend / irecv is counted, which splits each rank's step into compute, issuing and waiting, next to
the simulator's busy and idle time, and each message's hand-off delay (how long after it was sent
the compute that needs it started, when that compute waited for it). From those traces four
corrections are fitted (`calibrate`: compute x k, a fixed cost per compute action, a cost per
message on the compute thread, the mean hand-off delay as the link latency) and the simulator is
run again on the corrected costs ("simulated, calibrated"): how much of the gap between measured
and simulated those effects explain. The iteration-time table adds three variants of the simulator,
each with one input replaced: every chunk's compute at its median in the run's traces; the message
terms fitted from the traces (`calibrate`'s o and h); the setup's hand-off distribution sampled per
message (`MessageCosts.handoff_sampler`, mean of SAMPLES replays) instead of its mean.

    python benchmarks/bench_waves.py --simulated            # the order table of docs/schedules.md (seconds)
    python benchmarks/bench_waves.py                        # m = 4 and m = 2, a few minutes
    python benchmarks/bench_waves.py --picture docs/img/waves_speedup.png   # as in docs/schedules.md
    python benchmarks/bench_waves.py --microbatches 4 --modes ours-1f1b,ours-wave4,torch-zbv

``--simulated`` runs no process: it prints, from the simulator alone, the bubble ratio, iteration
time and peak activation memory of Hanayo's own wave order (``hanayo``), our greedy order
(``wave``) and 1F1B for P = 2, 4, 8, W = 1, 2, 4, B = P, 2P, 4P: T_B = 2 T_F, no communication, the
model cut into equal chunks (a chunk's time and activation shrink with the number of chunks), peak
activations in units of one 1F1B stage's activation of one micro-batch (`Timeline.peak_activation_bytes`).
The column "units one by one" is Hanayo's order without filling a unit's end with the next unit's
forwards (`merge_by_readiness(fill=False)`), for comparison.

Timing hygiene as bench_runtime.py (lightning_pipe.bench.launch.run_undisturbed): each run waits for a
quiet machine, measures the CPU other processes used meanwhile and repeats disturbed runs; every
run is killed after --timeout seconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lightning_pipe.bench.launch import machine_description, run_undisturbed, timed_steps  # noqa: E402
from lightning_pipe.bench.mlp import MSEBlock, keep_blocks, loss_fn, make_data, make_model, max_rel_error, single_job, summarize  # noqa: E402
from lightning_pipe.profiling.link import ping_pong  # noqa: E402

OURS = {  # mode suffix -> (schedule name, options)
    "1f1b": ("1f1b", {}),
    "wave1": ("wave", {"waves": 1}),
    "wave2": ("wave", {"waves": 2}),
    "wave4": ("wave", {"waves": 4}),
    "interleaved2": ("interleaved", {"chunks": 2}),
    "interleaved4": ("interleaved", {"chunks": 4}),
}
TORCH = ("interleaved", "zbv")
SAMPLES = 30  # replays with sampled hand-offs per schedule
MODES = ["single"] + [f"ours-{k}" for k in OURS] + [f"torch-{k}" for k in TORCH]
MULTI_OURS = [f"ours-{k}" for k in OURS if k != "1f1b"]
MULTI_TORCH = [f"torch-{k}" for k in TORCH]


def our_schedule(name: str, m: int, blocks: int):
    """Our schedule `name` (an OURS key) on 2 ranks and its chunks' block ranges (equal chunks)."""
    from lightning_pipe.planning import partition_blocks
    from lightning_pipe.schedules import build_schedule

    sched_name, options = OURS[name]
    schedule = build_schedule(sched_name, 2, m, **options)
    return schedule, [tuple(b) for b in partition_blocks("uniform", blocks, schedule.num_chunks).bounds]


# ---- workers (run in the spawned processes) ----------------------------------------------------
def _ours_multi(rank: int, cfg: dict, name: str) -> dict:
    from lightning_pipe.runtime.p2p import Transport
    from lightning_pipe.runtime.sequential import SequentialHost, SequentialPipeline

    model = make_model(cfg)
    data = make_data(cfg)
    schedule, bounds = our_schedule(name, cfg["microbatches"], cfg["blocks"])
    mine = schedule.chunks_of(rank)
    chunks = {c: model[bounds[c][0] : bounds[c][1]] for c in mine}

    class TimedTransport(Transport):
        """Counts the time the compute thread spends inside isend / irecv (issuing, not waiting)."""

        issuing = 0.0

        def issue(self, ops):
            t = time.perf_counter()
            try:
                return super().issue(ops)
            finally:
                TimedTransport.issuing += time.perf_counter() - t

    host = SequentialHost(chunks, schedule.num_chunks - 1, loss_fn)
    pipe = SequentialPipeline(schedule, rank, host, TimedTransport(lambda r: r, torch.device("cpu")))
    pipe.executor.trace = True  # a few perf_counter calls per action: negligible next to ms computes
    actions = pipe.executor.actions
    params = [p for c in chunks.values() for p in c.parameters()]
    opt = torch.optim.SGD(params, lr=cfg["lr"])
    steps: list[dict] = []

    def step(i: int) -> None:
        x, y = data[i % len(data)]
        TimedTransport.issuing = 0.0
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        pipe.step(x, y)
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        # absolute perf_counter times (CLOCK_MONOTONIC: one clock for both processes), so a
        # receiver's compute can be matched with the peer's send of its input
        computes = [
            (actions[j].op.value, actions[j].chunk, actions[j].microbatch, s, e)
            for j, s, e in pipe.executor.records
            if actions[j].op.is_compute
        ]
        sends = [
            (actions[j].op.value, actions[j].chunk, actions[j].microbatch, s) for j, s, _ in pipe.executor.records if actions[j].op.is_send
        ]
        steps.append({"t0": t0, "pipe": t1 - t0, "opt": t2 - t1, "issue": TimedTransport.issuing, "computes": computes, "sends": sends})

    timing = timed_steps(step, cfg["steps"], cfg["warmup"], dist.barrier)
    blocks = {i for c in mine for i in range(*bounds[c])}
    return {"timing": timing, "params": keep_blocks(model, blocks), "trace": steps[cfg["warmup"] :]}


def _torch_multi(rank: int, cfg: dict, name: str) -> dict:
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B, ScheduleZBVZeroBubble

    model = make_model(cfg)
    data = make_data(cfg)
    m, n = cfg["microbatches"], 4
    per = cfg["blocks"] // n
    # loop placement for interleaved (stage s on rank s % 2), V placement for ZBV (0,3 | 1,2)
    mine = [rank, rank + 2] if name == "interleaved" else [rank, n - 1 - rank]
    shape = (cfg["batch"] // m, cfg["hidden"])
    stages = [
        PipelineStage(
            model[s * per : (s + 1) * per],
            s,
            n,
            torch.device("cpu"),
            input_args=(torch.empty(shape, requires_grad=s > 0),),  # static shapes: no inference
            output_args=(torch.empty(shape, requires_grad=True),),
        )
        for s in sorted(mine)
    ]
    cls = ScheduleInterleaved1F1B if name == "interleaved" else ScheduleZBVZeroBubble
    schedule = cls(stages, m, loss_fn=loss_fn)  # scale_grads=True: mean over micro-batches, as ours
    params = [p for s in stages for p in s.submod.parameters()]
    opt = torch.optim.SGD(params, lr=cfg["lr"])

    def step(i: int) -> None:
        x, y = data[i % len(data)]
        opt.zero_grad(set_to_none=True)
        args = (x,) if 0 in mine else ()
        kwargs = {"target": y} if n - 1 in mine else {}
        schedule.step(*args, return_outputs=False, **kwargs)
        opt.step()

    timing = timed_steps(step, cfg["steps"], cfg["warmup"], dist.barrier)
    blocks = {i for s in mine for i in range(s * per, (s + 1) * per)}
    return {"timing": timing, "params": keep_blocks(model, blocks)}


def _profile(rank: int, cfg: dict) -> dict:
    """Link fit, per-block profile (both ranks profiling at once, as they compute in training) and
    the message costs as the strategy measures them at setup (lightning_pipe.profiling.messages)."""
    from lightning_pipe.profiling import profile_blocks
    from lightning_pipe.profiling.messages import measure_messages

    # Every message here is one float32 micro-batch activation: fit the link on exactly that size
    # (a fit over 4 B..1 MB swung between 0.4 and 7 GB/s from run to run on this machine). Even a
    # quiet ping-pong has phases where the median round trip is a 2 ms stall (see the docs), so the
    # fastest of three rounds is kept: the simulator gets the link as it is without those stalls.
    rounds = [ping_pong(rank, sizes=(4, cfg["rows"] * cfg["hidden"] * 4), repeats=50) for _ in range(3)]
    link = min(rounds, key=lambda r: r["samples"][-1][1]) if rank == 0 else None
    model = make_model(cfg)
    x, y = make_data(cfg)[0]
    rows = cfg["rows"]
    dist.barrier()
    blocks = list(model) + [MSEBlock(y[:rows])]
    if cfg["profile_chain"]:  # as the strategy profiles: the blocks back to back, 2 micro-batches in flight
        measured = profile_blocks(blocks, x[:rows], torch.device("cpu"), repeats=cfg["profile_repeats"] // 3, warmup=2, inflight=2)
    else:
        measured = profile_blocks(blocks, x[:rows], torch.device("cpu"), repeats=cfg["profile_repeats"], warmup=3)
    think = sum(v["forward"] for v in measured.values()) / 2  # a stage's forward: the work between two hops
    messages = measure_messages([0, 1], rows * cfg["hidden"] * 4, torch.device("cpu"), think=min(max(think, 2e-4), 5e-3))
    parts: list = [None] * 2
    dist.all_gather_object(parts, measured)
    return {"timing": [1.0, 1.0], "params": {}, "link": link, "blocks": parts, "messages": messages.to_dict()}


def job(rank: int, world: int, mode: str, cfg: dict) -> dict:
    """What a process of `mode` runs: ``single`` (1 process), ``ours-profile`` (the link fit and
    the profile), ``ours-*`` / ``torch-*`` (2 processes)."""
    if mode == "single":
        return single_job(rank, world, cfg)
    if mode == "ours-profile":
        return _profile(rank, cfg)
    if mode.startswith("ours-"):
        return _ours_multi(rank, cfg, mode[len("ours-") :])
    return _torch_multi(rank, cfg, mode[len("torch-") :])


# ---- parent: analysis ---------------------------------------------------------------------------
def build_costs(prof: dict):
    """CostModel from the profile job: per block the median of the two ranks; loss folded into the last block."""
    from lightning_pipe.profiling import Profile

    parts, n = prof["blocks"], len(prof["blocks"][0]) - 1
    field = lambda key: [statistics.median(p[i][key] for p in parts) for i in range(n + 1)]  # noqa: E731
    fwd, bwd = field("forward"), field("backward")
    loss = (fwd.pop(), bwd.pop())
    fwd[-1] += loss[0]
    bwd[-1] += loss[1]
    profile = Profile("residual-mlp", 0, "float32", "cpu", fwd, bwd, field("activation_bytes")[:n], field("param_bytes")[:n])
    profile.messages = prof["messages"]
    link = prof["link"]
    return profile.costs(link["bandwidth"], link["latency"]), loss


def profile_messages(prof: dict):
    from lightning_pipe.profiling.messages import MessageCosts

    return MessageCosts.from_dict(prof["messages"])


def link_only(costs):
    """The same costs without the message terms: the link model alone (as before 2026-11-25)."""
    from dataclasses import replace

    return replace(costs, send_overhead=0.0, recv_overhead=0.0, handoff_delay=0.0)


def measured_compute_iteration(schedule, costs, bounds, per_op: dict) -> float:
    """The simulator with each chunk's forward / backward at its median in this run's traces instead
    of the sum of its blocks' profiled times (message terms as measured at setup): how much of the
    error is the computes' and how much the rest's (messages, hand-offs)."""
    from dataclasses import replace

    from lightning_pipe.simulation import simulate

    n = len(bounds)
    chunks = replace(
        costs,
        forward=tuple(statistics.median(per_op[("F", c)]) for c in range(n)),
        backward=tuple(statistics.median(per_op[("B", c)]) for c in range(n)),
        activation_bytes=tuple(costs.activation_bytes[hi - 1] for _, hi in bounds) if costs.activation_bytes else (),
        param_bytes=(),
    )
    return simulate(schedule, chunks, [(c, c + 1) for c in range(n)], critical_path=False).iteration_time


def trace_summary(results: list[dict], schedule, costs, bounds) -> dict:
    """Measured per-rank compute / wait per pipeline step (median over timed steps) next to the simulator's."""
    from lightning_pipe.simulation import chunk_costs, simulate

    t = simulate(schedule, costs, bounds)
    f, b, _ = chunk_costs(costs, bounds)
    out = {
        "sim_iter": t.iteration_time,
        "sim_iter_link_only": simulate(schedule, link_only(costs), bounds, critical_path=False).iteration_time,
        "sim_busy": list(t.busy),
        "pipe": [],
        "busy": [],
        "opt": [],
        "issue": [],
        "inflation": {},
        "messages": [sum(a.op.is_send or a.op.is_recv for a in acts) for acts in schedule.actions],
        "computes": [sum(a.op.is_compute for a in acts) for acts in schedule.actions],
    }
    per_op: dict[tuple[str, int], list[float]] = {}
    for r in results:
        steps = r["trace"]
        out["pipe"].append(statistics.median(s["pipe"] for s in steps))
        out["busy"].append(statistics.median(sum(e - s for _, _, _, s, e in st["computes"]) for st in steps))
        out["opt"].append(statistics.median(s["opt"] for s in steps))
        out["issue"].append(statistics.median(s["issue"] for s in steps))
        for st in steps:
            for op, c, _, s, e in st["computes"]:
                per_op.setdefault((op, c), []).append(e - s)
    out["sim_iter_measured_compute"] = measured_compute_iteration(schedule, costs, bounds, per_op)
    out["handoff"] = handoff_delays(results)
    out["steps"] = len(results[0]["trace"])
    # measured / profiled time of the same compute, forward and backward separately
    for op, prof in (("F", f), ("B", b)):
        ratios = [statistics.median(v) / prof[c] for (o, c), v in per_op.items() if o == op]
        out["inflation"][op] = statistics.median(ratios)
    return out


def handoff_delays(results: list[dict]) -> list[float]:
    """For every compute whose input came from the other rank: how long after both its input was
    sent and its rank's previous compute ended it started (seconds; 0 if it did not wait for the
    message). That is the message's cost on the critical path: the consumer's own isend / irecv
    calls, the transfer and the thread wake-ups. The simulator charges a quiet link's latency."""
    delays = []
    for step in zip(*(r["trace"] for r in results)):
        sent = {(op, c, mb): t for st in step for op, c, mb, t in st["sends"]}
        for st in step:
            ready = st["t0"]
            for op, c, mb, start, end in st["computes"]:
                key = ("SEND_F", c - 1, mb) if op == "F" else ("SEND_B", c + 1, mb)
                if key in sent:
                    delays.append(max(0.0, start - max(sent[key], ready)))
                ready = end
    return delays


def calibrate(traces: dict) -> tuple[float, float, float, float]:
    """What this run's traces say the profile and the quiet link miss, as four numbers:
    k, the measured / profiled compute time (both ranks computing, weights cycling through the cache);
    a, a fixed cost per compute action (Python, autograd call, boundary tensors), fitted with k by
    least squares of measured compute = k x profiled compute + a x computes over our schedules;
    o, the compute thread's time inside isend / irecv per message (median over our schedules);
    h, the mean hand-off delay of a message (`handoff_delays`, over all our schedules' messages)
    less o (the consumer's own isend / irecv, already in o): the link latency training sees."""
    rows = [(statistics.mean(t["sim_busy"]), statistics.mean(t["computes"]), statistics.mean(t["busy"])) for t in traces.values()]
    sxx = sum(x * x for x, _, _ in rows)
    sxn = sum(x * n for x, n, _ in rows)
    snn = sum(n * n for _, n, _ in rows)
    sxy = sum(x * y for x, _, y in rows)
    sny = sum(n * y for _, n, y in rows)
    det = sxx * snn - sxn * sxn
    k, a = ((sxy * snn - sny * sxn) / det, (sxx * sny - sxn * sxy) / det) if det > 0 else (0.0, 0.0)
    if k <= 0 or a < 0:  # degenerate fit: compute scales only
        k, a = sum(y for _, _, y in rows) / sum(x for x, _, _ in rows), 0.0
    o = statistics.median(statistics.mean(t["issue"]) / statistics.mean(t["messages"]) for t in traces.values())
    h = statistics.mean(d for t in traces.values() for d in t["handoff"])
    return k, a, o, max(h - o, 0.0)


def calibrated_iteration(costs, schedule, bounds, k: float, a: float, o: float, h: float) -> float:
    """The simulator on costs corrected by `calibrate`: block times x k, a per compute action (on the
    chunk's first block), o on the compute that sends or receives each message, link latency h."""
    from lightning_pipe.simulation import CostModel, simulate

    f = [x * k for x in costs.forward]
    b = [x * k for x in costs.backward]
    last = len(bounds) - 1
    for c, (lo, hi) in enumerate(bounds):
        here = schedule.chunk_rank[c]
        f[lo] += a
        b[lo] += a
        if c > 0 and schedule.chunk_rank[c - 1] != here:  # receives its input, sends its input gradient
            f[lo] += o
            b[lo] += o
        if c < last and schedule.chunk_rank[c + 1] != here:  # sends its output, receives its gradient
            f[hi - 1] += o
            b[hi - 1] += o
    adjusted = CostModel(tuple(f), tuple(b), costs.activation_bytes, costs.param_bytes, latency=h)
    return simulate(schedule, adjusted, bounds, critical_path=False).iteration_time


def run_mode(mode: str, cfg: dict, args: Any, started: float) -> tuple[list[dict], float]:
    """One run, waiting for a quiet machine and repeating a disturbed run (bench_runtime's policy)."""
    world = 1 if mode == "single" else 2
    return run_undisturbed(
        job,
        world,
        mode,
        cfg,
        retries=args.retries,
        max_foreign=args.max_foreign,
        quiet_wait=args.quiet_wait,
        patient=time.monotonic() - started < args.budget,
        label=f"{mode:18s}",
        timeout=args.timeout,
        backend="gloo" if world > 1 else None,
        pin=cfg["pin"],
    )


def simulated_orders() -> None:
    """The table of docs/schedules.md: Hanayo's order vs our greedy order vs 1F1B, simulated."""
    import subprocess

    from lightning_pipe.schedules import build_schedule
    from lightning_pipe.schedules.lowering import lower
    from lightning_pipe.schedules.wave import wave_placement
    from lightning_pipe.schedules.wave_hanayo import hanayo_order
    from lightning_pipe.simulation import CostModel, simulate

    def run(schedule, p):
        n = schedule.num_chunks
        scale = p / n  # the whole model: p x (1 + 2) per micro-batch; activations p per micro-batch
        costs = CostModel.uniform(n, scale, 2 * scale, activation_bytes=(scale,) * n)
        return simulate(schedule, costs, [(i, i + 1) for i in range(n)])

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {machine_description()}; commit {commit}")
    print("T_B = 2 T_F, no communication, equal chunks; time in units of one stage's T_F (1F1B: (B + P - 1) x 3);")
    print("peak = the fullest rank's activations, in 1F1B stage activations of one micro-batch\n")
    print(
        "| P | W | B | bubble 1F1B | bubble Hanayo | bubble ours | time 1F1B | Hanayo / 1F1B | ours / 1F1B | "
        "peak 1F1B | peak Hanayo | peak ours | units one by one: time / 1F1B, peak | faster order |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    summary = {"hanayo": 0, "ours": 0, "tie": 0}
    over = []
    for p in (2, 4, 8):
        for w in (1, 2, 4):
            for b in (p, 2 * p, 4 * p):
                one = run(build_schedule("1f1b", p, b), p)
                paper = run(build_schedule("hanayo", p, b, waves=w), p)
                ours = run(build_schedule("wave", p, b, waves=w), p)
                strict = run(lower("strict", hanayo_order(p, b, w, fill=False), wave_placement(p, w), b), p)
                peaks = [max(t.peak_activation_bytes) for t in (one, paper, ours, strict)]
                tp, to = paper.iteration_time, ours.iteration_time
                faster = "tie" if abs(tp - to) < 1e-9 else ("hanayo" if tp < to else "ours")
                summary[faster] += 1
                if b == p and peaks[1] > peaks[0] + 1e-9:
                    over.append((p, w, b))
                print(
                    f"| {p} | {w} | {b} | {one.bubble_ratio:.3f} | {paper.bubble_ratio:.3f} | {ours.bubble_ratio:.3f} | "
                    f"{one.iteration_time:.2f} | {tp / one.iteration_time:.3f} | {to / one.iteration_time:.3f} | "
                    f"{peaks[0]:.2f} | {peaks[1]:.2f} | {peaks[2]:.2f} | "
                    f"{strict.iteration_time / one.iteration_time:.3f}, {peaks[3]:.2f} | {faster} |"
                )
    print(f"\nfaster order over the {sum(summary.values())} cases: {summary}")
    print(f"B = P cases where Hanayo's peak activations exceed 1F1B's: {over or 'none'}")
    same = [
        (p, w, b)
        for p in (2, 4, 8)
        for w in (1, 2, 4)
        for b in (p, 2 * p, 4 * p)
        if build_schedule("hanayo", p, b, waves=w).actions == build_schedule("wave", p, b, waves=w).actions
    ]
    print(f"(P, W, B) where both orders give the same action lists: {same or 'none'}")
    print("\nHanayo's closed form (2P - 2) / (3PW + P - 1) (Eq. 1, T_B = 2 T_F, T_C = 0) vs the simulated bubble of its order, B = P:\n")
    print("| P | W | simulated | closed form | difference | relative to the simulated |")
    print("|---|---|---|---|---|---|")
    for p in (2, 4, 8):
        for w in (1, 2, 4):
            sim = run(build_schedule("hanayo", p, p, waves=w), p).bubble_ratio
            closed = (2 * p - 2) / (3 * p * w + p - 1)
            print(f"| {p} | {w} | {sim:.4f} | {closed:.4f} | {closed - sim:+.4f} | {(closed - sim) / sim:+.1%} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--mlp-ratio", type=int, default=1)
    p.add_argument("--blocks", type=int, default=16, help="a multiple of 16 (wave W=4 on 2 ranks has 16 chunks)")
    p.add_argument("--rows", type=int, default=64, help="rows per micro-batch (batch = rows x m)")
    p.add_argument("--microbatches", default="4,2", help="comma-separated m values to run")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3, help="runs per mode and m (interleaved); the best is reported")
    p.add_argument("--retries", type=int, default=2)
    p.add_argument("--max-foreign", type=float, default=0.1)
    p.add_argument("--budget", type=float, default=300.0, help="seconds after which nobody is waited for any more")
    p.add_argument("--quiet-wait", type=float, default=10.0)
    p.add_argument("--profile-repeats", type=int, default=30)
    p.add_argument("--profile-alone", action="store_true", help="profile each block alone (before 2026-11-25) instead of chained")
    p.add_argument("--pin", action="store_true")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--picture", default=None, help="write a bar chart of samples/s here (matplotlib)")
    p.add_argument("--simulated", action="store_true", help="print the simulated order table (Hanayo vs ours vs 1F1B) and exit")
    args = p.parse_args()
    if args.simulated:
        simulated_orders()
        return
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if [m for m in modes if m not in MODES]:
        p.error(f"unknown modes; allowed: {MODES}")
    if "single" not in modes:
        modes.insert(0, "single")
    if "ours-1f1b" not in modes:
        modes.insert(1, "ours-1f1b")
    if args.blocks % 16:
        p.error("--blocks must be a multiple of 16")
    ms = [int(v) for v in args.microbatches.split(",")]
    if any(m % 2 for m in ms):
        p.error("--microbatches: interleaved needs a multiple of the 2 ranks")
    base = dict(
        hidden=args.hidden,
        mlp_ratio=args.mlp_ratio,
        blocks=args.blocks,
        rows=args.rows,
        steps=args.steps,
        warmup=args.warmup,
        lr=args.lr,
        pin=args.pin,
        profile_repeats=args.profile_repeats,
        profile_chain=not args.profile_alone,
    )
    print(f"{machine_description()}; 2 processes x 1 thread, gloo; {base}", flush=True)
    started = time.monotonic()

    prof, foreign = run_mode("ours-profile", dict(base, microbatches=1, batch=args.rows), args, started)
    costs, loss = build_costs(prof[0])
    link = prof[0]["link"]
    print(
        f"profile (foreign load {foreign:.2f}): per block f {1e3 * statistics.median(costs.forward):.2f} ms, "
        f"b {1e3 * statistics.median(costs.backward):.2f} ms; loss f+b {1e3 * sum(loss):.2f} ms; "
        f"link latency {1e6 * link['latency']:.0f} us, {link['bandwidth'] / 1e9:.2f} GB/s",
        flush=True,
    )
    print(f"messages (lightning_pipe.profiling.messages, as at the strategy's setup): {profile_messages(prof[0]).summary()}", flush=True)

    tables = {}
    for m in ms:
        cfg = dict(base, microbatches=m, batch=args.rows * m)
        best: dict[str, dict] = {}
        errors: dict[str, float] = {}
        traces: dict[str, dict] = {}
        reference = None
        for rep in range(args.repeats):
            for mode in modes:
                results, foreign = run_mode(mode, cfg, args, started)
                stats = summarize(mode, results, cfg)
                stats["foreign"] = foreign
                if mode == "single":
                    reference = reference or results[0]["params"]
                else:
                    errors[mode] = max(errors.get(mode, 0.0), max_rel_error(results, reference))
                print(
                    f"  m={m} run {rep + 1}/{args.repeats} {mode:18s} {stats['total']:8.1f} samples/s "
                    f"({stats['step_ms']:.1f} ms/step, foreign {foreign:.2f})",
                    flush=True,
                )
                if mode not in best or stats["total"] > best[mode]["total"]:
                    best[mode] = stats
                    if mode.startswith("ours-"):
                        schedule, bounds = our_schedule(mode[len("ours-") :], m, args.blocks)
                        traces[mode] = trace_summary(results, schedule, costs, bounds)
        calibrated = report(m, dict(cfg, repeats=args.repeats), best, errors, traces, costs, profile_messages(prof[0]))
        tables[m] = (best, errors, traces, calibrated)
    print(f"\ntotal {time.monotonic() - started:.0f} s")
    if args.picture:
        picture(tables, args.picture)


def report(m: int, cfg: dict, best: dict, errors: dict, traces: dict, costs, messages) -> dict:
    """Print the tables of one m; return the calibrated simulated speed-ups (for the picture)."""
    one = best["ours-1f1b"]["total"]
    opt = max(traces["ours-1f1b"]["opt"])  # the same optimizer work in every schedule (half the weights per rank)
    sim_one = traces["ours-1f1b"]["sim_iter"] + opt
    k, a, o, h = calibrate(traces)
    calibrated = {}
    for mode in traces:
        schedule, bounds = our_schedule(mode[len("ours-") :], m, cfg["blocks"])
        calibrated[mode] = calibrated_iteration(costs, schedule, bounds, k, a, o, h) + opt
    print(
        f"\nm = {m}, batch {cfg['batch']} ({cfg['rows']}-row micro-batches), {cfg['blocks']} blocks, hidden {cfg['hidden']}; "
        f"best of {cfg['repeats']} runs; simulated step = simulated iteration + {1e3 * opt:.1f} ms optimizer step; "
        f"link {1e6 * costs.latency:.0f} us + {costs.bandwidth / 1e9:.2f} GB/s (quiet ping-pong); calibrated on this run's traces: "
        f"compute x {k:.2f}, {1e6 * a:.0f} us per compute, {1e6 * o:.0f} us per message in isend/irecv, latency {1e6 * h:.0f} us\n"
    )
    print(
        "| schedule | chunks/rank | samples/s | ms/step | vs single | measured speed-up vs our 1F1B | simulated | "
        "measured gain / simulated gain | simulated, calibrated | weights vs single | other load |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode, s in best.items():
        chunks = {"single": "", "torch-interleaved": 2, "torch-zbv": 2}.get(mode)
        meas = s["total"] / one
        sim = gain = cal = ""
        if mode in traces:
            cal = f"{calibrated['ours-1f1b'] / calibrated[mode]:.3f}"
            t = traces[mode]
            sched, _ = our_schedule(mode[len("ours-") :], m, cfg["blocks"])
            chunks = len(sched.chunks_of(0))
            simulated = sim_one / (t["sim_iter"] + opt)
            sim = f"{simulated:.3f}"
            if mode != "ours-1f1b":
                gain = f"{(meas - 1) / (simulated - 1):.0%}" if simulated > 1 else ""
        err = f"{errors[mode]:.1e}" if mode in errors else ""
        print(
            f"| {mode} | {chunks} | {s['total']:.1f} | {s['step_ms']:.1f} | {s['total'] / best['single']['total']:.2f}x | "
            f"{'' if mode == 'single' else f'{meas:.3f}'} | {sim} | {gain} | {cal} | {err} | {s['foreign']:.2f} |"
        )
    ours = max(MULTI_OURS, key=lambda k: best[k]["total"] if k in best else 0)
    theirs = max(MULTI_TORCH, key=lambda k: best[k]["total"] if k in best else 0)
    if ours in best and theirs in best:
        print(f"\nour best multi-chunk ({ours}) / torch's best multi-chunk ({theirs}): {best[ours]['total'] / best[theirs]['total']:.3f}x")
    print(
        "\niteration time (the pipeline's step without the optimizer), measured (median step, the slower rank) vs simulated "
        "on the profile with the link model alone and with the measured message costs:\n"
    )
    # the message terms as this run's traces show them (calibrate's o and h), instead of the setup's
    from dataclasses import replace

    from lightning_pipe.simulation import simulate

    traced = replace(costs, send_overhead=o, recv_overhead=o, handoff_delay=max(h - costs.comm_time(0) + costs.handoff_delay, 0.0))
    # the setup's hand-off distribution sampled per message (mean of SAMPLES replays) instead of its mean
    import random

    sampled_costs, rng = replace(costs, handoff_delay=0.0), random.Random(0)
    draw = messages.handoff_sampler(costs, rng)
    print(
        "| schedule | measured ms | simulated, link only | error | simulated, with message costs | error | "
        "the same, each chunk's compute as measured in the run | error | with the message terms of this run's traces | error | "
        f"setup's hand-offs sampled per message (mean of {SAMPLES}) | error |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode, t in traces.items():
        measured = max(t["pipe"])
        plain, full, computes = t["sim_iter_link_only"], t["sim_iter"], t["sim_iter_measured_compute"]
        schedule, bounds = our_schedule(mode[len("ours-") :], m, cfg["blocks"])
        from_traces = simulate(schedule, traced, bounds, critical_path=False).iteration_time
        sampled = statistics.fmean(
            simulate(schedule, sampled_costs, bounds, critical_path=False, delays=draw).iteration_time for _ in range(SAMPLES)
        )
        print(
            f"| {mode} | {1e3 * measured:.1f} | {1e3 * plain:.1f} | {plain / measured - 1:+.1%} | {1e3 * full:.1f} | "
            f"{full / measured - 1:+.1%} | {1e3 * computes:.1f} | {computes / measured - 1:+.1%} | {1e3 * from_traces:.1f} | "
            f"{from_traces / measured - 1:+.1%} | {1e3 * sampled:.1f} | {sampled / measured - 1:+.1%} |"
        )
    print("\nper-action trace of the best run (median step, ms; rank 0 / rank 1):\n")
    print(
        "| schedule | messages per rank | simulated iteration | measured pipeline step | simulated compute | measured compute | "
        "simulated idle | measured in isend/irecv | measured waiting + other | compute measured / profiled (F, B) | "
        "hand-off delay: mean, > 1 ms (share, ms per rank-step) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode, t in traces.items():
        pair = lambda v: " / ".join(f"{1e3 * x:.1f}" for x in v)  # noqa: E731
        idle = [t["sim_iter"] - b for b in t["sim_busy"]]
        rest = [pp - b - i for pp, b, i in zip(t["pipe"], t["busy"], t["issue"])]
        late = [d for d in t["handoff"] if d > 1e-3]
        print(
            f"| {mode} | {t['messages'][0]} | {1e3 * t['sim_iter']:.1f} | {pair(t['pipe'])} | {pair(t['sim_busy'])} | "
            f"{pair(t['busy'])} | {pair(idle)} | {pair(t['issue'])} | {pair(rest)} | "
            f"{t['inflation']['F']:.2f}, {t['inflation']['B']:.2f} | {1e3 * statistics.mean(t['handoff']):.2f} ms, "
            f"{len(late) / len(t['handoff']):.0%}, {1e3 * sum(late) / (2 * t['steps']):.1f} ms |"
        )
    return {k: calibrated["ours-1f1b"] / v for k, v in calibrated.items()}


def picture(tables: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {
        "1f1b": "1F1B",
        "wave1": "wave\nW=1",
        "wave2": "wave\nW=2",
        "wave4": "wave\nW=4",
        "interleaved2": "interl.\nv=2",
        "interleaved4": "interl.\nv=4",
        "interleaved": "torch\ninterl.",
        "zbv": "torch\nZBV",
    }
    fig, axes = plt.subplots(1, len(tables), figsize=(6.5 * len(tables), 4), squeeze=False)
    for ax, (m, (best, _, traces, costs_m)) in zip(axes[0], tables.items()):
        names = [k for k in best if k != "single"]
        one = best["ours-1f1b"]["total"]
        opt = max(traces["ours-1f1b"]["opt"])
        sim = {k: (traces["ours-1f1b"]["sim_iter"] + opt) / (t["sim_iter"] + opt) for k, t in traces.items()}
        nan = float("nan")
        xs = list(range(len(names)))
        series = [
            ("measured", [best[k]["total"] / one for k in names], "tab:blue"),
            ("simulated", [sim.get(k, nan) for k in names], "tab:orange"),
            ("simulated, calibrated on the traces", [costs_m.get(k, nan) for k in names], "tab:gray"),
        ]
        for i, (label, values, color) in enumerate(series):
            ax.bar([x + (i - 1) * 0.27 for x in xs], values, 0.27, label=label, color=color)
        ax.axhline(1.0, color="black", lw=0.6)
        ax.set_xticks(xs, [labels[k.split("-", 1)[1]] for k in names], fontsize=8)
        ax.set_ylabel("samples/s relative to our 1F1B")
        shown = [v for _, vals, _ in series for v in vals if v == v]
        ax.set_ylim(min(0.8, min(shown) - 0.05), max(shown) * 1.06)
        ax.set_title(f"2 CPU processes (gloo), 16 blocks, m = {m} micro-batches of 64 rows", fontsize=9)
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
