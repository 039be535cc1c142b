"""Simulated vs measured iteration time per partition: the AutoPipe paper's Table II / Fig. 11 on CPU.

A small GPT (lightning_pipe.models.build_gpt; 4 layers = 10 sub-layer blocks by default) is trained
with our runtime (SequentialPipeline, 1F1B, m = 8 micro-batches) on 4 gloo processes with one
thread each, under 7 partitions: uniform (Megatron-LM's equal layers), dp, autopipe, parameters and
deliberately unbalanced ones (the splits whose simulated iteration is closest to 1.25x, 1.5x,
1.8x, 2x.. the best one). For each partition the measured iteration time (median over the timed
steps after warm-up, of the wall time from the first rank entering the step to the last one leaving
it; the optimizer step is not part of it, as it is not part of the simulator's iteration) is put
next to the simulator's prediction from a profile taken in the same job:

- profile: `profile_blocks(..., loss_fn=cross-entropy, inflight=4)`: the blocks run back to back as
  a stage does, 4 micro-batches in flight, each block timed between its neighbours, and the loss
  timed with the LM head (the last stage computes it). min(cores, processes) ranks profile at the
  same time while the others wait: each profiling rank has a core to itself, with a neighbour
  computing too, as in training; the per-block figure is the median over those ranks;
- shared cores: with more processes than cores (4 on 2) the simulator is told ``cores``
  (`CostModel.cores`): while k ranks compute, each runs at min(1, cores / k) of its profiled speed;
- link: latency and bandwidth fitted to a ping-pong (isend / irecv, as the Transport does) between
  ranks 0 and 1, message sizes 4 B .. 4 MB, while the other ranks wait;
- partitions are planned on rank 0 from that profile and link and broadcast.

Also simulated, to show what each ingredient is worth: the same with per-block profiles (each block
alone on one input, backward right after forward: hot caches), without the cores model, from a
profile with all ranks at once (contention baked into every block), and from rank 0 alone. Every
timed step is traced (`trace=True`: pure compute time, waits excluded), so the traced compute time
per rank can be compared with the simulated one.

Printed per partition: measured, simulated, error; then the Spearman rank correlation over the
partitions. Targets (issue): every partition within 10%, rank correlation 1.0. The same is repeated
with 2 processes (2 stages, a core each).

Timing hygiene: before the job and before each measured segment, the script waits (polling every
20 s, up to --quiet-wait s) until no other benchmark or test runs (`pgrep -f bench_runtime`,
`pgrep -f pytest`) and the machine is idle; it measures the CPU time other processes took during
each segment ("foreign load", from /proc/stat minus the ranks' own CPU time) and repeats a
disturbed segment (up to --retries times), keeping the least disturbed one. Run it under
`flock /tmp/bench.lock` when other benchmarks share the machine.

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
    return (
        f"{time.strftime('%a %b %d %H:%M:%S %Z %Y')}; {model}, {os.cpu_count()} CPUs; Python {sys.version.split()[0]}, torch "
        f"{torch.__version__}; commit {run('git', 'rev-parse', '--short', 'HEAD') or '?'}"
        + (f" with uncommitted library changes: {dirty}" if dirty else "")
    )


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


def ping_pong(
    rank: int, sizes: Sequence[int] = (4, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22), repeats: int = 30, warmup: int = 5
) -> Optional[dict]:
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
def profile_at_once(
    blocks: Sequence[nn.Module],
    sample: Any,
    target: Any,
    rank: int,
    world: int,
    repeats: int,
    profilers: int,
    inflight: Optional[int],
    name: str,
    mbs: int,
):
    """Profile every block, the loss timed with the last one (`loss_fn`); ranks < `profilers` at
    the same time while the others wait. ``inflight``: chain mode (see profile_blocks), None: each
    block alone. Every rank returns the same Profile: per block the median over the ranks that
    measured."""
    from lightning_pipe.profiler import Profile, profile_blocks

    dist.barrier()
    measured = None
    if rank < profilers:
        chain = inflight is not None
        measured = profile_blocks(
            blocks,
            sample,
            torch.device("cpu"),
            model=name,
            loss_fn=lambda out: lm_loss(out, target),
            inflight=inflight,
            repeats=max(1, repeats // inflight) if chain else repeats,
            warmup=1 if chain else 2,
        )
    parts: list = [None] * world
    dist.all_gather_object(parts, measured)
    parts = [p for p in parts if p is not None]
    field = lambda key: [statistics.median(p[i][key] for p in parts) for i in range(len(blocks))]  # noqa: E731
    return Profile(
        name,
        mbs,
        "float32",
        "cpu",
        field("forward"),
        field("backward"),
        field("activation_bytes"),
        field("param_bytes"),
        field("peak_memory"),
        [type(b).__name__ for b in blocks],
    )


# The loss as an extra block, for bench_autopipe_speedup.py (which also reports the loss's own share).
class LossBlock(nn.Module):
    """The last stage's loss as a block, so the profile times it too: SequentialHost runs the loss
    function after the last block, inside the last stage's forward, and backward starts from it."""

    def __init__(self, target: torch.Tensor):
        super().__init__()
        self.target = target

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits, self.target)


