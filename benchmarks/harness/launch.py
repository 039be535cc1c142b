"""Run a function on N local processes with a process group, and time it on a shared machine.

The one launcher of the tests and the benchmarks, and the timing helpers the benchmarks share.
Nothing here imports Lightning: torch and torch.distributed only.

Launching: ``run_distributed(fn, world, *args)`` spawns `world` processes, joins them into a
process group (gloo by default; the rendezvous store is served by the calling process on a port the
OS picks, so concurrent jobs cannot race for a port), runs ``fn(rank, world, *args)`` in each and
returns the results in rank order. A worker's exception is raised in the caller as a `WorkerError`
carrying the worker's traceback (the other workers are stopped at once rather than left waiting
for the dead one); the whole job has ONE deadline, after which every worker still running is
killed and `TimeoutError` names the ranks that did not finish. It never hangs.

Timing (all for CPU runs on a machine other jobs may share):

- `timed_steps`: warm-up steps, a barrier, timed steps, a barrier;
- `CpuClock` / `foreign_load`: how many CPUs' worth of work processes other than ours did over an
  interval (Linux /proc/stat minus our own CPU time), i.e. how disturbed a measurement was;
- `wait_for_quiet`: wait (bounded) until other benchmarks / test runs are gone and the machine is idle;
- `run_undisturbed` (a whole job, from the caller) and `quiet_segment` (a part of a job, from inside
  it): wait for a quiet machine, measure, repeat what other processes disturbed;
- `cpu_model` / `machine_description`: the machine in one line, for benchmark headers.
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import os
import platform
import resource
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = [
    "OTHER_JOBS",
    "CpuClock",
    "WorkerError",
    "busy_seconds",
    "cpu_model",
    "foreign_load",
    "free_port",
    "machine_description",
    "other_jobs",
    "own_seconds",
    "quiet_segment",
    "rank_zero_log",
    "run_distributed",
    "run_undisturbed",
    "timed_steps",
    "wait_for_quiet",
]

HOST = "127.0.0.1"


# ---- launching ---------------------------------------------------------------------------------
class WorkerError(RuntimeError):
    """A worker raised: ``rank`` and the worker's formatted ``traceback`` (also in the message).
    ``others``: the ranks that failed after it (usually because it did), with their error's last line."""

    def __init__(self, rank: int, world: int, error: str, others: Sequence[tuple[int, str]] = ()):
        also = "".join(f"\n(then rank {r} failed too: {last})" for r, last in others)
        super().__init__(f"rank {rank} of {world} failed:\n{error}{also}")
        self.rank = rank
        self.traceback = error
        self.others = list(others)


