"""Wave (Hanayo) and interleaved 1F1B vs our 1F1B vs torch.distributed.pipelining's multi-chunk schedules.

bench_runtime's residual MLP on 2 gloo processes x 1 thread: samples/s and weights against one
process, the simulator (on the strategy's kind of profile, and calibrated on the traces), per-action
traces. ``--simulated``: the simulator alone, Hanayo's order vs ours vs 1F1B and the bubble ratios at
B = P. Feeds docs/results/schedules.md and docs/results/predictions.md.

    python -m benchmarks.bench_waves --simulated --pictures docs/img
    flock /tmp/bench.lock python -m benchmarks.bench_waves --picture docs/img/waves_speedup.png
    python -m benchmarks.bench_waves --microbatches 4 --modes ours-1f1b,ours-wave4,torch-zbv
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from benchmarks.harness.bench import Bench, Table, column_table, pyplot, save_figure
from benchmarks.harness.launch import timed_steps
from benchmarks.harness.mlp import MSEBlock, best_runs, keep_blocks, loss_fn, make_data, make_model, single_job, stage_job
from benchmarks.harness.pipes import Clock, best_link, chunk_pipeline, equal_bounds, gather, median_costs
from lightning_pipe.profiling import profile_blocks
from lightning_pipe.profiling.messages import MessageCosts, measure_messages
from lightning_pipe.runtime.p2p import Transport
from lightning_pipe.schedules import build_schedule
from lightning_pipe.schedules.lowering import lower
from lightning_pipe.schedules.wave import wave_placement
from lightning_pipe.schedules.wave_hanayo import hanayo_order
from lightning_pipe.simulation import CostModel, chunk_costs, simulate
from lightning_pipe.simulation.timelines import gantt

OURS = {"1f1b": ("1f1b", {}), **{f"wave{w}": ("wave", {"waves": w}) for w in (1, 2, 4)}}
OURS.update({f"interleaved{v}": ("interleaved", {"chunks": v}) for v in (2, 4)})
TORCH = ("interleaved", "zbv")
SAMPLES = 30  # replays with sampled hand-offs per schedule
MODES = ["single"] + [f"ours-{k}" for k in OURS] + [f"torch-{k}" for k in TORCH]


def our_schedule(name: str, m: int, blocks: int):
    """Our schedule `name` (an OURS key) on 2 ranks and its chunks' block ranges (equal chunks)."""
    schedule = build_schedule(OURS[name][0], 2, m, **OURS[name][1])
    return schedule, equal_bounds(blocks, schedule.num_chunks)


def sim(schedule, costs, bounds, **kw) -> float:
    return simulate(schedule, costs, bounds, critical_path=False, **kw).iteration_time


def _ours(rank: int, cfg: dict, name: str) -> dict:
    """Our schedule, traced per action (perf_counter: one clock for both processes), the compute
    thread's time inside isend / irecv counted."""
    model, data = make_model(cfg), make_data(cfg)
    schedule, bounds = our_schedule(name, cfg["microbatches"], cfg["blocks"])
    transport, clock = Transport(lambda r: r, torch.device("cpu")), Clock()
    transport.issue = clock.wrap(transport.issue, "issue")
    chunks, pipe, opt = chunk_pipeline(model, schedule, bounds, rank, transport, loss_fn, cfg["lr"])
    pipe.executor.trace = True
    acts, steps = pipe.executor.actions, []

    def step(i: int) -> None:
        clock.zero()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        pipe.step(*data[i % len(data)])
        t1 = time.perf_counter()
        opt.step()
        recs = [(acts[j].op, acts[j].chunk, acts[j].microbatch, s, e) for j, s, e in pipe.executor.records]
        steps.append({"t0": t0, "pipe": t1 - t0, "opt": time.perf_counter() - t1, "issue": clock["issue"]})
        steps[-1].update(computes=[(op.value, c, mb, s, e) for op, c, mb, s, e in recs if op.is_compute])
        steps[-1].update(sends=[(op.value, c, mb, s) for op, c, mb, s, _ in recs if op.is_send])

    timing = timed_steps(step, cfg["steps"], cfg["warmup"], dist.barrier)
    return {"timing": timing, "params": keep_blocks(model, {i for c in chunks for i in range(*bounds[c])}), "trace": steps[cfg["warmup"] :]}