def gather_profile(
    blocks: Sequence[nn.Module], sample: Any, target: Any, rank: int, world: int, repeats: int, alone: bool, name: str, mbs: int
):
    """Profile every block, and the loss (folded into the last block's times); concurrently on all
    ranks (``alone=False``) or on rank 0 while the others wait. Every rank returns the same Profile
    (per block the median over the ranks that measured) and the loss's forward / backward seconds."""
    from lightning_pipe.profiler import Profile, profile_blocks

    dist.barrier()
    measured = None
    if not alone or rank == 0:
        measured = profile_blocks(list(blocks) + [LossBlock(target)], sample, torch.device("cpu"), model=name, repeats=repeats, warmup=2)
    parts: list = [None] * world
    dist.all_gather_object(parts, measured)
    parts = [p for p in parts if p is not None]
    n = len(blocks)
    field = lambda key: [statistics.median(p[i][key] for p in parts) for i in range(n + 1)]  # noqa: E731
    forward, backward = field("forward"), field("backward")
    loss = (forward.pop(), backward.pop())
    forward[-1] += loss[0]
    backward[-1] += loss[1]
    profile = Profile(
        name,
        mbs,
        "float32",
        "cpu",
        forward,
        backward,
        field("activation_bytes")[:n],
        field("param_bytes")[:n],
        field("peak_memory")[:n],
        [type(b).__name__ for b in blocks],
    )
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
            log(
                f"  segment disturbed: other processes used {foreign:.2f} CPUs"
                f"{'; repeating it' if attempt < args.retries else '; keeping the least disturbed attempt'}"
            )
    return best[1], best[0]


def run_partition(model: nn.Sequential, bounds, rank: int, world: int, x, y, args: Any, steps: int, warmup: int) -> dict:
    """Train `steps` timed steps (after `warmup`) with this rank's stage of `bounds`; returns per
    step (start, end) on the machine-wide monotonic clock and the executor's trace records (every
    timed step is traced: a few clock reads per compute)."""
    from lightning_pipe.runtime.p2p import Transport
    from lightning_pipe.runtime.sequential import SequentialHost, SequentialPipeline
    from lightning_pipe.schedules import build_schedule

    a, b = bounds[rank]
    chunk = nn.Sequential(*[model[i] for i in range(a, b)])
    host = SequentialHost({rank: chunk}, world - 1, lm_loss)
    pipe = SequentialPipeline(build_schedule("1f1b", world, args.microbatches), rank, host, Transport(lambda r: r, torch.device("cpu")))
    pipe.executor.trace = True

    def step() -> tuple[float, float]:
        chunk.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        pipe.step(x, y)
        return t0, time.perf_counter()

    for _ in range(warmup):
        step()
    times, traces = [], []
    # CPU accounting of the timed steps: this rank's CPU seconds (gloo's threads included) and the
    # machine's, to tell extra work from cores left idle
    cpu0, busy0, wall0 = _own_seconds(), _busy_seconds(), time.monotonic()
    for _ in range(steps):
        times.append(step())
        traces.append(list(pipe.executor.records))
    cpu1, busy1, wall1 = _own_seconds(), _busy_seconds(), time.monotonic()
    chunk.zero_grad(set_to_none=True)
    machine = (busy1 - busy0) if busy0 is not None else math.nan
    return {"times": times, "traces": traces, "cpu": (cpu1 - cpu0, machine, wall1 - wall0, steps)}