def free_port() -> int:
    """A TCP port that was free a moment ago (others may take it before you bind it)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _save(path: str, record: dict) -> None:
    tmp = path + ".tmp"
    torch.save(record, tmp)
    os.replace(tmp, path)  # the parent never reads half a record


def _worker(
    rank: int,
    world: int,
    port: int,
    fn: Callable,
    args: tuple,
    out_dir: str,
    backend: str | None,
    threads: int | None,
    pin: bool,
    group_timeout: float | None,
) -> None:
    path = os.path.join(out_dir, f"{rank}.pt")
    try:
        if pin and hasattr(os, "sched_setaffinity"):  # rank r (and the threads it starts) on CPU r
            os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
        if threads:
            torch.set_num_threads(threads)
        os.environ.update(MASTER_ADDR=HOST, MASTER_PORT=str(port))
        if backend:
            timeout = timedelta(seconds=group_timeout) if group_timeout else None
            store = dist.TCPStore(HOST, port, world, is_master=False, timeout=timeout or timedelta(minutes=30))
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, **({"timeout": timeout} if timeout else {}))
        result = fn(rank, world, *args)
        _save(path, {"ok": True, "result": result})
    except BaseException:  # the caller raises it with this traceback
        failed_at = time.time()  # the first failure is the cause, the others' (a peer gone) follow it
        with contextlib.suppress(Exception):  # if even that fails, the caller reports a rank that died without a result
            _save(path, {"ok": False, "error": traceback.format_exc(), "time": failed_at})
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _read(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    try:
        return torch.load(path, weights_only=False)
    except Exception as err:  # noqa: BLE001  (a record that cannot be read is a failure, said so)
        return {
            "ok": False,
            "error": f"its result could not be read back ({type(err).__name__}: {err}); is it picklable and are its classes importable?",
            "time": 0.0,
        }


def _raise_first_failure(records: dict[int, dict], procs: list, paths: list[str], world: int, killed: set[int]) -> None:
    """Raise for the failure that came first, if any: a rank that died without a result (a crash
    brings its peers down, not the other way round), else the rank whose exception is the oldest.
    ``killed``: the ranks the launcher stopped (no result of their own is expected of them)."""
    for r, p in enumerate(procs):
        if r not in records:
            record = _read(paths[r])
            if record is None and r not in killed and p.exitcode is not None:
                record = {
                    "ok": False,
                    "died": True,
                    "time": -1.0,
                    "error": f"rank {r} of {world} died without a result (exit code {p.exitcode})",
                }
            if record is not None:
                records[r] = record
    failures = sorted((rec.get("time", 0.0), r) for r, rec in records.items() if not rec["ok"])
    if not failures:
        return
    first = failures[0][1]
    record = records[first]
    if record.get("died"):
        raise RuntimeError(record["error"])
    others = [(r, records[r]["error"].strip().splitlines()[-1]) for _, r in failures[1:]]
    raise WorkerError(first, world, record["error"], others)


def run_distributed(
    fn: Callable,
    world: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str | None = "gloo",
    threads: int | None = 1,
    pin: bool = False,
    group_timeout: float | None = None,
) -> list[Any]:
    """Return ``[fn(rank, world, *args) for rank in range(world)]``, each run in its own spawned process.

    ``fn`` and ``args`` are pickled to the workers (``fn`` must be importable: a module-level
    function), the results are pickled back. ``backend``: the process group every worker joins
    before ``fn`` runs (None: none). ``threads``: ``torch.set_num_threads`` in each worker (None:
    leave it). ``pin``: put rank r on CPU r (mod the CPU count). ``group_timeout``: seconds the
    process group's collectives may block (torch's default if None).

    Raises `WorkerError` with the worker's traceback when one raises (the first to raise: its peers
    then fail on the closed connection; the others are killed rather than waited for),
    `RuntimeError` when one dies without a result (a crash, a kill), and `TimeoutError` naming the
    ranks that had not finished when ``timeout`` seconds, one deadline for the whole job, ran out.
    """
    if world < 1:
        raise ValueError(f"world={world}: at least 1 process")
    ctx = mp.get_context("spawn")
    deadline = time.monotonic() + timeout
    store = dist.TCPStore(HOST, 0, None, is_master=True, wait_for_workers=False) if backend else None
    port = store.port if store is not None else free_port()
    with tempfile.TemporaryDirectory(prefix="lightning_pipe_launch_") as out_dir:
        paths = [os.path.join(out_dir, f"{r}.pt") for r in range(world)]
        procs = [
            ctx.Process(target=_worker, name=f"rank {r}", args=(r, world, port, fn, args, out_dir, backend, threads, pin, group_timeout))
            for r in range(world)
        ]
        records: dict[int, dict] = {}
        killed: set[int] = set()
        try:
            for p in procs:
                p.start()
            running = {p.sentinel: r for r, p in enumerate(procs)}
            failed = False
            while running and not failed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                for sentinel in multiprocessing.connection.wait(list(running), timeout=left):
                    r = running.pop(sentinel)
                    procs[r].join()
                    record = _read(paths[r])
                    failed = failed or record is None or not record["ok"]  # then the others are stopped, not waited for
                    if record is not None:
                        records[r] = record
        finally:
            for r, p in enumerate(procs):  # a failure, the deadline, or the caller interrupted: stop them all
                if p.is_alive():
                    p.kill()
                    killed.add(r)
            for p in procs:
                if p.pid is not None:
                    p.join()
        # Killed ranks have no record; ranks still running at the deadline may have saved one (then
        # got stuck in teardown).
        _raise_first_failure(records, procs, paths, world, killed)
        hung = [r for r in range(world) if r not in records]
        if hung:
            done = [r for r in range(world) if r not in hung]
            raise TimeoutError(
                f"rank{'s' if len(hung) > 1 else ''} {', '.join(map(str, hung))} of {world} did not finish "
                f"within {timeout:g} s (hang?); {'finished: ranks ' + str(done) if done else 'none finished'}"
            )
        return [records[r]["result"] for r in range(world)]


def rank_zero_log(rank: int) -> Callable[[str], None]:
    """A `print` (flushed) on rank 0, a no-op elsewhere: a job's progress lines, once."""
    if rank == 0:
        return lambda msg: print(msg, flush=True)
    return lambda msg: None


