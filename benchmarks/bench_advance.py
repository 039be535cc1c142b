"""AvgPipe's advance forward propagation vs 1F1B vs AFAB on 2 processes: time and stashed activations.

``real``: GPT-tiny cut 5 / 5, batch 16 in M = 4, 8, 16 micro-batches, every advance_num a in [1, M]:
iteration, step, the simulator on costs profiled in the job, peak stash, the live saved peak.
``emulated``: sleeping stages, an EMULATED per-message delay; a deeper pipeline simulated. ``cli``:
Algorithm 1's adaptive rule through the CLI. Feeds docs/results/benchmarks_advance.md.

    flock /tmp/bench.lock python -m benchmarks.bench_advance --save /tmp/advbench/final.json --cli-dir /tmp/advbench/cli_final
    flock /tmp/bench.lock python -m benchmarks.bench_advance --part emulated --latencies 0,2,8
    python -m benchmarks.bench_advance --load /tmp/advbench/final.json --figure docs/img/advance_tradeoff.png
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks.harness import gpt
from benchmarks.harness.bench import Bench, Table, column_table, ms, pyplot, save_figure, spread, write_json
from benchmarks.harness.cli_runs import run_command
from benchmarks.harness.launch import OTHER_JOBS, rank_zero_log, run_distributed, wait_for_quiet
from benchmarks.harness.pipes import best_link, gather, median_costs, pipeline_steps, sleep_model, spans
from lightning_pipe.profiling import Profile, profile_blocks
from lightning_pipe.profiling.link import ping_pong
from lightning_pipe.profiling.saved import SavedBytes
from lightning_pipe.runtime.p2p import Transport
from lightning_pipe.runtime.sequential import SequentialHost, SequentialPipeline
from lightning_pipe.schedules import build_schedule
from lightning_pipe.schedules.advance import peak_stash
from lightning_pipe.simulation import CostModel, simulate
from lightning_pipe.tuning.record import in_flight_peak

STAGES, MB = 2, 1 << 20
EMU_ROWS, EMU_HIDDEN = 256, 128  # 256 x 128 float32: GPT-tiny's activation at M = 8
DEEP = (4, 16)  # the simulator-only table: stages, M
CLI = (("plain", "gpt-tiny-cpu"), ("AvgPipe N=2", "gpt-tiny-avgpipe"))


def schedule_of(m: int, a: int, stages: int = STAGES):
    return build_schedule("advance", stages, m, advance_num=a)


def label(a: int, m: int) -> str:
    return f"{a} (1F1B)" if a == 1 else f"{a} (AFAB)" if a == m else str(a)


def mbytes(v: float | None) -> str:
    return "-" if v is None else f"{v / MB:.1f}"


class LiveSaved(SavedBytes):
    """SavedBytes that also keeps the peak of the saved bytes *alive at once*: a storage counts from its
    first pack until every tensor saved from it is freed; ``exclude``: storage addresses (the weights')."""

    def __init__(self, exclude: set[int]):
        super().__init__()
        self._exclude, self.size, self.live, self.peak = exclude, {}, 0, 0

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in self._live and s.data_ptr() not in self._exclude:
            self.size[s.data_ptr()] = s.nbytes()
            self.live += s.nbytes()
            self.peak = max(self.peak, self.live)
        return super()._pack(t)

    def _release(self, key: int) -> None:
        super()._release(key)
        if key not in self._live:
            self.live -= self.size.pop(key, 0)


class LatencyTransport(Transport):
    """Sends leave ``latency`` s after the executor issued them (EMULATED): one helper thread issues
    them in FIFO order (the order per peer kept, the sender computing meanwhile); receives at once."""

    def __init__(self, latency: float):
        super().__init__(lambda r: r, torch.device("cpu"), batch_ops=False)
        self.latency, self._pool = latency, ThreadPoolExecutor(1, "delayed sends")

    def _send(self, due: float, op: Any) -> Any:
        time.sleep(max(0.0, due - time.perf_counter()))
        return op.op(op.tensor, op.peer)

    def issue(self, ops: list) -> list:
        if self.latency <= 0 or not ops:
            return super().issue(ops)
        self.messages += len(ops)
        self.moved_bytes += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
        due, later = time.perf_counter() + self.latency, lambda f: SimpleNamespace(wait=lambda: f.result().wait())
        return [later(self._pool.submit(self._send, due, op)) if op.op.__name__ == "isend" else op.op(op.tensor, op.peer) for op in ops]

    def close(self) -> None:
        self._pool.shutdown()


def train_schedule(schedule, rank, chunk, loss_fn, x, y, run: Any, transport, after=None, live_exclude: set[int] | None = None) -> dict:
    """Warm-up, then timed steps (`pipeline_steps`: start, pipeline end, step end), minor page faults
    per step; with ``live_exclude`` one more step under LiveSaved."""
    pipe = SequentialPipeline(schedule, rank, SequentialHost({rank: chunk}, STAGES - 1, loss_fn), transport)
    opt = torch.optim.SGD(chunk.parameters(), lr=1e-3)
    pipeline_steps(pipe, opt, x, y, run.warmup, after)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    times = pipeline_steps(pipe, opt, x, y, run.steps, after)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / max(1, run.steps)
    live = None
    if live_exclude is not None:
        with LiveSaved(live_exclude) as tracker:
            pipeline_steps(pipe, opt, x, y, 1, after)
        live = tracker.peak
    return {"times": times, "live": live, "faults": faults}


def real_job(rank: int, world: int, args: Any) -> dict:
    log, model = rank_zero_log(rank), gpt.build_model(args)
    blocks, split = list(model), len(model) // 2
    bounds = ((0, split), (split, len(blocks)))
    chunk, tie = nn.Sequential(*blocks[slice(*bounds[rank])]), gpt.tied_allreduce(model, bounds, rank)
    exclude = {p.untyped_storage().data_ptr() for p in model.parameters()}
    link, _ = gpt.segment(lambda: ping_pong(rank), rank, world, args, log)
    out: dict[str, Any] = {"link": link, "bounds": bounds, "per_m": {}}
    for m in args.microbatches:
        mbs = args.batch // m
        x, y = gpt.make_batch(argparse.Namespace(**{**vars(args), "mbs": mbs, "microbatches": m}))
        profile = lambda: gpt.gather_profile(blocks, x[:mbs], y[:mbs], rank, world, args.profile_repeats, False, "gpt", mbs)  # noqa: E731
        (prof, _), prof_load = gpt.segment(profile, rank, world, args, log)
        with torch.no_grad():  # one micro-batch through the stage: the bytes autograd saves (the weights left out)
            first = x[:mbs] if rank == 0 else nn.Sequential(*blocks[:split])(x[:mbs]).requires_grad_(True)
        saved = {}
        for key, weights in (("activations", list(model.parameters())), ("all", ())):  # "all": the weights autograd saves too
            with SavedBytes(weights) as counted:
                o = chunk(first)
                o = gpt.lm_loss(o, y[:mbs]) if rank == 1 else o
            saved[key] = counted.total
            del o
        d = dict(mbs=mbs, profile=asdict(prof), profile_load=prof_load, saved=saved, live={}, loads=[])
        d.update(runs={a: [] for a in range(1, m + 1)}, faults={a: [] for a in range(1, m + 1)})
        for rnd in range(args.rounds):
            order = list(d["runs"]) if rnd % 2 == 0 else list(d["runs"])[::-1]
            live, transport = exclude if rnd == 0 else None, lambda: Transport(lambda r: r, torch.device("cpu"))
            one_round = lambda: {
                a: train_schedule(schedule_of(m, a), rank, chunk, gpt.lm_loss, x, y, args, transport(), tie, live) for a in order
            }
            res, load = gpt.segment(one_round, rank, world, args, log)
            d["loads"].append(load)
            for a, r in res.items():
                d["runs"][a].append(r["times"])
                d["faults"][a].append(r["faults"])
                d["live"].update({a: r["live"]} if r["live"] is not None else {})
            log(f"  real M={m} round {rnd + 1}/{args.rounds} done (foreign load {load:.2f} CPUs)")
        out["per_m"][m] = d
    return out


def emulated_job(rank: int, world: int, args: Any) -> dict:
    log = rank_zero_log(rank)
    model = sleep_model(STAGES, EMU_HIDDEN, args.tf / 1e3, 2 * args.tf / 1e3)
    link, _ = gpt.segment(lambda: best_link(rank, (4, EMU_ROWS * EMU_HIDDEN * 4), rounds=1), rank, world, args, log)
    g = torch.Generator().manual_seed(1)
    randn = lambda rows: torch.randn(rows, EMU_HIDDEN, generator=g)  # noqa: E731
    sample, target = randn(EMU_ROWS), randn(EMU_ROWS)
    dist.barrier()
    measured = profile_blocks(list(model), sample, torch.device("cpu"), repeats=5, warmup=1, loss_fn=lambda o: F.mse_loss(o, target))
    out: dict[str, Any] = {"link": link, "blocks": gather(measured, world), "per_m": {}}
    run = argparse.Namespace(steps=min(args.steps, 6), warmup=min(args.warmup, 2))

    def timed(m: int, a: int, latency: float, x, y) -> list:
        transport = LatencyTransport(latency / 1e3)
        try:
            return train_schedule(schedule_of(m, a), rank, model[rank : rank + 1], F.mse_loss, x, y, run, transport)["times"]
        finally:
            transport.close()

    for m in args.emu_microbatches:
        x, y = randn(EMU_ROWS * m), randn(EMU_ROWS * m)
        runs, loads = {}, {}
        for lat in args.latencies:
            one = lambda: {f"{lat}/{a}": timed(m, a, lat, x, y) for a in range(1, m + 1)}  # noqa: E731
            res, loads[lat] = gpt.segment(one, rank, world, args, log)
            runs.update(res)
            log(f"  emulated M={m} latency {lat:g} ms done (foreign load {loads[lat]:.2f} CPUs)")
        out["per_m"][m] = {"runs": runs, "loads": loads}
    return out


RULE = re.compile(r"advance rule: step (\d+) at advance_num=(\d+) took ([\d.]+) ms -> (\d+) \(([^)]*)\)")


def cli_runs(args: Any, where: Path) -> list[dict]:
    out = []
    for kind, recipe in CLI:
        for i in range(args.cli_repeats):
            run_dir = where / f"{recipe}-{i}"
            cmd = [sys.executable, "-m", "lightning_pipe.train", f"recipe={recipe}", "schedule=advance", "pipeline.microbatches=8"]
            cmd += [f"trainer.max_steps={args.cli_steps}", f"hydra.run.dir={run_dir}"]
            quiet = dict(quiet_wait=args.quiet_wait, max_foreign=args.max_foreign, poll=5.0, patterns=OTHER_JOBS)
            run = run_command(cmd, run_dir, args.timeout, check=False, **quiet)  # a failed run is a row of the table
            text = (run_dir / "train.log").read_text() if (run_dir / "train.log").exists() else ""
            decisions = [{"step": int(s), "a": int(a), "ms": float(t), "next": int(n), "why": w} for s, a, t, n, w in RULE.findall(text)]
            settled = decisions[-1]["next"] if decisions and decisions[-1]["why"] != "raised" else None
            tail = run["output"].strip().splitlines()[-3:] if run["returncode"] else []
            out.append(dict(kind=f"{kind} {i + 1}", recipe=recipe, command=" ".join(cmd[1:]), returncode=run["returncode"]))
            out[-1].update(seconds=run["wall"], decisions=decisions, settled=settled, tail=tail)
            print(f"  cli {kind} run {i + 1}/{args.cli_repeats}: exit {run['returncode']}, {len(decisions)} decisions", flush=True)
    return out


def replay_rule(times: dict[int, float], low: int, high: int) -> list[int]:
    """Algorithm 1's rule (lightning_pipe.modes.advance AdvanceRule: start at K - 1, raise while the step
    got faster, settle at the first that did not) fed with one time per a: the values it visits."""
    seen = [low]
    while seen[-1] < high and (len(seen) == 1 or times[seen[-1]] < times[seen[-2]]):
        seen.append(seen[-1] + 1)
    return seen


def sim_iter(schedule, costs, bounds) -> float:
    return simulate(schedule, costs, bounds, critical_path=False).iteration_time


def chain(k: int) -> list[tuple[int, int]]:
    return [(i, i + 1) for i in range(k)]


joined = lambda key, fmt: lambda r: " / ".join(fmt(v) for v in r[key])  # a row's values (per rank, per round)
REAL_COLUMNS = (  # (header, value of a row); base: 1F1B's row at the same M
    ("advance_num", lambda r: label(r["a"], r["m"])),
    ("iteration ms: median (p25-p75)", lambda r: f"{ms(r['iter'].median)} ({ms(r['iter'].lo)}-{ms(r['iter'].hi)})"),
    ("per-round medians", joined("rounds", ms)), ("vs 1F1B", lambda r: f"{r['base']['iter'].median / r['iter'].median:.3f}x"),
    ("simulated ms", lambda r: ms(r["sim"])), ("simulated vs 1F1B", lambda r: f"{r['base']['sim'] / r['sim']:.3f}x"),
    ("training step ms", lambda r: ms(r["step"])),
    ("peak stash (micro-batches) stage 0 / 1", lambda r: f"{r['peak'][0]} / {r['peak'][1]}{'' if r['checked'] else ' (!)'}"),
    ("peak stash MB (bytes/mb x peak)", joined("stash", mbytes)), ("live saved peak MB (one step)", joined("live", mbytes)),
    ("minor page faults per step, rank 0 / 1", joined("faults", "{:.0f}".format)),
)  # fmt: skip


def print_real(bench: Bench, results: list[dict], args: Any) -> dict:
    link, bounds = results[0]["link"], [tuple(b) for b in results[0]["bounds"]]
    model = gpt.describe(argparse.Namespace(**{**vars(args), "microbatches": "M", "mbs": "batch / M"}))
    stages = " and ".join(f"[{lo}, {hi})" for lo, hi in bounds)
    bench.say(
        f"## real: 2 gloo processes x 1 thread, {model}; batch {args.batch} sequences; stages hold blocks {stages}; link {link['latency'] * 1e6:.0f} us + {link['bandwidth'] / 1e9:.2f} GB/s (ping-pong)\n"
    )
    figure = {}
    for m, d in results[0]["per_m"].items():
        costs, saved = Profile(**d["profile"]).costs(link["bandwidth"], link["latency"]), [r["per_m"][m]["saved"] for r in results]
        fb = [ms(sum(costs.forward[lo:hi]) + sum(costs.backward[lo:hi])) for lo, hi in bounds]
        loads = ", ".join(f"{max(r['per_m'][m]['loads'][k] for r in results):.2f}" for k in range(len(d["loads"])))
        title = (
            f"### M = {m} micro-batches of {d['mbs']} sequences: per micro-batch f + b = {fb[0]} / {fb[1]} ms on stage 0 / 1 (profiled, the loss on stage 1); "
            f"saved for backward per micro-batch: {mbytes(saved[0]['activations'])} / {mbytes(saved[1]['activations'])} MB activations "
            f"({mbytes(saved[0]['all'])} / {mbytes(saved[1]['all'])} MB with the weights autograd also saves); foreign load per round {loads} CPUs"
        )
        rows = []
        for a in sorted(d["runs"], key=int):
            pooled = [spans([r["per_m"][m]["runs"][a][k] for r in results]) for k in range(len(d["runs"][a]))]
            schedule, peak = schedule_of(m, int(a)), peak_stash(STAGES, m, int(a))
            sim = simulate(schedule, costs, bounds, critical_path=False)
            rows.append(dict(
                a=int(a), iter=spread((t for i, _ in pooled for t in i), iqr=True), sim=sim.iteration_time, peak=peak,
                rounds=[statistics.median(i) for i, _ in pooled], step=statistics.median(t for _, s in pooled for t in s),
                checked=[in_flight_peak(schedule.actions[r]) for r in range(STAGES)] == peak == list(sim.peak_activations),
                stash=[p * s["activations"] for p, s in zip(peak, saved)], live=[r["per_m"][m]["live"].get(a) for r in results],
                faults=[statistics.fmean(r["per_m"][m]["faults"][a]) for r in results],
            ))  # fmt: skip
        base, afab = rows[0], rows[-1]
        bench.table(column_table(REAL_COLUMNS, [dict(r, base=base, m=m) for r in rows], "llllrrrrrrr"), title)
        best = min(rows, key=lambda r: r["iter"].median)
        iqr = statistics.median((r["iter"].hi - r["iter"].lo) / r["iter"].median for r in rows)
        bench.say(
            f"M={m}: fastest measured a = {best['a']} ({ms(best['iter'].median)} ms, {base['iter'].median / best['iter'].median:.3f}x 1F1B); "
            f"AFAB/1F1B measured {base['iter'].median / afab['iter'].median:.3f}x (on the 25th percentiles {base['iter'].lo / afab['iter'].lo:.3f}x), "
            f"simulated {base['sim'] / afab['sim']:.3f}x; typical interquartile spread of a step {100 * iqr:.1f}% of its median; "
            f"peak stash AFAB/1F1B stage 0 {afab['stash'][0] / base['stash'][0]:.1f}x, stage 1 {afab['stash'][1] / base['stash'][1]:.1f}x"
        )
        visits = replay_rule({r["a"]: r["iter"].median for r in rows}, 1, m)
        bench.say(f"the rule replayed on these medians (noise-free, one value per a): visits {visits}, settles at {visits[-1]}\n")
        figure[m] = rows
    return figure


def print_emulated(bench: Bench, results: list[dict], args: Any) -> dict:
    link = results[0]["link"]
    costs = median_costs(results[0]["blocks"], link)
    f, b = costs.forward, costs.backward
    bench.say(
        f"## EMULATED devices: 2 processes, one sleeping block per stage (forward {args.tf:g} ms, backward {2 * args.tf:g} ms; "
        f"profiled f {ms(f[0])} / {ms(f[1])}, b {ms(b[0])} / {ms(b[1])} ms with the loss), real gloo messages of {EMU_ROWS} x {EMU_HIDDEN} "
        f"float32 (link {link['latency'] * 1e6:.0f} us + {link['bandwidth'] / 1e9:.2f} GB/s) plus an EMULATED per-message delay; "
        f"medians of {min(args.steps, 6)} steps after {min(args.warmup, 2)} warm-up\n"
    )
    size, figure, delays = float(EMU_ROWS * EMU_HIDDEN * 4), {}, [f"delay {lat:g} ms" for lat in args.latencies]
    at = lambda lat, k=STAGES: CostModel(
        f[:1] * (k - 1) + f[-1:], b[:1] * (k - 1) + b[-1:], (size,) * k, (0.0,) * k, link["bandwidth"], link["latency"] + lat / 1e3
    )  # noqa: E731
    for m in results[0]["per_m"]:
        med = {key: statistics.median(spans([r["per_m"][m]["runs"][key] for r in results])[0]) for key in results[0]["per_m"][m]["runs"]}
        sims = {f"{lat}/{a}": sim_iter(schedule_of(m, a), at(lat), chain(2)) for lat in args.latencies for a in range(1, m + 1)}
        table = Table("advance_num", "peak stash", *delays, align="lr" + "r" * len(delays))
        for a in range(1, m + 1):
            cell = lambda k: f"{ms(med[k])} ({ms(sims[k])}) {med[k.split('/')[0] + '/1'] / med[k]:.2f}x"  # noqa: E731
            table.add(label(a, m), " / ".join(map(str, peak_stash(STAGES, m, a))), *(cell(f"{lat}/{a}") for lat in args.latencies))
        bench.table(table, f"### EMULATED, M = {m}: iteration ms measured (simulated), peak stash in micro-batches stage 0 / 1")
        bench.say("(each cell: measured median (simulated) and measured speed-up over 1F1B at that delay; ALL EMULATED)")
        for lat in args.latencies:
            times = {a: med[f"{lat}/{a}"] for a in range(1, m + 1)}
            visits, fastest = replay_rule(times, 1, m), min(times, key=times.get)
            bench.say(
                f"EMULATED delay {lat:g} ms: the rule replayed on the medians visits {visits}, settles at {visits[-1]} "
                f"({ms(times[visits[-1]])} ms; fastest a = {fastest}, {ms(times[fastest])} ms)"
            )
        figure[m] = {"measured": med, "simulated": sims}
    k, m = DEEP
    deep = Table("advance_num", "max peak stash", *delays, align="lr" + "r" * len(delays))
    for a in range(k - 1, m + 1):
        t = [sim_iter(schedule_of(m, a, k), at(lat, k), chain(k)) for lat in args.latencies]
        peak = max(simulate(schedule_of(m, a, k), at(0.0, k), chain(k)).peak_activations)
        deep.add(label(a, m) if a != k - 1 else f"{a} (1F1B)", peak, *map(ms, t))
    bench.table(deep, f"\n### SIMULATED only: K = {k} stages of the emulated block, M = {m}; iteration ms; max peak stash (micro-batches)")
    return figure


def print_cli(bench: Bench, cli: list[dict]) -> None:
    table = Table("run", "exit", "seconds", "sequence: a (step ms) -> next", "settled at", align="lrrlr")
    for c in cli:
        seq = "; ".join(f"step {d['step']}: {d['a']} ({d['ms']:.1f} ms) -> {d['next']} {d['why']}" for d in c["decisions"])
        settled = "not settled" if c["settled"] is None else c["settled"]
        table.add(c["kind"], c["returncode"], f"{c['seconds']:.0f}", seq or "no decision logged", settled)
    bench.table(table, "## Algorithm 1's adaptive rule through the CLI (train.log)")
    [bench.say(f"{c['kind']}: " + " / ".join(c["tail"])) for c in cli if c["tail"]]
    for c in {c["recipe"]: c for c in cli[::-1]}.values():
        bench.say(f"command: python {c['command']}")


def figure(real: dict, emu: dict, path: str, latencies: list[float]) -> None:
    """Fig. 7 of the paper: iteration and stash against advance_num (real), and the emulated delays."""
    panels = [p for p in (real, emu) if p]
    fig, axes = pyplot().subplots(1, len(panels), figsize=(6.5 * len(panels), 4.6), squeeze=False)
    axes, xlabel = list(axes[0]), "advance_num (1 = 1F1B, M = AFAB)"
    if real:
        m = 8 if 8 in real else next(iter(real))
        rows, ax = real[m], axes.pop(0)
        a, med = [r["a"] for r in rows], [r["iter"].median * 1e3 for r in rows]
        err = [[v - r["iter"].lo * 1e3 for v, r in zip(med, rows)], [r["iter"].hi * 1e3 - v for v, r in zip(med, rows)]]
        ax.errorbar(a, med, yerr=err, marker="o", capsize=3, label="measured iteration (median, p25-p75)")
        ax.plot(a, [r["sim"] * 1e3 for r in rows], "s--", label="simulated iteration")
        ax.set(xlabel=xlabel, ylabel="iteration ms", title=f"real: 2 gloo CPU processes, GPT-tiny, M = {m}")
        ax.set_ylim(0, max(r["iter"].hi for r in rows) * 1e3 * 1.35)
        twin = ax.twinx()
        for s in (0, 1):
            twin.plot(a, [r["stash"][s] / MB for r in rows], "^v"[s] + ":", color=f"C{2 + s}", label=f"peak stash stage {s} (MB)")
        twin.set(ylabel="peak stashed activations, MB", ylim=(0, max(max(r["stash"]) for r in rows) / MB * 1.1))
        (h1, l1), (h2, l2) = ax.get_legend_handles_labels(), twin.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, loc="lower right", fontsize=8)
    if emu:
        m = 8 if 8 in emu else next(iter(emu))
        ax = axes.pop(0)
        for i, lat in enumerate(latencies):
            for kind, extra in (("measured", dict(marker="o", label=f"delay {lat:g} ms")), ("simulated", dict(alpha=0.35))):
                ax.plot(range(1, m + 1), [emu[m][kind][f"{lat}/{a}"] * 1e3 for a in range(1, m + 1)], "-", color=f"C{i}", **extra)
        title = f"EMULATED devices (sleep) + EMULATED message delay, M = {m}\n(faint: simulated)"
        ax.set(xlabel=xlabel, ylabel="iteration ms", title=title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


def intkeys(value: Any) -> Any:
    """JSON's string keys back to the ints they were (M, advance_num)."""
    if isinstance(value, dict):
        return {int(k) if isinstance(k, str) and k.isdigit() else k: intkeys(v) for k, v in value.items()}
    return [intkeys(v) for v in value] if isinstance(value, list) else value


def main() -> None:
    quick = dict(microbatches=[4], emu_microbatches=[4], latencies=[0.0, 2.0], profile_repeats=2, cli_repeats=1, cli_steps=6)
    common = dict(rounds=4, steps=8, warmup=2, retries=1, max_foreign=0.15, quiet_wait=30.0, timeout=900.0, pin=False)
    bench = Bench(__doc__, quick, threads=1, **common)
    gpt.add_model_arguments(bench.parser, layers=4, vocab=260)
    bench.options(part=(["real", "emulated", "cli"], "of real, emulated, cli"), save=(None, "write the measurements (JSON) here"))
    bench.options(load=(None, "print (and plot) measurements saved by --save instead of measuring"), figure=(None, "the Fig. 7-style PNG"))
    bench.options(batch=(16, "sequences per step"), microbatches=([4, 8, 16], "M values (divisors of --batch)"), profile_repeats=10)
    bench.options(emu_microbatches=[8], tf=(4.0, "emulated forward per stage, ms (backward 2 x)"), latencies=([0.0, 2.0, 8.0], "ms"))
    bench.options(cli_steps=20, cli_repeats=(3, "runs per recipe"), cli_dir=(None, "run folders (default: a temporary directory, kept)"))
    args = bench.parse()
    if any(m < 1 or args.batch % m for m in args.microbatches):
        bench.error(f"--microbatches {args.microbatches}: each must divide --batch {args.batch}")
    data = {"args": dict(vars(args))}
    if args.load:
        data = intkeys(json.loads(Path(args.load).read_text()))
        for key, value in data.get("args", {}).items():  # print with the settings that were measured
            setattr(args, key, value) if key not in ("load", "save", "figure", "part", "json", "markdown") else None
    else:
        launch = dict(timeout=args.timeout, group_timeout=args.timeout, pin=args.pin)
        if "real" in args.part:
            wait_for_quiet(args.quiet_wait, args.max_foreign, poll=5.0, patterns=OTHER_JOBS, log=print)
            data["real"] = run_distributed(real_job, STAGES, args, **launch)
        if "emulated" in args.part:
            data["emulated"] = run_distributed(emulated_job, STAGES, args, **launch)
        if "cli" in args.part:
            data["cli"] = cli_runs(args, Path(args.cli_dir or tempfile.mkdtemp(prefix="bench_advance_cli_")))
        bench.keep("measurements", data)
        if args.save:
            write_json(args.save, data)
            data = intkeys(json.loads(Path(args.save).read_text()))  # what --load will print, printed now
            bench.log(f"measurements saved to {args.save}")
    real = print_real(bench, data["real"], args) if "real" in data else {}
    emu = print_emulated(bench, data["emulated"], args) if "emulated" in data else {}
    if "cli" in data:
        print_cli(bench, data["cli"])
    if args.figure:
        figure(real, emu, args.figure, args.latencies)
    bench.finish()


if __name__ == "__main__":
    main()
