"""AvgPipe's advance forward propagation vs 1F1B vs AFAB on 2 processes: time and stashed activations.

The trade-off of the paper's Fig. 7 (AvgPipe, Chen et al., PPoPP 2023, §4.2 and §7.2): the
schedule ``advance`` (lightning_pipe.schedules.advance) runs ``advance_num = a`` forwards on the
first stage before its first backward; a = K - 1 = 1 is 1F1B, a = M is AFAB (GPipe's order). More
forwards in advance may hide message time behind compute, at the price of more micro-batches'
activations held at once. Three parts:

``real``  2 gloo processes x 1 thread, a GPT-tiny-like block model (lightning_pipe.bench.gpt: 4
          layers, hidden 128, 4 heads, seq 128, byte vocabulary 260, tied embedding / head; the
          10 blocks cut 5 / 5 as the autopipe planner cuts gpt-tiny-cpu), a batch of 16 sequences
          (as recipe gpt-tiny-cpu) split into M = 4, 8, 16 micro-batches. For every a in [1, M]:
          the pipeline iteration (SequentialPipeline.step, from a barrier to the last rank's end;
          median of the timed steps pooled over --rounds rounds that alternate the order of a),
          the training step (plus the tied-weight all-reduce and an SGD step), the simulator's
          iteration (lightning_pipe.simulation.simulate on costs profiled in the same job: every
          block and the loss at the micro-batch size, both ranks at once, and the link from a
          ping-pong), and the peak stashed activations per stage: bytes autograd saves per
          micro-batch (lightning_pipe.tuning.record.SavedBytes around one micro-batch through the
          stage, the weights' storages left out) x the schedule's peak (peak_stash; checked
          against in_flight_peak of the rank's action list and the simulator's timeline), and
          beside it the peak of saved bytes alive during one real step (saved-tensor hooks that
          count a storage from its pack until its last saved tensor is freed).
``emulated``  2 processes whose stages are *emulated devices*: one block per stage that sleeps for
          its forward (--tf) and backward (--tb, default 2 x tf) instead of computing (bench_2bw's
          SleepBlock, real parameters, real gloo messages of --emu-rows x --emu-hidden float32).
          The repository's emulation has no link delay, so this benchmark adds one: a transport
          whose sends are issued by a helper thread --latencies ms after the executor issued
          them (FIFO, so the order per peer is kept; the sender does not wait; receives are
          unchanged). Every figure of this part is EMULATED. Besides the package's ``advance``
          (stage k warms up a - k forwards, so the last stage holds a - 1) it runs a variant built
          with the same action language where the last stage keeps 1F1B (warm-up 0).
``cli``   Algorithm 1's adaptive rule through the Hydra CLI: ``python -m lightning_pipe.train
          recipe=gpt-tiny-cpu schedule=advance pipeline.microbatches=8 trainer.max_steps=20``
          (pipeline.advance_num null = adaptive) and the same with recipe=gpt-tiny-avgpipe
          (AvgPipe, N = 2 pipelines x 2 stages + 2 reference processes); the rule's lines
          ("advance rule: step t at advance_num=a took X ms -> b (why)") are read from each run's
          train.log: the sequence of a and where it settled.

Also printed: this process's minor page faults per step (the allocator at work when a stage holds
more), Algorithm 1's rule replayed on the sweep's medians (``replay_rule``: where a noise-free rule
would settle), and a simulator-only table of the package's schedule vs the variant on a deeper
pipeline (--deep-stages, --deep-microbatches) with the emulated block's costs. Results and
discussion: docs/benchmarks_advance.md.

Timing needs a quiet machine: run the whole benchmark under the shared lock (it takes no lock
itself: wrapped in flock, it would wait for itself), e.g.

    flock /tmp/bench.lock python benchmarks/bench_advance.py --save /tmp/advance.json
    flock /tmp/bench.lock python benchmarks/bench_advance.py --part emulated --latencies 0,2,8
    python benchmarks/bench_advance.py --load /tmp/advance.json --figure docs/img/advance_tradeoff.png

Inside the jobs each measured segment also waits for other benchmarks / pytest to finish and is
repeated when other processes used the CPUs meanwhile (lightning_pipe.bench.launch.quiet_segment).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Optional

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmarks' pieces reused below

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from lightning_pipe.bench import REPO, provenance  # noqa: E402
from lightning_pipe.bench.gpt import add_model_arguments, build_model, describe, gather_profile, lm_loss, make_batch, segment  # noqa: E402
from lightning_pipe.bench.launch import OTHER_JOBS, rank_zero_log, run_distributed, wait_for_quiet  # noqa: E402
from lightning_pipe.bench.pipes import SleepBlock  # noqa: E402  (the emulated device)
from lightning_pipe.profiling.link import ping_pong  # noqa: E402
from lightning_pipe.profiling.saved import SavedBytes  # noqa: E402
from lightning_pipe.runtime.p2p import Transport  # noqa: E402
from lightning_pipe.schedules import build_schedule, validate  # noqa: E402
from lightning_pipe.schedules.actions import Op, PipelineSchedule  # noqa: E402
from lightning_pipe.schedules.advance import peak_stash, warmups  # noqa: E402
from lightning_pipe.schedules.lowering import lower  # noqa: E402
from lightning_pipe.tuning.record import in_flight_peak  # noqa: E402

STAGES = 2
MB = 1 << 20


# ---- the schedules ----------------------------------------------------------------------------
def last_stage_1f1b(stages: int, microbatches: int, advance_num: int) -> PipelineSchedule:
    """The variant: the package's warm-ups (stage k: a - k forwards first), except that the last
    stage keeps 1F1B's (none: each backward right after its forward) unless a = M (AFAB)."""
    ws = warmups(stages, microbatches, advance_num)
    if ws[-1] < microbatches:
        ws[-1] = 0
    compute = []
    for rank, w in enumerate(ws):
        order = [(Op.FORWARD, rank, i) for i in range(w)]
        for i in range(microbatches - w):
            order += [(Op.FORWARD, rank, w + i), (Op.BACKWARD, rank, i)]
        order += [(Op.BACKWARD, rank, i) for i in range(microbatches - w, microbatches)]
        compute.append(order)
    schedule = lower("advance-last-1f1b", compute, tuple(range(stages)), microbatches)
    validate(schedule)
    return schedule