def simulator_job(rank: int, world: int, args: Any, log) -> dict:
    from lightning_pipe.profiler import Profile  # noqa: F401  (imported before timing)

    model = build_model(args)
    blocks = list(model)
    kinds = block_kinds(model)
    x, y = make_batch(args)
    sample, target = x[: args.mbs], y[: args.mbs]
    cores = min(args.cores, world)
    link, _ = _segment(lambda: ping_pong(rank), rank, world, args, log)
    # name -> (ranks profiling at once, chain mode); "main" is what the headline simulation uses
    kinds_of_profile = {"main": (cores, args.inflight), "hot": (cores, None), "lone": (1, args.inflight)}
    if world > cores:
        kinds_of_profile["all"] = (world, args.inflight)
    profiles, profile_loads = {}, {}
    for key, (profilers, inflight) in kinds_of_profile.items():
        profiles[key], profile_loads[key] = _segment(
            lambda: profile_at_once(blocks, sample, target, rank, world, args.profile_repeats, profilers, inflight, "gpt", args.mbs),
            rank,
            world,
            args,
            log,
        )
    box = [None]
    if rank == 0:
        costs = profiles["main"].costs(link["bandwidth"], link["latency"], cores=args.cores)
        box = [{"link": link, "partitions": choose_partitions(costs, kinds, world, args.microbatches, args.partitions)}]
    dist.broadcast_object_list(box, 0)
    link, partitions = box[0]["link"], box[0]["partitions"]
    if rank == 0:
        log(
            f"  link: latency {link['latency'] * 1e6:.0f} us, bandwidth {link['bandwidth'] / 1e9:.2f} GB/s; "
            f"partitions: {', '.join(f'{l} {sizes_of(b)}' for l, b in partitions)}"
        )
    runs: dict[int, list] = {i: [] for i in range(len(partitions))}
    traces: dict[int, list] = {i: [] for i in range(len(partitions))}
    loads: dict[int, list] = {i: [] for i in range(len(partitions))}
    cpu: dict[int, list] = {i: [] for i in range(len(partitions))}
    for rnd in range(args.rounds):
        order = list(range(len(partitions)))
        order = order[rnd % len(order) :] + order[: rnd % len(order)]  # a different partition first each round
        for i in order:
            label, bounds = partitions[i]
            out, load = _segment(
                lambda: run_partition(model, bounds, rank, world, x, y, args, args.steps, args.warmup), rank, world, args, log
            )
            runs[i].append(out["times"])
            traces[i].extend(zip(out["times"], out["traces"]))
            loads[i].append(load)
            cpu[i].append(out["cpu"])
            if rank == 0:
                log(f"  round {rnd + 1}/{args.rounds} {label:<24} done (foreign load {load:.2f} CPUs)")
    return {
        "rank": rank,
        "link": link,
        "profiles": profiles,
        "profile_loads": profile_loads,
        "partitions": partitions,
        "runs": runs,
        "loads": loads,
        "traces": traces,
        "cpu": cpu,
    }


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