def _profile(rank: int, cfg: dict) -> dict:
    """As the strategy profiles: the link at the one message size (fastest of 3 rounds), the blocks
    chained with 2 micro-batches in flight on both ranks at once (the loss as a block), the setup's
    message costs (lightning_pipe.profiling.messages)."""
    rows, nbytes = cfg["rows"], cfg["rows"] * cfg["hidden"] * 4
    link = best_link(rank, (4, nbytes))
    x, y = make_data(cfg)[0]
    dist.barrier()
    blocks = list(make_model(cfg)) + [MSEBlock(y[:rows])]
    measured = profile_blocks(blocks, x[:rows], torch.device("cpu"), repeats=max(1, cfg["profile_repeats"] // 3), warmup=2, inflight=2)
    think = sum(v["forward"] for v in measured.values()) / 2  # a stage's forward: the work between two hops
    messages = measure_messages([0, 1], nbytes, torch.device("cpu"), think=min(max(think, 2e-4), 5e-3))
    return {"link": link, "blocks": gather(measured, 2), "messages": messages.to_dict()}


def job(rank: int, world: int, mode: str, cfg: dict) -> dict:
    if mode in ("single", "profile"):
        return single_job(rank, world, cfg) if mode == "single" else _profile(rank, cfg)
    return _ours(rank, cfg, mode.split("-", 1)[1]) if mode.startswith("ours-") else stage_job(rank, cfg, mode)


def handoff_delays(results: list[dict]) -> list[float]:
    """For every compute whose input came from the other rank: how long after both its input was
    sent and its rank's previous compute ended it started (0 if it did not wait for the message)."""
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


def trace_summary(results: list[dict], schedule, bounds, costs) -> dict:
    """Per rank, medians over the timed steps (pipeline step, compute, optimizer, inside isend /
    irecv), next to the simulator's; the simulator with each chunk's compute as traced; hand-offs."""
    t = simulate(schedule, costs, bounds)
    med = lambda f: [statistics.median(f(s) for s in r["trace"]) for r in results]
    per_op: dict[tuple[str, int], list[float]] = {}
    for r in results:
        for st in r["trace"]:
            for op, c, _, s, e in st["computes"]:
                per_op.setdefault((op, c), []).append(e - s)
    per_chunk = lambda op: tuple(statistics.median(per_op[(op, c)]) for c in range(len(bounds)))
    acts = tuple(costs.activation_bytes[hi - 1] for _, hi in bounds) if costs.activation_bytes else ()
    traced = replace(costs, forward=per_chunk("F"), backward=per_chunk("B"), activation_bytes=acts, param_bytes=())
    f, b, _ = chunk_costs(costs, bounds)
    inflation = lambda op, p: statistics.median(statistics.median(v) / p[c] for (o, c), v in per_op.items() if o == op)
    out = {
        "sim_iter": t.iteration_time,
        "sim_iter_link_only": sim(schedule, replace(costs, send_overhead=0.0, recv_overhead=0.0, handoff_delay=0.0), bounds),
        "sim_iter_measured_compute": sim(schedule, traced, [(c, c + 1) for c in range(len(bounds))]),
        "sim_busy": list(t.busy),
        "pipe": med(lambda s: s["pipe"]),
        "busy": med(lambda s: sum(e - s0 for *_, s0, e in s["computes"])),
        "opt": med(lambda s: s["opt"]),
        "issue": med(lambda s: s["issue"]),
        "inflation": f"{inflation('F', f):.2f}, {inflation('B', b):.2f}",
        "messages": [sum(a.op.is_send or a.op.is_recv for a in acts) for acts in schedule.actions],
        "computes": [sum(a.op.is_compute for a in acts) for acts in schedule.actions],
        "handoff": handoff_delays(results),
    }
    late, n = [d for d in out["handoff"] if d > 1e-3], len(out["handoff"])
    per_step = 1e3 * sum(late) / (2 * len(results[0]["trace"]))  # ms per rank-step
    out["late"] = f"{1e3 * statistics.mean(out['handoff']):.2f} ms, {len(late) / n:.0%}, {per_step:.1f} ms"
    out["messages0"] = out["messages"][0]
    return out


def calibrate(traces: dict) -> tuple[float, float, float, float]:
    """Four corrections from the traces: compute x k and a per compute action (least squares of
    measured = k x profiled + a x actions over our schedules), o per message inside isend / irecv
    (median), h the mean hand-off less o (the link latency training sees)."""
    rows = [(statistics.mean(t["sim_busy"]), statistics.mean(t["computes"]), statistics.mean(t["busy"])) for t in traces.values()]
    dot = lambda i, j: sum(r[i] * r[j] for r in rows)
    sxx, sxn, snn, sxy, sny = dot(0, 0), dot(0, 1), dot(1, 1), dot(0, 2), dot(1, 2)
    det = sxx * snn - sxn * sxn
    k, a = ((sxy * snn - sny * sxn) / det, (sxx * sny - sxn * sxy) / det) if det > 0 else (0.0, 0.0)
    if k <= 0 or a < 0:  # degenerate fit: compute scales only
        k, a = sum(r[2] for r in rows) / sum(r[0] for r in rows), 0.0
    o = statistics.median(statistics.mean(t["issue"]) / statistics.mean(t["messages"]) for t in traces.values())
    h = statistics.mean(d for t in traces.values() for d in t["handoff"])
    return k, a, o, max(h - o, 0.0)


def calibrated_iteration(costs, schedule, bounds, k: float, a: float, o: float, h: float) -> float:
    """The simulator on costs corrected by `calibrate`: block times x k, a per compute action (on the
    chunk's first block), o on the compute that sends or receives each message, link latency h."""
    f, b = [x * k for x in costs.forward], [x * k for x in costs.backward]
    for c, (lo, hi) in enumerate(bounds):
        here = schedule.chunk_rank[c]
        crossings = [(lo, a), (lo, o if c > 0 and schedule.chunk_rank[c - 1] != here else 0.0)]
        crossings.append((hi - 1, o if c < len(bounds) - 1 and schedule.chunk_rank[c + 1] != here else 0.0))
        for block, extra in crossings:
            f[block] += extra
            b[block] += extra
    return sim(schedule, CostModel(tuple(f), tuple(b), costs.activation_bytes, costs.param_bytes, latency=h), bounds)


def report(bench: Bench, m: int, cfg: dict, best: dict, errors: dict, traces: dict, costs, messages) -> list[dict]:
    """The tables of one m, from one record per schedule: its best run, its trace (ours), the simulated
    and calibrated speed-ups over our 1F1B; the records (for the picture)."""
    opt = max(traces["ours-1f1b"]["opt"])  # the same optimizer work in every schedule
    k, a, o, h = calibrate(traces)
    # the message terms as this run's traces show them (o, h), and the setup's hand-offs sampled per message
    from_traces = replace(costs, send_overhead=o, recv_overhead=o, handoff_delay=max(h - costs.comm_time(0) + costs.handoff_delay, 0.0))
    sampled, draw = replace(costs, handoff_delay=0.0), messages.handoff_sampler(costs, random.Random(0))
    recs = [dict(s, **traces.get(mode, {}), mode=mode, error=errors.get(mode)) for mode, s in best.items()]
    one, ours = recs[1], [r for r in recs if r["mode"] in traces]  # modes: single, ours-1f1b, ...
    for r in recs:
        r.update(vs_single=f"{r['total'] / recs[0]['total']:.2f}x", speedup=r["total"] / one["total"])
    recs[0]["speedup"] = None
    for r in ours:
        schedule, bounds = our_schedule(r["mode"][len("ours-") :], m, cfg["blocks"])
        r.update(measured=max(r["pipe"]), sim_step=r["sim_iter"] + opt)
        r["cal_step"] = calibrated_iteration(costs, schedule, bounds, k, a, o, h) + opt
        sims = [r["sim_iter_link_only"], r["sim_iter"], r["sim_iter_measured_compute"], sim(schedule, from_traces, bounds)]
        sims.append(statistics.fmean(sim(schedule, sampled, bounds, delays=draw) for _ in range(SAMPLES)))
        r.update({f"sim{i}": 1e3 * v for i, v in enumerate(sims)} | {f"err{i}": v / r["measured"] - 1 for i, v in enumerate(sims)})
        r.update(simulated=one["sim_step"] / r["sim_step"], calibrated=one["cal_step"] / r["cal_step"])
        r["gain"] = (r["speedup"] - 1) / (r["simulated"] - 1) if r is not one and r["simulated"] > 1 else None
    bench.say(
        f"m = {m}, batch {cfg['batch']} ({cfg['rows']}-row micro-batches), {cfg['blocks']} blocks, hidden {cfg['hidden']}; "
        f"best of {cfg['repeats']} runs; simulated step = simulated iteration + {1e3 * opt:.1f} ms optimizer step; "
        f"link {1e6 * costs.latency:.0f} us + {costs.bandwidth / 1e9:.2f} GB/s (quiet ping-pong); calibrated on this run's traces: "
        f"compute x {k:.2f}, {1e6 * a:.0f} us per compute, {1e6 * o:.0f} us per message in isend/irecv, latency {1e6 * h:.0f} us\n"
    )
    columns = [
        ("schedule", "mode"), ("samples/s", "total", ".1f"), ("ms/step", "step_ms", ".1f"), ("vs single", "vs_single"),
        ("measured speed-up vs our 1F1B", "speedup", ".3f"), ("simulated", "simulated", ".3f"), ("measured gain / simulated gain", "gain", ".0%"),
        ("simulated, calibrated", "calibrated", ".3f"), ("weights vs single", "error", ".1e"), ("other load", "foreign", ".2f"),
    ]  # fmt: skip
    bench.table(column_table(columns, recs))
    top = {k: max((r for r in recs[2:] if r["mode"].startswith(k)), key=lambda r: r["total"], default=None) for k in ("ours-", "torch-")}
    if all(top.values()):
        ratio = top["ours-"]["total"] / top["torch-"]["total"]
        bench.say(f"our best multi-chunk ({top['ours-']['mode']}) / torch's best multi-chunk ({top['torch-']['mode']}): {ratio:.3f}x\n")
    sims = ["simulated, link only", "simulated, with message costs", "the same, each chunk's compute as measured in the run"]
    sims += ["with the message terms of this run's traces", f"setup's hand-offs sampled per message (mean of {SAMPLES})"]
    ms = lambda key: lambda r: " / ".join(f"{1e3 * x:.1f}" for x in r[key]) if isinstance(r[key], list) else f"{1e3 * r[key]:.1f}"
    columns = [("schedule", "mode"), ("measured ms", ms("measured"))]
    columns += [c for i, header in enumerate(sims) for c in ((header, f"sim{i}", ".1f"), ("error", f"err{i}", "+.1%"))]
    title = "iteration time (the pipeline's step without the optimizer), measured (median step, the slower rank) vs simulated"
    bench.table(column_table(columns, ours), title + " on the profile with the link model alone and with the measured message costs:")
    columns = [
        ("schedule", "mode"), ("messages per rank", "messages0"), ("simulated iteration", ms("sim_iter")), ("measured pipeline step", ms("pipe")),
        ("simulated compute", ms("sim_busy")), ("measured compute", ms("busy")), ("measured in isend/irecv", ms("issue")), ("compute measured / profiled (F, B)", "inflation"),
        ("hand-off delay: mean, > 1 ms (share, ms per rank-step)", "late"),
    ]  # fmt: skip
    bench.table(column_table(columns, ours), "per-action trace of the best run (median step, ms; rank 0 / rank 1):")
    return recs


def picture(tables: dict, path: str) -> None:
    labels = {"1f1b": "1F1B", "interleaved": "torch\ninterl.", "zbv": "torch\nZBV"}
    labels.update({f"wave{w}": f"wave\nW={w}" for w in (1, 2, 4)} | {f"interleaved{v}": f"interl.\nv={v}" for v in (2, 4)})
    fig, axes = pyplot().subplots(1, len(tables), figsize=(6.5 * len(tables), 4), squeeze=False)
    series = [("measured", "speedup", "tab:blue"), ("simulated", "simulated", "tab:orange"), ("simulated, calibrated on the traces", "calibrated", "tab:gray")]  # fmt: skip
    for ax, (m, recs) in zip(axes[0], tables.items()):
        recs = recs[1:]  # not the single process
        for i, (label, key, color) in enumerate(series):
            ax.bar([x + (i - 1) * 0.27 for x in range(len(recs))], [r.get(key, float("nan")) for r in recs], 0.27, label=label, color=color)
        ax.axhline(1.0, color="black", lw=0.6)
        ax.set_xticks(range(len(recs)), [labels[r["mode"].split("-", 1)[1]] for r in recs], fontsize=8)
        ax.set_ylabel("samples/s relative to our 1F1B")
        shown = [r[key] for r in recs for _, key, _ in series if key in r]
        ax.set_ylim(min(0.8, min(shown) - 0.05), max(shown) * 1.06)
        ax.set_title(f"2 CPU processes (gloo), 16 blocks, m = {m} micro-batches of 64 rows", fontsize=9)
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    save_figure(fig, path)


def simulated_orders(bench: Bench, pictures: str | None) -> None:
    """The tables of docs/results/schedules.md: Hanayo's order vs our greedy order vs 1F1B, its closed form,
    and the bubble ratios of every schedule at B = P (``pictures``: a folder for their P = 4 timelines)."""

    def run(schedule, p):
        n = schedule.num_chunks
        scale = p / n  # the whole model: p x (1 + 2) per micro-batch; activations p per micro-batch
        return simulate(schedule, CostModel.uniform(n, scale, 2 * scale, activation_bytes=(scale,) * n), [(i, i + 1) for i in range(n)])

    bench.say("T_B = 2 T_F, no communication, equal chunks; time in units of one stage's T_F (1F1B: (B + P - 1) x 3);")
    bench.say("peak = the fullest rank's activations, in 1F1B stage activations of one micro-batch\n")
    table = Table(
        "P", "W", "B", "bubble 1F1B", "bubble Hanayo", "bubble ours", "time 1F1B", "Hanayo / 1F1B", "ours / 1F1B",
        "peak 1F1B", "peak Hanayo", "peak ours", "units one by one: time / 1F1B, peak", "faster order", align="l" * 14,
    )  # fmt: skip
    summary, over, same = {"hanayo": 0, "ours": 0, "tie": 0}, [], []
    cases = [(p, w, b) for p in (2, 4, 8) for w in (1, 2, 4) for b in (p, 2 * p, 4 * p)]
    for p, w, b in cases:
        paper_s, ours_s = build_schedule("hanayo", p, b, waves=w), build_schedule("wave", p, b, waves=w)
        one, paper, ours = run(build_schedule("1f1b", p, b), p), run(paper_s, p), run(ours_s, p)
        strict = run(lower("strict", hanayo_order(p, b, w, fill=False), wave_placement(p, w), b), p)
        peaks = [max(t.peak_activation_bytes) for t in (one, paper, ours, strict)]
        tp, to, t1 = paper.iteration_time, ours.iteration_time, one.iteration_time
        faster = "tie" if abs(tp - to) < 1e-9 else ("hanayo" if tp < to else "ours")
        summary[faster] += 1
        over += [(p, w, b)] if b == p and peaks[1] > peaks[0] + 1e-9 else []
        same += [(p, w, b)] if paper_s.actions == ours_s.actions else []
        bubbles = (f"{t.bubble_ratio:.3f}" for t in (one, paper, ours))
        times = (f"{t1:.2f}", f"{tp / t1:.3f}", f"{to / t1:.3f}", *(f"{x:.2f}" for x in peaks[:3]))
        table.add(p, w, b, *bubbles, *times, f"{strict.iteration_time / t1:.3f}, {peaks[3]:.2f}", faster)
    bench.table(table)
    bench.say(f"faster order over the {sum(summary.values())} cases: {summary}")
    bench.say(f"B = P cases where Hanayo's peak activations exceed 1F1B's: {over or 'none'}")
    bench.say(f"(P, W, B) where both orders give the same action lists: {same or 'none'}\n")
    closed = Table("P", "W", "simulated", "closed form", "difference", "relative to the simulated", align="l" * 6)
    for p, w in [(p, w) for p in (2, 4, 8) for w in (1, 2, 4)]:
        s, c = run(build_schedule("hanayo", p, p, waves=w), p).bubble_ratio, (2 * p - 2) / (3 * p * w + p - 1)
        closed.add(p, w, f"{s:.4f}", f"{c:.4f}", f"{c - s:+.4f}", f"{(c - s) / s:+.1%}")
    title = "Hanayo's closed form (2P - 2) / (3PW + P - 1) (Eq. 1, T_B = 2 T_F, T_C = 0) vs the simulated bubble of its order, B = P:"
    bench.table(closed, title)
    bubbles = Table("P", "gpipe", "1f1b", "interleaved v=2", "wave W=1", "W=2", "W=4", "closed form W=1 / 2 / 4", align="l" * 8)
    variants = {"gpipe": ("gpipe", {}), "1f1b": ("1f1b", {}), "interleaved2": ("interleaved", {"chunks": 2})}
    variants |= {f"wave{w}": ("wave", {"waves": w}) for w in (1, 2, 4)}
    for p in (2, 4, 8):
        row = {key: run(build_schedule(name, p, p, **options), p) for key, (name, options) in variants.items()}
        closed_form = " / ".join(f"{(2 * p - 2) / (3 * p * w + p - 1):.3f}" for w in (1, 2, 4))
        bubbles.add(p, *(f"{t.bubble_ratio:.3f}" for t in row.values()), closed_form)
        if pictures and p == 4:
            for key, t in row.items():
                gantt(t, f"{pictures}/bubbles_p4_{key}.png")
    bench.table(bubbles, "Bubble ratios at B = P (total idle / (ranks x iteration)), our wave order:")


def main() -> None:
    quick = dict(microbatches=[2], profile_repeats=3, modes=["ours-wave2", "ours-interleaved2", "torch-interleaved", "torch-zbv"])
    common = dict(rounds=3, steps=20, warmup=5, retries=2, max_foreign=0.1, quiet_wait=10.0, budget=300.0, timeout=300.0, pin=False)
    bench = Bench(__doc__, quick, threads=1, **common)
    bench.options(hidden=512, blocks=(16, "a multiple of 16 (wave W=4 on 2 ranks has 16 chunks)"), rows=(64, "rows per micro-batch"))
    bench.options(microbatches=([4, 2], "m values"), profile_repeats=30, modes=MODES, picture=(None, "a bar chart of samples/s"))
    bench.options(simulated=(False, "only the simulated tables (Hanayo vs ours vs 1F1B, bubble ratios)"))
    bench.options(pictures=(None, "with --simulated: a folder for the P = 4 timelines of the bubble ratios"))
    args = bench.parse()
    if args.simulated:
        simulated_orders(bench, args.pictures)
        return bench.finish()
    modes = ["single", "ours-1f1b"] + [m for m in args.modes if m not in ("single", "ours-1f1b")]
    if set(modes) - set(MODES) or args.blocks % 16 or any(m % 2 for m in args.microbatches):
        bench.error(f"modes from {MODES}; --blocks a multiple of 16; --microbatches multiples of the 2 ranks")
    base = dict(hidden=args.hidden, mlp_ratio=1, blocks=args.blocks, rows=args.rows, steps=args.steps, warmup=args.warmup, lr=1e-3)
    prof, foreign = bench.run(job, 2, "profile", dict(base, microbatches=1, batch=args.rows, profile_repeats=args.profile_repeats))
    costs, loss = median_costs(prof[0]["blocks"], prof[0]["link"], "residual-mlp", fold_loss=True, messages=prof[0]["messages"])
    messages = MessageCosts.from_dict(prof[0]["messages"])
    bench.say(
        f"profile (foreign load {foreign:.2f}): per block f {1e3 * statistics.median(costs.forward):.2f} ms, "
        f"b {1e3 * statistics.median(costs.backward):.2f} ms; loss f+b {1e3 * sum(loss):.2f} ms; "
        f"link latency {1e6 * costs.latency:.0f} us, {costs.bandwidth / 1e9:.2f} GB/s"
    )
    bench.say(f"messages (lightning_pipe.profiling.messages, as at the strategy's setup): {messages.summary()}\n")
    tables = {}
    for m in args.microbatches:
        cfg = dict(base, microbatches=m, batch=args.rows * m)
        traces = {}

        def traced(mode: str, results: list[dict]) -> None:
            if mode.startswith("ours-"):
                traces[mode] = trace_summary(results, *our_schedule(mode[len("ours-") :], m, args.blocks), costs)

        best, errors = best_runs(bench, job, modes, cfg, args.rounds, f"m={m} ", traced)
        bench.keep(f"m={m}", {"best": best, "errors": errors})
        tables[m] = report(bench, m, dict(cfg, repeats=args.rounds), best, errors, traces, costs, messages)
    if args.picture:
        picture(tables, args.picture)
    bench.finish()


if __name__ == "__main__":
    main()