def schedule_of(variant: str, microbatches: int, a: int, stages: int = STAGES) -> PipelineSchedule:
    # Since 1f812f2 the package's `advance` keeps the last stage in 1F1B's order, i.e. it IS this
    # variant: re-running prints identical "package" and "last1f1b" columns. The "package" rows in
    # docs/benchmarks_advance.md were measured on 12d8086 (the first version, last stage leading too).
    if variant == "package":
        return build_schedule("advance", stages, microbatches, advance_num=a)
    return last_stage_1f1b(stages, microbatches, a)


def variant_values(variant: str, microbatches: int) -> list[int]:
    """The a run for a variant: all of [1, M] for the package; the variant differs only in between."""
    return list(range(1, microbatches + 1)) if variant == "package" else list(range(2, microbatches))


def held(variant: str, microbatches: int, a: int) -> list[int]:
    """Micro-batches each stage holds at its peak."""
    if variant == "package":
        return peak_stash(STAGES, microbatches, a)
    s = schedule_of(variant, microbatches, a)
    return [in_flight_peak(s.actions[r]) for r in range(STAGES)]


# ---- memory: saved bytes per micro-batch, and alive during a step -------------------------------
def storages(module: nn.Module) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in module.parameters()}


class LiveSaved:
    """Saved-tensor hooks counting the bytes autograd keeps for backward *alive at once*: a storage
    counts from its first pack until every tensor saved from it is freed (after its backward).
    The weights' storages (``exclude``) are left out."""

    def __init__(self, exclude: set[int]):
        self.exclude, self.count, self.size = exclude, {}, {}
        self.live = self.peak = 0

    def _release(self, key: int) -> None:
        self.count[key] -= 1
        if not self.count[key]:
            del self.count[key]
            self.live -= self.size.pop(key)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        key = s.data_ptr()
        if key in self.exclude or s.nbytes() == 0:
            return t
        if key not in self.count:
            self.count[key], self.size[key] = 0, s.nbytes()
            self.live += s.nbytes()
            self.peak = max(self.peak, self.live)
        self.count[key] += 1
        weakref.finalize(t, self._release, key)
        return t

    def __enter__(self) -> "LiveSaved":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


def saved_per_microbatch(chunk: nn.Module, inputs: Any, loss: Optional[Any], exclude: set[int]) -> dict[str, int]:
    """Bytes autograd saves for one micro-batch through `chunk` (and the loss on the last stage):
    activations only, and everything SavedBytes sees (the weights included, as the rule measures)."""
    with SavedBytes() as saved:
        out = chunk(inputs)
        if loss is not None:
            out = loss(out)
    acts = sum(n for k, n in saved.seen.items() if k not in exclude)
    del out
    return {"activations": acts, "all": saved.total}