# variant -> (profile, with the cores model?, legend): the headline first, then what each ingredient is worth
VARIANTS = {
    "simulated": ("main", True, "chain profile (min(cores, ranks) at once) + cores model"),
    "hot": ("hot", True, "per-block profile (hot caches) + cores model"),
    "no-cores": ("main", False, "chain profile, no cores model"),
    "all": ("all", False, "chain profile with all ranks at once, no cores model"),
    "lone": ("lone", True, "chain profile on rank 0 alone + cores model"),
}


def traced_busy(results: list[dict], index: int, schedule) -> list[float]:
    """Per rank, the median over the timed steps of its traced compute time (waits excluded)."""
    busy = []
    for r in results:
        per_step = [sum(e - s for i, s, e in recs if schedule.actions[r["rank"]][i].op.is_compute) for _, recs in r["traces"][index]]
        busy.append(statistics.median(per_step))
    return busy


def cpu_use(results: list[dict], index: int) -> tuple[float, float]:
    """(CPU seconds of all ranks per timed step, CPUs the whole machine kept busy meanwhile)."""
    rounds = results[0]["cpu"][index]
    steps = sum(n for *_, n in rounds)
    own = sum(c for r in results for c, *_ in r["cpu"][index]) / steps
    machine = sum(m for _, m, _, _ in rounds) / sum(w for _, _, w, _ in rounds)
    return own, machine


def measured_path(results: list[dict], index: int, schedule) -> tuple[float, float, float]:
    """The traced step's critical path, walked back from the compute that ends last through what
    each compute waited for (its input, if that was sent after the rank's previous compute ended,
    else the previous compute), split into (compute, waiting for a message, gaps between a rank's
    computes); medians over the timed steps."""
    from lightning_pipe.schedules import Op

    world = len(results)
    parts = []
    for s in range(len(results[0]["traces"][index])):
        sent, comps = {}, {}
        start = min(r["traces"][index][s][0][0] for r in results)
        for rank, r in enumerate(results):
            for i, t0, t1 in r["traces"][index][s][1]:
                a = schedule.actions[rank][i]
                if a.op.is_send:
                    sent[(a.op, a.chunk, a.microbatch)] = t0
                elif a.op.is_compute:
                    comps[(rank, a.op, a.chunk, a.microbatch)] = (t0, t1)
        before = {}
        for rank in range(world):
            mine = sorted((v, k) for k, v in comps.items() if k[0] == rank)
            before.update({k: (mine[j - 1][1] if j else None) for j, (_, k) in enumerate(mine)})
        key = max(comps, key=lambda k: comps[k][1])
        compute = message = gap = 0.0
        while True:
            t0, t1 = comps[key]
            compute += t1 - t0
            rank, op, c, mb = key
            need = None
            if op is Op.FORWARD and c > 0:
                need = (Op.SEND_ACT, c - 1, mb), (schedule.chunk_rank[c - 1], op, c - 1, mb)
            elif op is Op.BACKWARD and c < schedule.num_chunks - 1:
                need = (Op.SEND_GRAD, c + 1, mb), (schedule.chunk_rank[c + 1], op, c + 1, mb)
            prev = before[key]
            prev_end = comps[prev][1] if prev is not None else start
            if need is not None and need[1] in comps and sent.get(need[0], -math.inf) >= prev_end:
                message += t0 - comps[need[1]][1]
                key = need[1]
            else:
                gap += t0 - prev_end
                if prev is None:
                    break
                key = prev
        parts.append((compute, message, gap))
    return tuple(statistics.median(p[j] for p in parts) for j in range(3))


