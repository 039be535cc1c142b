"""Simulated vs measured iteration time per partition: the AutoPipe paper's Table II / Fig. 11 on CPU.

A small GPT (lightning_pipe.models.build_gpt; 4 layers = 10 sub-layer blocks by default) is trained
with our runtime (SequentialPipeline, 1F1B, m = 8 micro-batches) on 4 gloo processes with one
thread each, under 7 partitions: uniform (Megatron-LM's equal layers), dp, autopipe, parameters and
3 deliberately unbalanced ones (the splits whose simulated iteration is closest to 1.25x, 1.5x and
1.8x the best one). For each partition the measured iteration time (median over the timed steps
after warm-up, of the wall time from the first rank entering the step to the last one leaving it;
the optimizer step is not part of it, as it is not part of the simulator's iteration) is put next
to the simulator's prediction from a profile taken in the same job:

- profile: every rank runs `profile_blocks` on all blocks at the same time, so each block is timed
  while the other processes compute too (as in training, where the ranks share the CPU cores); the
  per-block figure is the median over the ranks' medians. For comparison a second profile is taken
  on rank 0 alone while the other ranks wait ("lone");
- link: latency and bandwidth fitted to a ping-pong (isend / irecv, as the Transport does) between
  ranks 0 and 1, message sizes 4 B .. 4 MB, while ranks 2 and 3 wait;
- partitions are planned on rank 0 from that profile and link and broadcast.

Printed per partition: measured, simulated, error; then the Spearman rank correlation over the
partitions. Targets (issue): every partition within 10%, rank correlation 1.0. The same is repeated
with 2 processes (2 stages) as a supplementary table: 4 processes on a 2-core machine oversubscribe
the cores, which no per-block profile can express (see docs/autopipe.md).

Timing hygiene: before the job and before each measured segment, the script waits (polling every
20 s, up to --quiet-wait s) until no other benchmark or test runs (`pgrep -f bench_runtime`,
`pgrep -f pytest`) and the machine is idle; it measures the CPU time other processes took during
each segment ("foreign load", from /proc/stat minus the ranks' own CPU time) and repeats a
disturbed segment (up to --retries times), keeping the least disturbed one.

    python benchmarks/bench_simulator.py                      # 4 then 2 processes, pictures in docs/img
    python benchmarks/bench_simulator.py --worlds 4 --steps 20 --rounds 3
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

KINDS = {"Embedding": "embedding", "ResidualAttentionBlock": "attention", "ResidualFFNBlock": "ffn", "LMHead": "head"}
METHODS = ("uniform", "dp", "autopipe", "parameters")
UNBALANCED = (1.25, 1.5, 1.8)  # simulated iteration of the extra splits, relative to the best split


# ---- the machine: other jobs, foreign load -----------------------------------------------------
def _busy_seconds() -> Optional[float]:
    """CPU seconds the whole machine has been busy (Linux /proc/stat: user .. steal)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    """CPU seconds of this process, all its threads (gloo's included)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def other_jobs() -> list[str]:
    """Command lines of other benchmarks / test runs that would disturb a timing (pgrep -f)."""
    found = []
    for pattern in ("bench_[r]untime", "[p]ytest"):  # the brackets keep pgrep from matching itself
        try:
            out = subprocess.run(["pgrep", "-af", pattern], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        found += [line for line in out.splitlines() if line.strip() and str(os.getpid()) != line.split()[0]]
    return found


def wait_for_quiet(max_wait: float, max_load: float, poll: float = 20.0, log: Callable[[str], None] = print) -> float:
    """Wait until no other benchmark / test runs and other processes use < `max_load` CPUs (at most
    `max_wait` s, polling every `poll` s). Returns the foreign load seen last (CPUs)."""
    deadline = time.monotonic() + max_wait
    while True:
        jobs = other_jobs()
        load = 0.0
        if not jobs:
            b0, o0 = _busy_seconds(), _own_seconds()
            time.sleep(1.0)
            b1, o1 = _busy_seconds(), _own_seconds()
            load = max(0.0, (b1 - b0) - (o1 - o0)) if b0 is not None else 0.0
            if load < max_load:
                return load
        if time.monotonic() + poll > deadline:
            log(f"  machine still busy after {max_wait:.0f} s ({len(jobs)} other jobs, load {load:.2f} CPUs): measuring anyway")
            return load
        what = f"{len(jobs)} other benchmark/test processes" if jobs else f"other processes using {load:.2f} CPUs"
        log(f"  waiting for a quiet machine: {what}")
        time.sleep(poll)


def provenance() -> str:
    """Date, CPU model, torch, and the library's git state (uncommitted changes under lightning_pipe/)."""
    def run(*cmd: str) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=10, cwd=ROOT).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    model = next((l.split(":", 1)[1].strip() for l in run("lscpu").splitlines() if l.startswith("Model name")), "?")
    dirty = run("git", "status", "--short", "--", "lightning_pipe").replace("\n", ", ")
    return (f"{time.strftime('%a %b %d %H:%M:%S %Z %Y')}; {model}, {os.cpu_count()} CPUs; Python {sys.version.split()[0]}, torch "
            f"{torch.__version__}; commit {run('git', 'rev-parse', '--short', 'HEAD') or '?'}"
            + (f" with uncommitted library changes: {dirty}" if dirty else ""))