# ---- an emulated link delay ---------------------------------------------------------------------
class _Delayed:
    """The work of a send the helper thread issues later; ``wait`` waits for both."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.work: Any = None
        self.error: Optional[BaseException] = None

    def wait(self) -> bool:
        self.ready.wait()
        if self.error is not None:
            raise self.error
        return self.work.wait()


class LatencyTransport(Transport):
    """Transport whose sends leave ``latency`` seconds after the executor issued them (EMULATED):
    a helper thread issues them in FIFO order, so the order per peer is kept and the sender's
    compute goes on meanwhile; receives are issued at once and complete when the data is there."""

    def __init__(self, latency: float):
        super().__init__(lambda r: r, torch.device("cpu"), batch_ops=False)
        self.latency = latency
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="delayed sends", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            due, op, box = item
            wait = due - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            try:
                box.work = op.op(op.tensor, op.peer)
            except BaseException as err:  # noqa: BLE001  (raised in the caller's wait)
                box.error = err
            box.ready.set()

    def issue(self, ops: list) -> list:
        if self.latency <= 0 or not ops:
            return super().issue(ops)
        self.messages += len(ops)
        self.moved_bytes += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
        due = time.perf_counter() + self.latency
        works = []
        for op in ops:
            if getattr(op.op, "__name__", "") == "isend":
                box = _Delayed()
                self._queue.put((due, op, box))
                works.append(box)
            else:
                works.append(op.op(op.tensor, op.peer))
        return works

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


# ---- training a schedule (in the jobs) ----------------------------------------------------------
def train_schedule(
    schedule: PipelineSchedule,
    rank: int,
    chunk: nn.Module,
    loss_fn: Any,
    x: Any,
    y: Any,
    args: Any,
    transport: Transport,
    after: Any = None,
    live_exclude: Optional[set[int]] = None,
) -> dict:
    """Warm-up then timed steps; per step (start, pipeline end, step end) in perf_counter seconds
    (one clock for all processes), and this process's minor page faults per timed step; with
    ``live_exclude`` one more step under LiveSaved."""
    from lightning_pipe.runtime.sequential import SequentialHost, SequentialPipeline

    host = SequentialHost({rank: chunk}, STAGES - 1, loss_fn)
    pipe = SequentialPipeline(schedule, rank, host, transport)
    opt = torch.optim.SGD(chunk.parameters(), lr=args.lr)

    def step() -> tuple[float, float, float]:
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        pipe.step(x, y)
        t1 = time.perf_counter()
        if after is not None:
            after()
        opt.step()
        return t0, t1, time.perf_counter()

    for _ in range(args.warmup):
        step()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    times = [step() for _ in range(args.steps)]
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / max(1, args.steps)
    live = None
    if live_exclude is not None:
        with LiveSaved(live_exclude) as tracker:
            step()
        live = tracker.peak
    return {"times": times, "live": live, "in_flight": in_flight_peak(schedule.actions[rank]), "faults": faults}


def real_job(rank: int, world: int, args: Any) -> dict:
    from lightning_pipe.runtime.tied import allreduce_tied, find_tied_parameters

    log = rank_zero_log(rank)
    model = build_model(args)
    blocks = list(model)
    split = args.split or len(blocks) // 2
    bounds = ((0, split), (split, len(blocks)))
    lo, hi = bounds[rank]
    chunk = nn.Sequential(*blocks[lo:hi])
    tied = find_tied_parameters(model, bounds)
    groups = {}
    for t in tied:  # new_group is collective: every rank, same order
        group = dist.new_group(list(t.stages))
        if rank in t.stages:
            groups[t.index] = group
    exclude = storages(model)
    link, _ = segment(lambda: ping_pong(rank), rank, world, args, log)
    out: dict[str, Any] = {"link": link, "bounds": bounds, "per_m": {}}
    for m in args.microbatches:
        mbs = args.batch // m
        shape = argparse.Namespace(**{**vars(args), "mbs": mbs, "microbatches": m})
        x, y = make_batch(shape)

        def profile(x=x, y=y, mbs=mbs):
            return gather_profile(blocks, x[:mbs], y[:mbs], rank, world, args.profile_repeats, False, "gpt", mbs)

        (prof, loss), prof_load = segment(profile, rank, world, args, log)
        with torch.no_grad():
            first = x[:mbs] if rank == 0 else nn.Sequential(*blocks[:split])(x[:mbs])
        inputs = first if rank == 0 else first.detach().requires_grad_(True)
        target = y[:mbs]
        saved = saved_per_microbatch(chunk, inputs, (lambda o: lm_loss(o, target)) if rank == 1 else None, exclude)
        values = list(range(1, m + 1))
        runs: dict[int, list] = {a: [] for a in values}
        faults: dict[int, list] = {a: [] for a in values}
        live: dict[int, Any] = {}
        in_flight: dict[int, int] = {}
        loads = []
        for rnd in range(args.rounds):
            order = values if rnd % 2 == 0 else values[::-1]

            def one_round(order=order, rnd=rnd, x=x, y=y, m=m):
                res = {}
                for a in order:
                    res[a] = train_schedule(
                        schedule_of("package", m, a),
                        rank,
                        chunk,
                        lm_loss,
                        x,
                        y,
                        args,
                        Transport(lambda r: r, torch.device("cpu")),
                        after=lambda: allreduce_tied(tied, groups, rank),
                        live_exclude=exclude if rnd == 0 else None,
                    )
                return res

            res, load = segment(one_round, rank, world, args, log)
            loads.append(load)
            for a in values:
                runs[a].append(res[a]["times"])
                faults[a].append(res[a]["faults"])
                if res[a]["live"] is not None:
                    live[a] = res[a]["live"]
                in_flight[a] = res[a]["in_flight"]
            log(f"  real M={m} round {rnd + 1}/{args.rounds} done (foreign load {load:.2f} CPUs)")
        out["per_m"][m] = {
            "mbs": mbs,
            "profile": prof,
            "loss": loss,
            "profile_load": prof_load,
            "saved": saved,
            "runs": runs,
            "faults": faults,
            "live": live,
            "in_flight": in_flight,
            "loads": loads,
        }
    return out


def emulated_job(rank: int, world: int, args: Any) -> dict:
    from lightning_pipe.profiling import profile_blocks

    log = rank_zero_log(rank)
    t_f, t_b = args.tf / 1e3, (args.tb if args.tb is not None else 2 * args.tf) / 1e3
    torch.manual_seed(0)
    model = nn.Sequential(*[SleepBlock(args.emu_hidden, t_f, t_b) for _ in range(STAGES)])
    chunk = model[rank : rank + 1]
    rows = args.emu_rows
    link, _ = segment(lambda: ping_pong(rank, sizes=(4, rows * args.emu_hidden * 4), repeats=50), rank, world, args, log)
    g = torch.Generator().manual_seed(1)
    sample, target = torch.randn(rows, args.emu_hidden, generator=g), torch.randn(rows, args.emu_hidden, generator=g)
    dist.barrier()
    measured = profile_blocks(list(model), sample, torch.device("cpu"), repeats=5, warmup=1, loss_fn=lambda o: F.mse_loss(o, target))
    parts: list = [None] * world
    dist.all_gather_object(parts, measured)
    out: dict[str, Any] = {"link": link, "blocks": parts, "per_m": {}}
    for m in args.emu_microbatches:
        x = torch.randn(rows * m, args.emu_hidden, generator=g)
        y = torch.randn(rows * m, args.emu_hidden, generator=g)
        runs: dict[str, dict] = {}
        loads: dict[float, float] = {}
        for latency in args.latencies:

            def one(latency=latency, m=m, x=x, y=y):
                res = {}
                for variant in args.variants:
                    for a in variant_values(variant, m):
                        transport = LatencyTransport(latency / 1e3)
                        try:
                            r = train_schedule(schedule_of(variant, m, a), rank, chunk, F.mse_loss, x, y, args.emu, transport)
                        finally:
                            transport.close()
                        res[f"{variant}/{a}"] = r["times"]
                return res

            res, load = segment(one, rank, world, args, log)
            loads[latency] = load
            for key, times in res.items():
                runs[f"{latency}/{key}"] = times
            log(f"  emulated M={m} latency {latency:g} ms done (foreign load {load:.2f} CPUs)")
        out["per_m"][m] = {"runs": runs, "loads": loads}
    return out


# ---- the parent: analysis -------------------------------------------------------------------------
def spans(per_rank: list[list[tuple[float, float, float]]]) -> tuple[list[float], list[float]]:
    """Pipeline iteration (first start to last pipeline end) and training step per step index."""
    iters, steps = [], []
    for k in range(len(per_rank[0])):
        s = [r[k] for r in per_rank]
        start = min(t for t, _, _ in s)
        iters.append(max(e for _, e, _ in s) - start)
        steps.append(max(e for _, _, e in s) - start)
    return iters, steps


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return q[0], statistics.median(values), q[2]


def costs_of(prof: Any, link: dict, latency: float = 0.0):
    return prof.costs(link["bandwidth"], link["latency"] + latency)


def simulated(variant: str, m: int, a: int, costs: Any, bounds: Any) -> Any:
    from lightning_pipe.simulation import simulate

    return simulate(schedule_of(variant, m, a), costs, bounds, critical_path=False)


def analyse_real(results: list[dict]) -> dict:
    r0 = results[0]
    link, bounds = r0["link"], [tuple(b) for b in r0["bounds"]]
    out: dict[str, Any] = {"link": link, "bounds": bounds, "per_m": {}}
    for m, d in r0["per_m"].items():
        costs = costs_of(d["profile"], link)
        saved = [r["per_m"][m]["saved"] for r in results]
        rows = []
        for a in sorted(d["runs"]):
            iters, steps, rounds = [], [], []
            for rnd in range(len(d["runs"][a])):
                i, s = spans([r["per_m"][m]["runs"][a][rnd] for r in results])
                iters += i
                steps += s
                rounds.append(statistics.median(i))
            sim = simulated("package", m, a, costs, bounds)
            peak = peak_stash(STAGES, m, a)
            flight = [r["per_m"][m]["in_flight"][a] for r in results]
            rows.append(
                {
                    "a": a,
                    "iter": quartiles(iters),
                    "step": statistics.median(steps),
                    "rounds": rounds,
                    "sim": sim.iteration_time,
                    "peak": peak,
                    "peak_checked": flight == peak and list(sim.peak_activations) == peak,
                    "stash": [p * s["activations"] for p, s in zip(peak, saved)],
                    "live": [r["per_m"][m]["live"].get(a) for r in results],
                    "faults": [statistics.fmean(r["per_m"][m]["faults"][a]) for r in results],
                }
            )
        variant = [simulated("last1f1b", m, a, costs, bounds).iteration_time for a in variant_values("last1f1b", m)]
        out["per_m"][m] = {
            "mbs": d["mbs"],
            "saved": saved,
            "rows": rows,
            "loads": [max(r["per_m"][m]["loads"][k] for r in results) for k in range(len(d["loads"]))],
            "profile_load": d["profile_load"],
            "fb": (sum(costs.forward), sum(costs.backward)),
            "stage_fb": [
                (sum(costs.forward[lo:hi]), sum(costs.backward[lo:hi])) for lo, hi in bounds
            ],  # per micro-batch, the loss in the last
            "variant_sim": dict(zip(variant_values("last1f1b", m), variant)),
        }
    return out


def analyse_emulated(results: list[dict], args: Any) -> dict:
    from lightning_pipe.simulation import CostModel

    r0 = results[0]
    link, parts = r0["link"], r0["blocks"]
    f = [statistics.median(p[i]["forward"] for p in parts) for i in range(STAGES)]
    b = [statistics.median(p[i]["backward"] for p in parts) for i in range(STAGES)]
    size = float(args.emu_rows * args.emu_hidden * 4)
    out: dict[str, Any] = {"link": link, "f": f, "b": b, "per_m": {}}
    for m, d in r0["per_m"].items():
        rows = []
        for latency in args.latencies:
            costs = CostModel(tuple(f), tuple(b), (size,) * STAGES, (0.0,) * STAGES, link["bandwidth"], link["latency"] + latency / 1e3)
            bounds = [(0, 1), (1, 2)]
            for variant in args.variants:
                for a in variant_values(variant, m):
                    key = f"{latency}/{variant}/{a}"
                    iters, _ = spans([r["per_m"][m]["runs"][key] for r in results])
                    rows.append(
                        {
                            "latency": latency,
                            "variant": variant,
                            "a": a,
                            "iter": quartiles(iters),
                            "sim": simulated(variant, m, a, costs, bounds).iteration_time,
                            "peak": held(variant, m, a),
                        }
                    )
        out["per_m"][m] = {"rows": rows, "loads": d["loads"]}
    return out


# ---- the CLI part -------------------------------------------------------------------------------
RULE = re.compile(r"advance rule: step (\d+) at advance_num=(\d+) took ([\d.]+) ms -> (\d+) \(([^)]*)\)")


def cli_runs(args: Any, where: Path) -> list[dict]:
    out = []
    for kind, recipe in (("plain (N=1)", "gpt-tiny-cpu"), ("AvgPipe N=2", "gpt-tiny-avgpipe")):
        for i in range(args.cli_repeats):
            run_dir = where / f"{recipe}-{i}"
            cmd = [
                sys.executable,
                "-m",
                "lightning_pipe.train",
                f"recipe={recipe}",
                "schedule=advance",
                f"pipeline.microbatches={args.cli_microbatches}",
                f"trainer.max_steps={args.cli_steps}",
                f"hydra.run.dir={run_dir}",
            ]
            wait_for_quiet(args.quiet_wait, args.max_foreign, poll=5.0, patterns=OTHER_JOBS, log=print)
            started = time.monotonic()
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout, check=False)
            seconds = time.monotonic() - started
            text = (run_dir / "train.log").read_text() if (run_dir / "train.log").exists() else ""
            decisions = [{"step": int(s), "a": int(a), "ms": float(t), "next": int(n), "why": w} for s, a, t, n, w in RULE.findall(text)]
            settled = decisions[-1]["next"] if decisions and decisions[-1]["why"] != "raised" else None
            out.append(
                {
                    "kind": kind,
                    "recipe": recipe,
                    "command": " ".join(cmd[1:]),
                    "returncode": proc.returncode,
                    "seconds": seconds,
                    "log": str(run_dir / "train.log"),
                    "decisions": decisions,
                    "settled": settled,
                    "tail": proc.stderr.strip().splitlines()[-3:] if proc.returncode else [],
                }
            )
            print(
                f"  cli {kind} run {i + 1}/{args.cli_repeats}: exit {proc.returncode}, {seconds:.0f} s, {len(decisions)} decisions",
                flush=True,
            )
    return out


def replay_rule(times: dict[int, float], low: int, high: int) -> list[int]:
    """Algorithm 1's rule (lightning_pipe.modes.advance.AdvanceRule: start at K - 1, raise while the
    step got faster, settle at the first that did not) fed with one time per advance_num, e.g. the
    sweep's medians: the values it visits, the last being where it settles (no memory limit)."""
    a, last, seen = low, None, [low]
    while True:
        t = times[a]
        faster = last is None or t < last
        last = t
        if not (faster and a < high):
            return seen
        a += 1
        seen.append(a)