def analyse(results: list[dict], world: int, args: Any) -> dict:
    from lightning_pipe.schedules import build_schedule
    from lightning_pipe.simulator import simulate

    r0 = results[0]
    link, partitions, profiles = r0["link"], r0["partitions"], r0["profiles"]
    variants = {k: v for k, v in VARIANTS.items() if v[0] in profiles and (world > min(args.cores, world) or k not in ("no-cores", "all"))}
    costs = {
        k: profiles[p].costs(link["bandwidth"], link["latency"], cores=args.cores if shared else None)
        for k, (p, shared, _) in variants.items()
    }
    schedule = build_schedule("1f1b", world, args.microbatches)
    rows = []
    for i, (label, bounds) in enumerate(partitions):
        times = iteration_times(results, i)
        measured = statistics.median(times)
        sims = {k: simulate(schedule, c, bounds, critical_path=(k == "simulated")) for k, c in costs.items()}
        q1, _, q3 = statistics.quantiles(times, n=4) if len(times) >= 4 else (measured, measured, measured)
        main = sims["simulated"]
        busy = traced_busy(results, i, schedule)
        heavy = max(range(world), key=lambda r: busy[r])
        cpu, machine = cpu_use(results, i)
        path = measured_path(results, i, schedule)
        sim_path = sum(e.end - e.start for e in main.critical_path)
        rows.append(
            {
                "label": label,
                "bounds": bounds,
                "sizes": sizes_of(bounds),
                "measured": measured,
                "iqr": (q1, q3),
                "sim": {k: t.iteration_time for k, t in sims.items()},
                "error": {k: t.iteration_time / measured - 1 for k, t in sims.items()},
                "master": main.master_stage,
                "bubble": main.bubble_ratio,
                "heavy": heavy,
                "traced_busy": busy[heavy],
                "sim_busy": main.busy[heavy],
                "cpu": cpu,
                "machine": machine,
                "path": path,
                "sim_path": (sim_path, main.iteration_time - sim_path),
                "load": max(r0["loads"][i]),
                "steps": len(times),
            }
        )
    measured = [r["measured"] for r in rows]
    rho = {k: spearman(measured, [r["sim"][k] for r in rows]) for k in variants}
    return {
        "world": world,
        "rows": rows,
        "rho": rho,
        "variants": variants,
        "link": link,
        "costs": costs["simulated"],
        "schedule": schedule,
        "profiles": profiles,
        "profile_loads": r0["profile_loads"],
        "results": results,
    }