# ---- timing ------------------------------------------------------------------------------------
def timed_steps(step: Callable[[int], Any], steps: int, warmup: int = 0, barrier: Callable[[], Any] | None = None) -> list[float]:
    """Run ``step(i)`` for ``warmup`` untimed then ``steps`` timed steps (i counts on through both),
    with ``barrier`` (default: the process group's, if there is one) before and after the timed
    ones. Returns ``[wall time of the timed steps, then each timed step's time]`` in seconds."""
    if barrier is None:
        barrier = dist.barrier if dist.is_initialized() else (lambda: None)
    for i in range(warmup):
        step(i)
    barrier()
    times = []
    start = time.perf_counter()
    for i in range(warmup, warmup + steps):
        t = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - t)
    barrier()
    return [time.perf_counter() - start] + times


# ---- the machine: CPU accounting, other jobs ----------------------------------------------------
def busy_seconds() -> float | None:
    """CPU seconds the whole machine has spent busy (Linux /proc/stat: user .. steal), or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_seconds(children: bool = False) -> float:
    """CPU seconds of this process (all its threads, gloo's included) and, with ``children``, of
    its children that have been waited for (a finished job's workers)."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN) if children else (resource.RUSAGE_SELF,):
        r = resource.getrusage(who)
        total += r.ru_utime + r.ru_stime
    return total


@dataclass(frozen=True)
class CpuClock:
    """One reading of the machine's busy CPU seconds, ours and the wall clock (`foreign_load`)."""

    busy: float | None
    own: float
    wall: float

    @classmethod
    def now(cls, children: bool = False) -> CpuClock:
        return cls(busy_seconds(), own_seconds(children), time.monotonic())


def foreign_load(start: CpuClock, end: CpuClock, own: float | None = None) -> float:
    """CPUs' worth of work processes other than ours did between two readings: the machine's busy
    time less ``own`` (default: the readings' own CPU time; a job passes the sum over its ranks),
    over the wall time. 0.0 where /proc/stat is not available."""
    if start.busy is None or end.busy is None:
        return 0.0
    mine = end.own - start.own if own is None else own
    return max(0.0, (end.busy - start.busy) - mine) / max(end.wall - start.wall, 1e-9)


OTHER_JOBS = ("bench_[r]untime", "[p]ytest")


def proc_stat(pid: int) -> tuple[int, int, float] | None:
    """(parent pid, start time in clock ticks, CPU seconds: user + system) of process ``pid`` from
    /proc/<pid>/stat, or None where it cannot be read (it ended; not Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[1]), int(fields[19]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _ancestors() -> set[str]:
    """This process and its ancestors (a benchmark's own launcher, flock, timeout, shell ...)."""
    pids, pid = {str(os.getpid()), str(os.getppid())}, os.getppid()
    while pid > 1 and (stat := proc_stat(pid)) is not None:
        pid = stat[0]
        pids.add(str(pid))
    return pids


def other_jobs(patterns: Sequence[str] = OTHER_JOBS) -> list[str]:
    """Command lines of other processes matching ``patterns`` (``pgrep -af``; bracket a letter, as
    in ``[p]ytest``, so pgrep does not match itself), this process and its ancestors excluded."""
    found = []
    mine = _ancestors()
    for pattern in patterns:
        try:
            out = subprocess.run(["pgrep", "-af", pattern], capture_output=True, text=True, timeout=10, check=False).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        found += [line for line in out.splitlines() if line.strip() and line.split()[0] not in mine and line not in found]
    return found


def wait_for_quiet(
    max_wait: float, max_load: float, poll: float = 1.0, patterns: Sequence[str] = (), log: Callable[[str], None] | None = None
) -> float:
    """Wait until no process matching ``patterns`` runs (see `other_jobs`) and other processes use
    less than ``max_load`` CPUs (measured over 1 s), at most ``max_wait`` s, checking every
    ``poll`` s. Returns the foreign load seen last (CPUs); ``log`` hears why it waits."""
    deadline = time.monotonic() + max_wait
    while True:
        jobs = other_jobs(patterns) if patterns else []
        load = 0.0
        if not jobs:
            start = CpuClock.now(children=True)
            time.sleep(1.0)
            load = foreign_load(start, CpuClock.now(children=True))
            if load < max_load:
                return load
        if time.monotonic() + poll > deadline:
            if log is not None:
                log(f"  machine still busy after {max_wait:.0f} s ({len(jobs)} other jobs, load {load:.2f} CPUs): measuring anyway")
            return load
        if log is not None:
            what = f"{len(jobs)} other benchmark/test processes" if jobs else f"other processes using {load:.2f} CPUs"
            log(f"  waiting for a quiet machine: {what}")
        time.sleep(poll)


def run_undisturbed(
    fn: Callable,
    world: int,
    *args: Any,
    retries: int = 2,
    max_foreign: float = 0.1,
    quiet_wait: float = 10.0,
    patient: bool = True,
    label: str = "run",
    log: Callable[[str], None] = lambda msg: print(msg, flush=True),
    **launch: Any,
) -> tuple[list[Any], float]:
    """`run_distributed` after waiting (at most ``quiet_wait`` s) for a quiet machine; a run during
    which other processes used more than ``max_foreign`` CPUs is repeated, at most ``retries``
    times. ``patient=False`` (e.g. a time budget is spent): neither wait nor repeat. Returns the
    last run's results and its foreign load (CPUs, over the whole run, the workers' start included).
    ``launch``: `run_distributed`'s keyword arguments (timeout, backend, threads, pin, ...)."""
    for attempt in range(retries + 1):
        if patient:
            wait_for_quiet(quiet_wait, max_foreign)
        start = CpuClock.now(children=True)  # the workers' CPU time counts once they are joined
        results = run_distributed(fn, world, *args, **launch)
        foreign = foreign_load(start, CpuClock.now(children=True))
        if foreign <= max_foreign or not patient:
            break
        log(f"  {label} disturbed: other processes used {foreign:.2f} CPUs{'; retrying' if attempt < retries else '; keeping it'}")
    return results, foreign


def quiet_segment(
    run: Callable[[], Any],
    rank: int,
    world: int,
    retries: int = 2,
    max_foreign: float = 0.15,
    quiet_wait: float = 600.0,
    log: Callable[[str], None] = lambda msg: None,
    poll: float = 20.0,
    patterns: Sequence[str] = OTHER_JOBS,
) -> tuple[Any, float]:
    """Inside a job: run ``run()`` on all ranks after rank 0 waited for a quiet machine (no other
    benchmark / test, idle CPUs; `wait_for_quiet`); repeat it (at most ``retries`` times) if other
    processes used more than ``max_foreign`` CPUs meanwhile. Returns the least disturbed attempt's
    result and its foreign load (CPUs). Collective: every rank calls it."""
    best: tuple[float, Any] | None = None
    for attempt in range(retries + 1):
        if rank == 0:
            wait_for_quiet(quiet_wait, max_foreign, poll=poll, patterns=patterns, log=log)
        dist.barrier()
        start = CpuClock.now()
        out = run()
        end = CpuClock.now()
        own: list = [None] * world
        dist.all_gather_object(own, end.own - start.own)
        foreign = foreign_load(start, end, own=sum(own))
        if best is None or foreign < best[0]:
            best = (foreign, out)
        if foreign <= max_foreign:
            break
        log(
            f"  segment disturbed: other processes used {foreign:.2f} CPUs"
            f"{'; repeating it' if attempt < retries else '; keeping the least disturbed attempt'}"
        )
    return best[1], best[0]


# ---- the machine in one line -------------------------------------------------------------------
def cpu_model() -> str:
    """The CPU's model name (lscpu, else /proc/cpuinfo, else the platform's processor string)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine_description() -> str:
    """E.g. ``AMD EPYC 7B13, 2 CPUs; Python 3.11.7, torch 2.5.1``."""
    return f"{cpu_model()}, {os.cpu_count()} CPUs; Python {sys.version.split()[0]}, torch {torch.__version__}"