# ---- printing -------------------------------------------------------------------------------------
def ms(v: float) -> str:
    return f"{v * 1e3:.1f}"


def mbytes(v: Optional[float]) -> str:
    return "-" if v is None else f"{v / MB:.1f}"


def label(a: int, m: int) -> str:
    return f"{a} (1F1B)" if a == 1 else f"{a} (AFAB)" if a == m else str(a)


def print_real(real: dict, args: Any) -> None:
    link = real["link"]
    print(
        f"\n## real: 2 gloo processes x 1 thread, {describe(argparse.Namespace(**{**vars(args), 'microbatches': 'M', 'mbs': 'batch / M'}))}; "
        f"batch {args.batch} sequences; stages hold blocks {' and '.join(f'[{lo}, {hi})' for lo, hi in real['bounds'])}; link {link['latency'] * 1e6:.0f} us + "
        f"{link['bandwidth'] / 1e9:.2f} GB/s (ping-pong)\n"
    )
    for m, d in real["per_m"].items():
        rows = real["per_m"][m]["rows"]
        base = rows[0]
        sa = d["saved"]
        print(
            f"### M = {m} micro-batches of {d['mbs']} sequences: per micro-batch f + b = {ms(sum(d['stage_fb'][0]))} / "
            f"{ms(sum(d['stage_fb'][1]))} ms on stage 0 / 1 (profiled, the loss on stage 1); saved for backward per micro-batch: "
            f"{mbytes(sa[0]['activations'])} / {mbytes(sa[1]['activations'])} MB activations "
            f"({mbytes(sa[0]['all'])} / {mbytes(sa[1]['all'])} MB with the weights autograd also saves); foreign load per round "
            f"{', '.join(f'{v:.2f}' for v in d['loads'])} CPUs\n"
        )
        print(
            "| advance_num | iteration ms: median (p25-p75) | per-round medians | vs 1F1B | simulated ms | simulated vs 1F1B "
            "| training step ms | peak stash (micro-batches) stage 0 / 1 | peak stash MB (bytes/mb x peak) | live saved peak MB (one step) "
            "| minor page faults per step, rank 0 / 1 |"
        )
        print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            lo, med, hi = r["iter"]
            check = "" if r["peak_checked"] else " (!)"
            print(
                f"| {label(r['a'], m)} | {ms(med)} ({ms(lo)}-{ms(hi)}) | {' / '.join(ms(v) for v in r['rounds'])} | "
                f"{base['iter'][1] / med:.3f}x | {ms(r['sim'])} | {base['sim'] / r['sim']:.3f}x | {ms(r['step'])} | "
                f"{r['peak'][0]} / {r['peak'][1]}{check} | {mbytes(r['stash'][0])} / {mbytes(r['stash'][1])} | "
                f"{mbytes(r['live'][0])} / {mbytes(r['live'][1])} | {r['faults'][0]:.0f} / {r['faults'][1]:.0f} |"
            )
        best = min(rows, key=lambda r: r["iter"][1])
        afab = rows[-1]
        spread = statistics.median((r["iter"][2] - r["iter"][0]) / r["iter"][1] for r in rows)
        print(
            f"\nM={m}: fastest measured a = {best['a']} ({ms(best['iter'][1])} ms, {base['iter'][1] / best['iter'][1]:.3f}x 1F1B); "
            f"AFAB/1F1B measured {base['iter'][1] / afab['iter'][1]:.3f}x (on the 25th percentiles {base['iter'][0] / afab['iter'][0]:.3f}x), "
            f"simulated {base['sim'] / afab['sim']:.3f}x; "
            f"typical interquartile spread of a step {100 * spread:.1f}% of its median; peak stash AFAB/1F1B stage 0 "
            f"{afab['stash'][0] / base['stash'][0]:.1f}x, stage 1 {afab['stash'][1] / base['stash'][1]:.1f}x"
        )
        visits = replay_rule({r["a"]: r["iter"][1] for r in rows}, 1, m)
        print(f"the rule replayed on these medians (noise-free, one value per a): visits {visits}, settles at {visits[-1]}")
        vs = d["variant_sim"]
        if vs:
            print(
                "simulated, variant with the last stage kept at 1F1B: "
                + ", ".join(f"a={a} {ms(t)} ms" for a, t in vs.items())
                + f" (package a=1 {ms(base['sim'])}, AFAB {ms(afab['sim'])})\n"
            )