def report(a: dict, args: Any) -> str:
    world, rows, profiles = a["world"], a["rows"], a["profiles"]
    cores = min(args.cores, world)
    total = lambda key: 1e3 * sum(profiles[key].forward + profiles[key].backward)  # noqa: E731
    lines = [
        f"{world} processes x 1 thread on {args.cores} cores, {world} stages, 1F1B, m = {args.microbatches}; link: latency "
        f"{a['link']['latency'] * 1e6:.0f} us, bandwidth {a['link']['bandwidth'] / 1e9:.2f} GB/s (ping-pong rank 0 <-> 1)",
        "profiles (f+b of all blocks per micro-batch, the loss included; foreign load): "
        + ", ".join(f"{k} {total(k):.1f} ms ({a['profile_loads'][k]:.2f})" for k in profiles),
        f"  main = chain (inflight {args.inflight}) on {cores} ranks at once; hot = per-block on {cores} ranks at once; "
        f"lone = chain on rank 0 alone" + (f"; all = chain on all {world} ranks at once" if "all" in profiles else ""),
        f"simulated with cores = {args.cores}"
        + (" (more ranks than cores: processor sharing)" if world > args.cores else " (a core per rank: no sharing)"),
        "",
        "| partition | blocks per stage | measured ms | simulated ms | error | master stage | busiest rank: traced / simulated compute ms | foreign load |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['sizes']} | {r['measured'] * 1e3:.1f} | {r['sim']['simulated'] * 1e3:.1f} | "
            f"{r['error']['simulated']:+.1%} | {r['master']} | {r['heavy']}: {r['traced_busy'] * 1e3:.1f} / {r['sim_busy'] * 1e3:.1f} | "
            f"{r['load']:.2f} |"
        )
    work = args.microbatches * sum(profiles["main"].forward + profiles["main"].backward)
    lines += [
        "",
        f"Where the time goes (per step, ms; profiled CPU work m x sum(f+b) = {work * 1e3:.1f} ms): CPU time of all ranks and "
        "how many CPUs the machine kept busy over the timed steps; the critical path of the traced steps (computes, waits for a "
        "message, gaps between a rank's computes) next to the simulated one (computes, waits)",
        "",
        "| partition | ranks' CPU per step | machine busy (CPUs) | measured path: compute + message + gaps | simulated path: compute + waits |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        c, msg, gap = (v * 1e3 for v in r["path"])
        sc, sw = (v * 1e3 for v in r["sim_path"])
        lines.append(
            f"| {r['label']} | {r['cpu'] * 1e3:.1f} | {r['machine']:.2f} | {c:.1f} + {msg:.1f} + {gap:.1f} | {sc:.1f} + {sw:.1f} |"
        )
    names = list(a["variants"])
    lines += [
        "",
        "Every variant (error per partition, Spearman, largest |error|):",
        "",
        "| partition | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for r in rows:
        lines.append(f"| {r['label']} | " + " | ".join(f"{r['error'][k]:+.1%}" for k in names) + " |")
    lines.append("| Spearman | " + " | ".join(f"{a['rho'][k]:.3f}" for k in names) + " |")
    lines.append("| max abs error | " + " | ".join(f"{max(abs(r['error'][k]) for r in rows):.1%}" for k in names) + " |")
    lines += ["", "variants: " + "; ".join(f"{k} = {a['variants'][k][2]}" for k in names)]
    floor = args.microbatches * sum(profiles["main"].forward + profiles["main"].backward) / cores
    worst = max(abs(r["error"]["simulated"]) for r in rows)
    within = sum(abs(r["error"]["simulated"]) <= 0.10 for r in rows)
    lines += [
        f"CPU floor: m x (f+b of all blocks, main profile) / min(cores, ranks) = {floor * 1e3:.1f} ms per step",
        "",
        f"Spearman rank correlation (measured vs simulated): {a['rho']['simulated']:.3f}; largest |error| {worst:.1%}; "
        f"{within} of {len(rows)} within 10%",
        f"targets: every partition within 10% -> {'met' if worst <= 0.10 else 'missed'}; rank correlation 1.0 -> "
        f"{'met' if a['rho']['simulated'] > 0.9999 else 'missed'}",
    ]
    return "\n".join(lines)


# ---- pictures ----------------------------------------------------------------------------------
def plot_comparison(analyses: list[dict], path: Path, args: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {
        "simulated": ("s--", "#DD8452"),
        "hot": ("v:", "#55A868"),
        "no-cores": ("D:", "#C44E52"),
        "all": ("x:", "#8172B3"),
        "lone": ("^:", "#8C8C8C"),
    }
    fig, axes = plt.subplots(1, len(analyses), figsize=(6.8 * len(analyses), 4.6), squeeze=False)
    for ax, a in zip(axes[0], analyses):
        rows = a["rows"]
        xs = range(len(rows))
        ax.plot(xs, [r["measured"] * 1e3 for r in rows], "o-", label="measured (median step)", color="#4C72B0", lw=2)
        ax.fill_between(
            xs,
            [r["iqr"][0] * 1e3 for r in rows],
            [r["iqr"][1] * 1e3 for r in rows],
            color="#4C72B0",
            alpha=0.2,
            label="measured, quartiles",
        )
        for k in a["variants"]:
            marker, color = styles[k]
            ax.plot(
                xs,
                [r["sim"][k] * 1e3 for r in rows],
                marker,
                color=color,
                lw=2 if k == "simulated" else 1,
                alpha=1.0 if k == "simulated" else 0.7,
                label=f"{k}: {a['variants'][k][2]}",
            )
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{r['label'].replace(' = ', '=')}\n{r['sizes']}" for r in rows], fontsize=7, rotation=30, ha="right")
        ax.set_ylabel("iteration time (ms)")
        ax.set_ylim(bottom=0)
        ax.set_title(
            f"{a['world']} processes on {args.cores} cores: Spearman {a['rho']['simulated']:.2f}, max |error| "
            f"{max(abs(r['error']['simulated']) for r in rows):.1%}",
            fontsize=9,
        )
        ax.legend(fontsize=6, loc="lower right")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_timelines(a: dict, folder: Path, label: str = "autopipe") -> list[Path]:
    from lightning_pipe.simulator import simulate
    from lightning_pipe.viz import gantt, traced_timeline

    index = next((i for i, r in enumerate(a["rows"]) if label in r["label"].split(" = ")), None)
    if index is None:
        return []
    row = a["rows"][index]
    # the traced step whose iteration is the median one, records of all ranks (one monotonic clock)
    steps = len(a["results"][0]["traces"][index])
    per_step = []
    for s in range(steps):
        spans = [r["traces"][index][s][0] for r in a["results"]]
        records = [r["traces"][index][s][1] for r in a["results"]]
        per_step.append((max(e for _, e in spans) - min(t for t, _ in spans), s, records))
    per_step.sort(key=lambda t: t[:2])
    measured = traced_timeline(a["schedule"], per_step[len(per_step) // 2][2])
    predicted = simulate(a["schedule"], a["costs"], row["bounds"])
    m = a["schedule"].num_microbatches
    out_m = gantt(
        measured,
        folder / "measured_timeline.png",
        title=f"measured (traced; gaps = waiting): {label} {row['sizes']}, {a['world']} processes, m={m}: "
        f"{measured.iteration_time * 1e3:.1f} ms",
    )
    out_p = gantt(
        predicted,
        folder / "predicted_timeline.png",
        title=f"simulated: {label} {row['sizes']}, {a['world']} stages on {a['costs'].cores} cores, 1F1B m={m}: "
        f"iteration {predicted.iteration_time * 1e3:.1f} ms, master stage {predicted.master_stage}",
    )
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
    p.add_argument("--pictures", default=str(ROOT / "docs" / "img"), help="folder for the pictures ('' for none)")
    p.add_argument("--inflight", type=int, default=4, help="micro-batches in flight in the chain-mode profile")
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="cores the processes share (the simulator's cores model)")
    p.add_argument("--raw", default="", help="save the measurements (torch.save) to this file")
    p.add_argument("--from-raw", default="", help="analyse measurements saved with --raw instead of measuring")
    add_common_arguments(p)
    p.set_defaults(profile_repeats=16)  # timed samples per block; chain mode: 16 / inflight rounds
    args = p.parse_args()
    started = time.time()
    print(provenance() if not args.from_raw else f"re-analysis of {args.from_raw}")
    print(
        f"gloo, 1 thread per process; GPT {args.layers} layers "
        f"({2 * args.layers + 2} blocks), hidden {args.hidden}, heads {args.heads}, seq {args.seq}, vocab {args.vocab}, "
        f"micro-batch {args.mbs}, m = {args.microbatches}",
        flush=True,
    )
    analyses = []
    saved = torch.load(args.from_raw, weights_only=False) if args.from_raw else {}
    raw = {}
    for world in args.worlds:
        print(f"\n== {world} processes ==", flush=True)
        if args.from_raw:
            results = saved[world]
        else:
            wait_for_quiet(args.quiet_wait, args.max_foreign)
            results = launch(simulator_job, world, args, args.timeout)
        raw[world] = results
        if args.raw:
            torch.save(raw, args.raw)
        a = analyse(results, world, args)
        analyses.append(a)
        print(report(a, args), flush=True)
    if args.pictures:
        folder = Path(args.pictures)
        plot_comparison(analyses, folder / "simulated_vs_measured.png", args)
        written = [folder / "simulated_vs_measured.png"] + plot_timelines(analyses[0], folder)
        print("\npictures: " + ", ".join(str(w) for w in written))
    print(f"\ntotal {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