# ---- model, data, link -------------------------------------------------------------------------
def model_config(args: Any):
    from lightning_pipe.models import ModelConfig

    return ModelConfig(vocab_size=args.vocab, n_layer=args.layers, n_head=args.heads, d_model=args.hidden, max_seq_len=args.seq)


def build_model(args: Any) -> nn.Sequential:
    from lightning_pipe.models import build_gpt

    torch.manual_seed(0)
    return build_gpt(model_config(args))


def block_kinds(model: nn.Sequential) -> list[str]:
    return [KINDS.get(type(b).__name__, "block") for b in model]


def make_batch(args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of m micro-batches of random token ids (inputs, next-token targets)."""
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, args.vocab, (args.mbs * args.microbatches, args.seq + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def ping_pong(rank: int, sizes: Sequence[int] = (4, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22), repeats: int = 30,
              warmup: int = 5) -> Optional[dict]:
    """Ranks 0 and 1 bounce float32 messages (isend / irecv + wait, as the Transport); the others
    wait. Returns, on rank 0, the one-way times (median round trip / 2) and the fit
    ``time = latency + bytes / bandwidth``: latency is the smallest message's time, bandwidth the
    least-squares fit of the larger ones' extra time."""
    result = None
    if rank in (0, 1):
        peer = 1 - rank
        samples = []
        for size in sizes:
            buf = torch.zeros(max(1, size // 4))
            times = []
            for i in range(warmup + repeats):
                t0 = time.perf_counter()
                if rank == 0:
                    dist.isend(buf, peer).wait()
                    dist.irecv(buf, peer).wait()
                else:
                    dist.irecv(buf, peer).wait()
                    dist.isend(buf, peer).wait()
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
            samples.append((buf.numel() * 4, statistics.median(times) / 2))
        if rank == 0:
            latency = samples[0][1]  # the smallest message: latency alone
            rest = [(b, t - latency) for b, t in samples[1:]]
            per_byte = sum(b * t for b, t in rest) / sum(b * b for b, _ in rest)  # least squares through the origin
            result = {"latency": latency, "bandwidth": 1.0 / per_byte if per_byte > 0 else math.inf, "samples": samples}
    dist.barrier()
    return result


# ---- profiles ----------------------------------------------------------------------------------
class LossBlock(nn.Module):
    """The last stage's loss as a block, so the profile times it too: SequentialHost runs the loss
    function after the last block, inside the last stage's forward, and backward starts from it."""

    def __init__(self, target: torch.Tensor):
        super().__init__()
        self.target = target

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits, self.target)


def gather_profile(blocks: Sequence[nn.Module], sample: Any, target: Any, rank: int, world: int, repeats: int, alone: bool,
                   name: str, mbs: int):
    """Profile every block, and the loss (folded into the last block's times); concurrently on all
    ranks (``alone=False``) or on rank 0 while the others wait. Every rank returns the same Profile
    (per block the median over the ranks that measured) and the loss's forward / backward seconds."""
    from lightning_pipe.profiler import Profile, profile_blocks

    dist.barrier()
    measured = None
    if not alone or rank == 0:
        measured = profile_blocks(list(blocks) + [LossBlock(target)], sample, torch.device("cpu"), model=name,
                                  repeats=repeats, warmup=2)
    parts: list = [None] * world
    dist.all_gather_object(parts, measured)
    parts = [p for p in parts if p is not None]
    n = len(blocks)
    field = lambda key: [statistics.median(p[i][key] for p in parts) for i in range(n + 1)]  # noqa: E731
    forward, backward = field("forward"), field("backward")
    loss = (forward.pop(), backward.pop())
    forward[-1] += loss[0]
    backward[-1] += loss[1]
    profile = Profile(name, mbs, "float32", "cpu", forward, backward, field("activation_bytes")[:n], field("param_bytes")[:n],
                      field("peak_memory")[:n], [type(b).__name__ for b in blocks])
    return profile, loss


# ---- partitions ----------------------------------------------------------------------------------
def all_splits(num_blocks: int, stages: int):
    from itertools import combinations

    for cuts in combinations(range(1, num_blocks), stages - 1):
        edges = (0, *cuts, num_blocks)
        yield tuple((edges[i], edges[i + 1]) for i in range(stages))


def choose_partitions(costs, kinds: Sequence[str], stages: int, m: int, count: int = 7) -> list[tuple[str, tuple]]:
    """(label, bounds): the named methods (a method that lands on an earlier one's split is folded
    into its label), then unbalanced splits at the UNBALANCED ratios of the best simulated time,
    then more of them until there are `count` distinct splits."""
    from lightning_pipe.planning import plan
    from lightning_pipe.schedules import build_schedule
    from lightning_pipe.simulator import simulate

    chosen: list[list] = []
    for method in METHODS:
        bounds = tuple(tuple(b) for b in plan(costs, stages, m, method=method, kinds=kinds).bounds)
        same = next((c for c in chosen if c[1] == bounds), None)
        if same is not None:
            same[0] += f" = {method}"
        else:
            chosen.append([method, bounds])
    schedule = build_schedule("1f1b", stages, m)
    timed = sorted((simulate(schedule, costs, b, critical_path=False).iteration_time, b) for b in all_splits(len(kinds), stages))
    best = timed[0][0]
    taken = {c[1] for c in chosen}
    ratios = list(UNBALANCED) + [2.0 + 0.3 * i for i in range(count)]
    for ratio in ratios:
        if len(chosen) >= count:
            break
        free = [(abs(t / best - ratio), b) for t, b in timed if b not in taken]
        if not free:
            break
        _, bounds = min(free)
        taken.add(bounds)
        chosen.append(["unbalanced-", bounds])
    # number the unbalanced ones 1, 2, 3 in order
    k = 0
    for c in chosen:
        if c[0].startswith("unbalanced-"):
            k += 1
            c[0] = f"unbalanced-{k}"
    return [(label, bounds) for label, bounds in chosen]


def sizes_of(bounds: Sequence[tuple[int, int]]) -> list[int]:
    return [b - a for a, b in bounds]


# ---- the distributed job -----------------------------------------------------------------------
def _segment(run: Callable[[], Any], rank: int, world: int, args: Any, log) -> tuple[Any, float]:
    """Run `run` on all ranks, after waiting for a quiet machine; repeat it (at most args.retries
    times) if other processes used more than args.max_foreign CPUs meanwhile. Returns the least
    disturbed attempt's result and its foreign load (CPUs)."""
    best: Optional[tuple[float, Any]] = None
    for attempt in range(args.retries + 1):
        if rank == 0:
            wait_for_quiet(args.quiet_wait, args.max_foreign, log=log)
        dist.barrier()
        b0, o0, w0 = _busy_seconds(), _own_seconds(), time.monotonic()
        out = run()
        b1, o1, w1 = _busy_seconds(), _own_seconds(), time.monotonic()
        own = [None] * world
        dist.all_gather_object(own, o1 - o0)
        foreign = max(0.0, (b1 - b0) - sum(own)) / max(w1 - w0, 1e-9) if b0 is not None else 0.0
        if best is None or foreign < best[0]:
            best = (foreign, out)
        if foreign <= args.max_foreign:
            break
        if rank == 0:
            log(f"  segment disturbed: other processes used {foreign:.2f} CPUs"
                f"{'; repeating it' if attempt < args.retries else '; keeping the least disturbed attempt'}")
    return best[1], best[0]


def run_partition(model: nn.Sequential, bounds, rank: int, world: int, x, y, args: Any, steps: int, warmup: int,
                  trace: int = 0) -> dict:
    """Train `steps` timed steps (after `warmup`) with this rank's stage of `bounds`; returns per
    step (start, end) on the machine-wide monotonic clock, and the executor records of `trace`
    extra traced steps."""
    from lightning_pipe.runtime.p2p import Transport
    from lightning_pipe.runtime.sequential import SequentialHost, SequentialPipeline
    from lightning_pipe.schedules import build_schedule

    a, b = bounds[rank]
    chunk = nn.Sequential(*[model[i] for i in range(a, b)])
    host = SequentialHost({rank: chunk}, world - 1, lm_loss)
    pipe = SequentialPipeline(build_schedule("1f1b", world, args.microbatches), rank, host, Transport(lambda r: r, torch.device("cpu")))

    def step() -> tuple[float, float]:
        chunk.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        pipe.step(x, y)
        return t0, time.perf_counter()

    for _ in range(warmup):
        step()
    times = [step() for _ in range(steps)]
    traces = []
    if trace:
        pipe.executor.trace = True
        for _ in range(trace):
            span = step()
            traces.append((span, list(pipe.executor.records)))
        pipe.executor.trace = False
    chunk.zero_grad(set_to_none=True)
    return {"times": times, "traces": traces}


def simulator_job(rank: int, world: int, args: Any, log) -> dict:
    from lightning_pipe.profiler import Profile  # noqa: F401  (imported before timing)

    model = build_model(args)
    blocks = list(model)
    kinds = block_kinds(model)
    x, y = make_batch(args)
    sample, target = x[: args.mbs], y[: args.mbs]
    link, _ = _segment(lambda: ping_pong(rank), rank, world, args, log)
    (profile, loss), profile_load = _segment(
        lambda: gather_profile(blocks, sample, target, rank, world, args.profile_repeats, False, "gpt", args.mbs), rank, world, args, log)
    (lone, _), lone_load = _segment(
        lambda: gather_profile(blocks, sample, target, rank, world, args.profile_repeats, True, "gpt", args.mbs), rank, world, args, log)
    box = [None]
    if rank == 0:
        costs = profile.costs(link["bandwidth"], link["latency"])
        box = [{"link": link, "partitions": choose_partitions(costs, kinds, world, args.microbatches, args.partitions)}]
    dist.broadcast_object_list(box, 0)
    link, partitions = box[0]["link"], box[0]["partitions"]
    if rank == 0:
        log(f"  link: latency {link['latency'] * 1e6:.0f} us, bandwidth {link['bandwidth'] / 1e9:.2f} GB/s; "
            f"partitions: {', '.join(f'{l} {sizes_of(b)}' for l, b in partitions)}")
    runs: dict[int, list] = {i: [] for i in range(len(partitions))}
    loads: dict[int, list] = {i: [] for i in range(len(partitions))}
    traces: dict[int, list] = {}
    for rnd in range(args.rounds):
        order = list(range(len(partitions)))
        order = order[rnd % len(order):] + order[: rnd % len(order)]  # a different partition first each round
        for i in order:
            label, bounds = partitions[i]
            last = rnd == args.rounds - 1
            trace = args.trace_steps if last and "autopipe" in label.split(" = ") else 0
            out, load = _segment(lambda: run_partition(model, bounds, rank, world, x, y, args, args.steps, args.warmup, trace),
                                 rank, world, args, log)
            runs[i].append(out["times"])
            loads[i].append(load)
            if out["traces"]:
                traces[i] = out["traces"]
            if rank == 0:
                log(f"  round {rnd + 1}/{args.rounds} {label:<24} done (foreign load {load:.2f} CPUs)")
    return {"rank": rank, "link": link, "profile": profile, "loss": loss, "lone": lone, "profile_load": profile_load, "lone_load": lone_load,
            "partitions": partitions, "runs": runs, "loads": loads, "traces": traces}


# ---- launching ---------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, job: Callable, args: Any, out_dir: str) -> None:
    torch.set_num_threads(1)
    path = os.path.join(out_dir, f"{rank}.pt")
    log = (lambda msg: print(msg, flush=True)) if rank == 0 else (lambda msg: None)
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=60))
        result = job(rank, world, args, log)
        torch.save({"ok": True, "result": result}, path)
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(job: Callable, world: int, args: Any, timeout: float) -> list[dict]:
    """Run ``job(rank, world, args, log)`` on `world` spawned processes (gloo, 1 thread each)."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out_dir:
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, world, port, job, args, out_dir)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if hung:
            raise TimeoutError(f"ranks {hung} did not finish within {timeout:.0f} s")
        results = []
        for r in range(world):
            path = os.path.join(out_dir, f"{r}.pt")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {r} died without a result (exit code {procs[r].exitcode})")
            record = torch.load(path, weights_only=False)
            if not record["ok"]:
                raise RuntimeError(f"rank {r} failed:\n{record['error']}")
            results.append(record["result"])
    return results


# ---- analysis ----------------------------------------------------------------------------------
def iteration_times(results: list[dict], index: int) -> list[float]:
    """Per timed step: last rank's end - first rank's start (one machine-wide monotonic clock)."""
    out = []
    for rnd in range(len(results[0]["runs"][index])):
        for s in range(len(results[0]["runs"][index][rnd])):
            spans = [r["runs"][index][rnd][s] for r in results]
            out.append(max(e for _, e in spans) - min(t for t, _ in spans))
    return out


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return cov / var if var > 0 else float("nan")


def analyse(results: list[dict], world: int, m: int) -> dict:
    from lightning_pipe.schedules import build_schedule
    from lightning_pipe.simulator import simulate

    r0 = results[0]
    link, partitions = r0["link"], r0["partitions"]
    costs = r0["profile"].costs(link["bandwidth"], link["latency"])
    lone_costs = r0["lone"].costs(link["bandwidth"], link["latency"])
    schedule = build_schedule("1f1b", world, m)
    rows = []
    for i, (label, bounds) in enumerate(partitions):
        times = iteration_times(results, i)
        measured = statistics.median(times)
        sim = simulate(schedule, costs, bounds)
        lone = simulate(schedule, lone_costs, bounds, critical_path=False).iteration_time
        q1, _, q3 = statistics.quantiles(times, n=4) if len(times) >= 4 else (measured, measured, measured)
        rows.append({"label": label, "bounds": bounds, "sizes": sizes_of(bounds), "measured": measured, "iqr": (q1, q3),
                     "simulated": sim.iteration_time, "lone": lone, "error": sim.iteration_time / measured - 1,
                     "lone_error": lone / measured - 1, "master": sim.master_stage, "bubble": sim.bubble_ratio,
                     "load": max(r0["loads"][i]), "steps": len(times)})
    rho = spearman([r["measured"] for r in rows], [r["simulated"] for r in rows])
    rho_lone = spearman([r["measured"] for r in rows], [r["lone"] for r in rows])
    return {"world": world, "rows": rows, "rho": rho, "rho_lone": rho_lone, "link": link, "costs": costs, "schedule": schedule,
            "profile": r0["profile"], "loss": r0["loss"], "lone": r0["lone"], "profile_load": r0["profile_load"], "lone_load": r0["lone_load"],
            "traces": {i: t for i, t in r0["traces"].items()}, "results": results}


def report(a: dict, args: Any) -> str:
    world, rows = a["world"], a["rows"]
    lines = [
        f"{world} processes x 1 thread, {world} stages, 1F1B, m = {args.microbatches}; link: latency "
        f"{a['link']['latency'] * 1e6:.0f} us, bandwidth {a['link']['bandwidth'] / 1e9:.2f} GB/s (ping-pong rank 0 <-> 1)",
        f"profile: all {world} ranks at once (foreign load {a['profile_load']:.2f} CPUs), sum of f+b over blocks "
        f"{1e3 * sum(a['profile'].forward + a['profile'].backward):.1f} ms per micro-batch; lone (rank 0 alone): "
        f"{1e3 * sum(a['lone'].forward + a['lone'].backward):.1f} ms; the loss (in the head's figures): "
        f"{1e3 * a['loss'][0]:.2f} + {1e3 * a['loss'][1]:.2f} ms",
        "",
        "| partition | blocks per stage | measured ms | simulated ms | error | simulated from lone profile ms | error | master stage | foreign load |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['label']} | {r['sizes']} | {r['measured'] * 1e3:.1f} | {r['simulated'] * 1e3:.1f} | {r['error']:+.1%} | "
                     f"{r['lone'] * 1e3:.1f} | {r['lone_error']:+.1%} | {r['master']} | {r['load']:.2f} |")
    cores = os.cpu_count() or 1
    floor = args.microbatches * sum(a["lone"].forward + a["lone"].backward) / min(cores, world)
    worst = max(abs(r["error"]) for r in rows)
    lines += ["", f"CPU floor: m x (lone f+b of all blocks) / min(cores, ranks) = {floor * 1e3:.1f} ms per step "
                  f"({cores} cores for {world} ranks)"]
    worst_lone = max(abs(r["lone_error"]) for r in rows)
    lines += [
        "",
        f"Spearman rank correlation (measured vs simulated): {a['rho']:.3f}; from the lone profile: {a['rho_lone']:.3f}",
        f"largest |error|: {worst:.1%} (profile taken concurrently), {worst_lone:.1%} (lone profile)",
        f"targets: every partition within 10% -> {'met' if worst <= 0.10 else 'missed'}; rank correlation 1.0 -> "
        f"{'met' if a['rho'] > 0.9999 else 'missed'}",
    ]
    return "\n".join(lines)


# ---- pictures ----------------------------------------------------------------------------------
def plot_comparison(analyses: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(analyses), figsize=(6.5 * len(analyses), 4.2), squeeze=False)
    for ax, a in zip(axes[0], analyses):
        rows = a["rows"]
        xs = range(len(rows))
        ax.plot(xs, [r["measured"] * 1e3 for r in rows], "o-", label="measured (median step)", color="#4C72B0")
        ax.fill_between(xs, [r["iqr"][0] * 1e3 for r in rows], [r["iqr"][1] * 1e3 for r in rows], color="#4C72B0", alpha=0.2,
                        label="measured, quartiles")
        ax.plot(xs, [r["simulated"] * 1e3 for r in rows], "s--", label="simulated (concurrent profile)", color="#DD8452")
        ax.plot(xs, [r["lone"] * 1e3 for r in rows], "^:", label="simulated (lone profile)", color="#8C8C8C")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{r['label'].replace(' = ', '=')}\n{r['sizes']}" for r in rows], fontsize=7, rotation=30, ha="right")
        ax.set_ylabel("iteration time (ms)")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{a['world']} processes on 2 cores: Spearman {a['rho']:.2f}, max |error| "
                     f"{max(abs(r['error']) for r in rows):.0%}", fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_timelines(a: dict, folder: Path, label: str = "autopipe") -> list[Path]:
    from lightning_pipe.simulator import simulate
    from lightning_pipe.viz import gantt, traced_timeline

    index = next((i for i, r in enumerate(a["rows"]) if label in r["label"].split(" = ")), None)
    if index is None or index not in a["traces"]:
        return []
    row = a["rows"][index]
    # the traced step whose iteration is the median one, records of all ranks (one monotonic clock)
    per_step = []
    for s in range(len(a["traces"][index])):
        records = [r["traces"][index][s][1] for r in a["results"]]
        spans = [r["traces"][index][s][0] for r in a["results"]]
        per_step.append((max(e for _, e in spans) - min(t for t, _ in spans), records))
    per_step.sort(key=lambda t: t[0])
    measured = traced_timeline(a["schedule"], per_step[len(per_step) // 2][1])
    predicted = simulate(a["schedule"], a["costs"], row["bounds"])
    out_m = gantt(measured, folder / "measured_timeline.png",
                  title=f"measured: {label} {row['sizes']}, {a['world']} processes, 1F1B m={a['schedule'].num_microbatches}: "
                        f"iteration {measured.iteration_time * 1e3:.1f} ms")
    out_p = gantt(predicted, folder / "predicted_timeline.png",
                  title=f"simulated: {label} {row['sizes']}, {a['world']} stages, 1F1B m={a['schedule'].num_microbatches}: "
                        f"iteration {predicted.iteration_time * 1e3:.1f} ms, bubble {predicted.bubble_ratio:.0%}, master stage {predicted.master_stage}")
    return [out_m, out_p]


# ---- main --------------------------------------------------------------------------------------
def add_common_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=12, help="timed steps per partition and round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    p.add_argument("--rounds", type=int, default=2, help="passes over all partitions (interleaved); steps are pooled")
    p.add_argument("--profile-repeats", type=int, default=10, help="profile_blocks repeats per block (after 2 warm-up)")
    p.add_argument("--retries", type=int, default=2, help="repeats of a segment during which other processes used CPU")
    p.add_argument("--max-foreign", type=float, default=0.15, help="CPUs other processes may use before a segment counts as disturbed")
    p.add_argument("--quiet-wait", type=float, default=600.0, help="seconds to wait at most for a quiet machine before a segment")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per job before its processes are killed")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", type=int, nargs="+", default=[4, 2], help="processes (= stages) per job")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--mbs", type=int, default=4, help="micro-batch size (sequences)")
    p.add_argument("--partitions", type=int, default=7)
    p.add_argument("--trace-steps", type=int, default=3, help="traced steps of the autopipe partition (last round)")
    p.add_argument("--pictures", default=str(ROOT / "docs" / "img"), help="folder for the pictures ('' for none)")
    add_common_arguments(p)
    args = p.parse_args()
    started = time.time()
    print(provenance())
    print(f"gloo, 1 thread per process; GPT {args.layers} layers "
          f"({2 * args.layers + 2} blocks), hidden {args.hidden}, heads {args.heads}, seq {args.seq}, vocab {args.vocab}, "
          f"micro-batch {args.mbs}, m = {args.microbatches}", flush=True)
    analyses = []
    for world in args.worlds:
        print(f"\n== {world} processes ==", flush=True)
        wait_for_quiet(args.quiet_wait, args.max_foreign)
        results = launch(simulator_job, world, args, args.timeout)
        a = analyse(results, world, args.microbatches)
        analyses.append(a)
        print(report(a, args), flush=True)
    if args.pictures:
        folder = Path(args.pictures)
        plot_comparison(analyses, folder / "simulated_vs_measured.png")
        written = [folder / "simulated_vs_measured.png"] + plot_timelines(analyses[0], folder)
        print("\npictures: " + ", ".join(str(w) for w in written))
    print(f"\ntotal {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