def print_emulated(emu: dict, args: Any) -> None:
    link = emu["link"]
    print(
        f"\n## EMULATED devices: 2 processes, one sleeping block per stage (forward {args.tf:g} ms, backward "
        f"{args.tb if args.tb is not None else 2 * args.tf:g} ms; profiled f {ms(emu['f'][0])} / {ms(emu['f'][1])}, "
        f"b {ms(emu['b'][0])} / {ms(emu['b'][1])} ms with the loss), real gloo messages of {args.emu_rows} x {args.emu_hidden} "
        f"float32 (link {link['latency'] * 1e6:.0f} us + {link['bandwidth'] / 1e9:.2f} GB/s) plus an EMULATED per-message "
        f"delay; medians of {args.emu.steps} steps after {args.emu.warmup} warm-up\n"
    )
    for m, d in emu["per_m"].items():
        rows = d["rows"]
        print(f"### EMULATED, M = {m}: iteration ms measured (simulated), peak stash in micro-batches stage 0 / 1\n")
        lats = list(args.latencies)
        head = " | ".join(f"delay {lat:g} ms" for lat in lats)
        print(f"| variant | advance_num | peak stash | {head} |")
        print("|---|---|---:|" + "---:|" * len(lats))
        for variant in args.variants:
            for a in variant_values(variant, m):
                cells = []
                for lat in lats:
                    r = next(x for x in rows if x["latency"] == lat and x["variant"] == variant and x["a"] == a)
                    base = next(x for x in rows if x["latency"] == lat and x["variant"] == "package" and x["a"] == 1)
                    cells.append(f"{ms(r['iter'][1])} ({ms(r['sim'])}) {base['iter'][1] / r['iter'][1]:.2f}x")
                peak = held(variant, m, a)
                name = "package" if variant == "package" else "last stage 1F1B"
                print(f"| {name} | {label(a, m)} | {peak[0]} / {peak[1]} | " + " | ".join(cells) + " |")
        print("\n(each cell: measured median (simulated) and measured speed-up over 1F1B at that delay; ALL EMULATED)")
        for lat in lats:
            for variant in args.variants:
                times = {
                    x["a"]: x["iter"][1]
                    for x in rows
                    if x["latency"] == lat
                    and (x["variant"] == variant or x["a"] in (1, m))
                    and not (x["variant"] == "package" and variant != "package" and 1 < x["a"] < m)
                }
                visits = replay_rule(times, 1, m)
                name = "package" if variant == "package" else "last stage 1F1B"
                print(
                    f"EMULATED delay {lat:g} ms, {name}: the rule replayed on the medians visits {visits}, settles at {visits[-1]} "
                    f"({ms(times[visits[-1]])} ms; fastest a = {min(times, key=times.get)}, {ms(min(times.values()))} ms)"
                )


def print_deeper(emu: dict, args: Any) -> None:
    """Simulator only (nothing measured): K = --deep-stages stages of the emulated block's profiled
    costs, M = --deep-microbatches, the same delays: the package's advance vs the variant."""
    from lightning_pipe.simulation import CostModel, simulate

    k, m = args.deep_stages, args.deep_microbatches
    f, b = emu["f"], emu["b"]
    forward = (f[0],) * (k - 1) + (f[-1],)
    backward = (b[0],) * (k - 1) + (b[-1],)
    size = float(args.emu_rows * args.emu_hidden * 4)
    bounds = [(i, i + 1) for i in range(k)]
    lats = list(args.latencies)
    print(
        f"\n### SIMULATED only: K = {k} stages of the emulated block, M = {m}; iteration ms, package / last stage 1F1B; "
        "max peak stash over the stages (micro-batches), package / variant\n"
    )
    print("| advance_num | max peak stash | " + " | ".join(f"delay {lat:g} ms" for lat in lats) + " |")
    print("|---|---:|" + "---:|" * len(lats))
    for a in range(k - 1, m + 1):
        cells, peaks = [], []
        for variant in ("package", "last1f1b"):
            peaks.append(max(simulate(schedule_of(variant, m, a, k), CostModel(forward, backward), bounds).peak_activations))
        for lat in lats:
            costs = CostModel(forward, backward, (size,) * k, (0.0,) * k, emu["link"]["bandwidth"], emu["link"]["latency"] + lat / 1e3)
            t = [simulate(schedule_of(v, m, a, k), costs, bounds, critical_path=False).iteration_time for v in ("package", "last1f1b")]
            cells.append(f"{ms(t[0])} / {ms(t[1])}")
        print(f"| {label(a, m) if a != k - 1 else f'{a} (1F1B)'} | {peaks[0]} / {peaks[1]} | " + " | ".join(cells) + " |")


def print_cli(cli: list[dict]) -> None:
    print("\n## Algorithm 1's adaptive rule through the CLI (train.log)\n")
    print("| run | exit | seconds | sequence: a (step ms) -> next | settled at |")
    print("|---|---:|---:|---|---:|")
    for c in cli:
        seq = "; ".join(f"step {d['step']}: {d['a']} ({d['ms']:.1f} ms) -> {d['next']} {d['why']}" for d in c["decisions"])
        settled = c["settled"] if c["settled"] is not None else "not settled"
        print(f"| {c['kind']} | {c['returncode']} | {c['seconds']:.0f} | {seq or 'no decision logged'} | {settled} |")
        if c["tail"]:
            print("  " + " / ".join(c["tail"]))
    for c in cli[:1] + [c for c in cli if c["recipe"] != cli[0]["recipe"]][:1]:
        print(f"command: python {c['command']}")


# ---- the figure -----------------------------------------------------------------------------------
def figure(data: dict, path: str, m: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    real = data.get("real")
    emu = data.get("emulated")
    panels = [p for p in (real, emu) if p]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.6), squeeze=False)
    axes = axes[0]
    k = 0
    if real and m in real["per_m"]:
        rows = real["per_m"][m]["rows"]
        a = [r["a"] for r in rows]
        ax = axes[k]
        ax.errorbar(
            a,
            [r["iter"][1] * 1e3 for r in rows],
            yerr=[[(r["iter"][1] - r["iter"][0]) * 1e3 for r in rows], [(r["iter"][2] - r["iter"][1]) * 1e3 for r in rows]],
            marker="o",
            capsize=3,
            label="measured iteration (median, p25-p75)",
        )
        ax.plot(a, [r["sim"] * 1e3 for r in rows], "s--", label="simulated iteration")
        ax.set_xlabel("advance_num (1 = 1F1B, M = AFAB)")
        ax.set_ylabel("iteration ms")
        ax.set_title(f"real: 2 gloo CPU processes, GPT-tiny, M = {m}")
        ax.set_ylim(0, max(r["iter"][2] for r in rows) * 1e3 * 1.35)
        twin = ax.twinx()
        for s, style in ((0, "^:"), (1, "v:")):
            twin.plot(a, [r["stash"][s] / MB for r in rows], style, color=f"C{2 + s}", label=f"peak stash stage {s} (MB)")
        twin.set_ylabel("peak stashed activations, MB")
        twin.set_ylim(0, max(max(r["stash"]) for r in rows) / MB * 1.1)
        lines = ax.get_legend_handles_labels()
        more = twin.get_legend_handles_labels()
        ax.legend(lines[0] + more[0], lines[1] + more[1], loc="lower right", fontsize=8)
        k += 1
    if emu:
        key = m if m in emu["per_m"] else next(iter(emu["per_m"]))
        rows = emu["per_m"][key]["rows"]
        ax = axes[k]
        lats = sorted({r["latency"] for r in rows})
        for i, lat in enumerate(lats):
            for variant, style in (("package", "-"), ("last1f1b", "--")):
                sel = [r for r in rows if r["latency"] == lat and (r["variant"] == variant or r["a"] in (1, key))]
                sel.sort(key=lambda r: r["a"])
                if variant == "last1f1b" and not any(r["variant"] == variant for r in sel):
                    continue
                pick = {}
                for r in sel:  # a = 1 and a = M come from the package's runs
                    if r["variant"] == variant or r["a"] not in pick:
                        pick[r["a"]] = r
                xs = sorted(pick)
                name = "package (stage 1 holds a - 1)" if variant == "package" else "variant: last stage 1F1B (holds 1)"
                ax.plot(xs, [pick[x]["iter"][1] * 1e3 for x in xs], style, marker="o", color=f"C{i}", label=f"delay {lat:g} ms, {name}")
                ax.plot(xs, [pick[x]["sim"] * 1e3 for x in xs], style, color=f"C{i}", alpha=0.35)
        ax.set_xlabel("advance_num (1 = 1F1B, M = AFAB)")
        ax.set_ylabel("iteration ms")
        ax.set_title(f"EMULATED devices (sleep) + EMULATED message delay, M = {key}\n(faint: simulated)")
        ax.legend(fontsize=7)
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"\nfigure written to {path}")


# ---- main -------------------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(v) for v in s.split(",") if v.strip()]
    floats = lambda s: [float(v) for v in s.split(",") if v.strip()]
    p.add_argument("--part", choices=["real", "emulated", "cli", "all"], default="all")
    p.add_argument("--save", help="write the measurements (JSON) here")
    p.add_argument("--load", help="print (and plot) measurements saved by --save instead of measuring")
    p.add_argument("--figure", help="write the Fig. 7-style trade-off (PNG) here, e.g. docs/img/advance_tradeoff.png")
    p.add_argument("--figure-m", type=int, default=8, help="the M the figure shows")
    g = p.add_argument_group("real processes (GPT)")
    add_model_arguments(g, layers=4, vocab=260)
    g.add_argument("--batch", type=int, default=16, help="sequences per step (split into M micro-batches)")
    g.add_argument("--microbatches", type=ints, default=[4, 8, 16], help="M values (divisors of --batch)")
    g.add_argument("--split", type=int, default=0, help="blocks on stage 0 (0: half)")
    g.add_argument("--steps", type=int, default=8, help="timed steps per advance_num and round")
    g.add_argument("--warmup", type=int, default=2)
    g.add_argument("--rounds", type=int, default=4, help="passes over all advance_num (alternating order); steps are pooled")
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--profile-repeats", type=int, default=10)
    g = p.add_argument_group("emulated devices (sleep) and emulated message delay")
    g.add_argument("--emu-microbatches", type=ints, default=[8])
    g.add_argument("--tf", type=float, default=4.0, help="forward sleep per stage and micro-batch, ms")
    g.add_argument("--tb", type=float, default=None, help="backward sleep, ms (default 2 x --tf)")
    g.add_argument("--latencies", type=floats, default=[0.0, 2.0, 8.0], help="emulated delay per message, ms")
    g.add_argument("--emu-rows", type=int, default=256, help="activation rows per micro-batch (256 x 128 = GPT-tiny's at M = 8)")
    g.add_argument("--emu-hidden", type=int, default=128)
    g.add_argument("--emu-steps", type=int, default=6)
    g.add_argument("--emu-warmup", type=int, default=2)
    g.add_argument("--no-variant", action="store_true", help="emulated: only the package's schedule")
    g.add_argument("--deep-stages", type=int, default=4, help="simulator-only table: stages")
    g.add_argument("--deep-microbatches", type=int, default=16, help="simulator-only table: M")
    g = p.add_argument_group("the adaptive rule through the CLI")
    g.add_argument("--cli-microbatches", type=int, default=8)
    g.add_argument("--cli-steps", type=int, default=20)
    g.add_argument("--cli-repeats", type=int, default=3, help="runs per recipe (the rule decides from single steps)")
    g.add_argument("--cli-dir", default=None, help="run folders (default: a temporary directory, kept)")
    g = p.add_argument_group("measurement")
    g.add_argument("--retries", type=int, default=1, help="repeats of a segment during which other processes used CPU")
    g.add_argument("--max-foreign", type=float, default=0.15, help="CPUs other processes may use before a segment counts as disturbed")
    g.add_argument("--quiet-wait", type=float, default=30.0, help="seconds to wait at most for a quiet machine before a segment")
    g.add_argument("--pin", action="store_true", help="pin rank r to CPU r (real and emulated jobs)")
    g.add_argument("--timeout", type=float, default=900.0, help="seconds per job before its processes are killed")
    args = p.parse_args()
    args.variants = ["package"] if args.no_variant else ["package", "last1f1b"]
    args.emu = argparse.Namespace(steps=args.emu_steps, warmup=args.emu_warmup, lr=args.lr)
    bad = [m for m in args.microbatches if m < 1 or args.batch % m]
    if bad:
        p.error(f"--microbatches {bad}: each must divide --batch {args.batch}")

    if args.load:
        data = json.loads(Path(args.load).read_text())
        for key, value in data.get("args", {}).items():  # print with the settings that were measured
            if key not in ("load", "save", "figure", "figure_m", "part"):
                setattr(args, key, value)
        args.emu = argparse.Namespace(steps=args.emu_steps, warmup=args.emu_warmup, lr=args.lr)
        for part in ("real", "emulated"):
            if part in data:
                data[part]["per_m"] = {int(k): v for k, v in data[part]["per_m"].items()}
        print(data.get("header", ""))
    else:
        started = time.monotonic()
        header = f"{provenance()}; {os.cpu_count()} cores; gloo, one thread per process"
        print(f"# bench_advance\n{header}", flush=True)
        data = {"header": header, "args": {k: v for k, v in vars(args).items() if k != "emu"}}
        if args.part in ("real", "all"):
            wait_for_quiet(args.quiet_wait, args.max_foreign, poll=5.0, patterns=OTHER_JOBS, log=print)
            results = run_distributed(real_job, STAGES, args, timeout=args.timeout, group_timeout=args.timeout, pin=args.pin)
            data["real"] = analyse_real(results)
        if args.part in ("emulated", "all"):
            results = run_distributed(emulated_job, STAGES, args, timeout=args.timeout, group_timeout=args.timeout, pin=args.pin)
            data["emulated"] = analyse_emulated(results, args)
        if args.part in ("cli", "all"):
            where = Path(args.cli_dir) if args.cli_dir else Path(tempfile.mkdtemp(prefix="bench_advance_cli_"))
            data["cli"] = cli_runs(args, where)
        data["seconds"] = time.monotonic() - started
        if args.save:
            Path(args.save).write_text(json.dumps(data, indent=1, default=str))
            print(f"measurements saved to {args.save}")
    if "real" in data:
        print_real(data["real"], args)
    if "emulated" in data:
        print_emulated(data["emulated"], args)
        if not args.no_variant and args.deep_stages > 2:
            print_deeper(data["emulated"], args)
    if "cli" in data:
        print_cli(data["cli"])
    if args.figure:
        figure(data, args.figure, args.figure_m)
    if "seconds" in data:
        print(f"\ntotal {data['seconds']:.0f} s")


if __name__ == "__main__":
    main()
