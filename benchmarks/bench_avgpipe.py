"""AvgPipe (N parallel pipelines, elastic averaging) vs plain GPipe / 1F1B at the same samples per step.

bench_2bw's residual MLP (lightning_pipe.bench.mlp), K = 2 stages, gloo, one thread per process,
S = 256 rows per optimizer step in every configuration; all pipelines share this machine's cores.
Measured: samples/s, where the time goes per worker (compute, executor not computing, the elastic
update's parts, CPU), the staleness bound, "malloc kept" runs; simulated: N pipelines with devices
of their own. Feeds docs/benchmarks_avgpipe.md (method and results there).

    python benchmarks/bench_avgpipe.py --retries 1 --budget 480
    python benchmarks/bench_avgpipe.py --quick     # smoke: N = 2, M = 2, s = 1, malloc kept, 2 steps
"""

from __future__ import annotations

import os
import statistics
import time

from lightning_pipe.bench.harness import Bench, Table, ints, ms, pin_threads

pin_threads(1)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lightning_pipe.bench import pipes  # noqa: E402
from lightning_pipe.bench.launch import timed_steps  # noqa: E402
from lightning_pipe.bench.mlp import loss_fn, make_model, stage_half  # noqa: E402
from lightning_pipe.bench.pipes import Clock, compute_seconds, costs_at, equal_bounds, time_executor  # noqa: E402

K = 2  # stages per pipeline
S = 256  # samples (rows) per optimizer step, every configuration
STALE_MICROBATCHES = [4]  # M of the staleness runs
# glibc malloc kept from returning freed memory to the OS: the "malloc kept" variant (fresh pages for the
# elastic update's stage-sized temporaries are what its time is mostly spent on otherwise)
MALLOC = {"MALLOC_TRIM_THRESHOLD_": str(1 << 30), "MALLOC_MMAP_THRESHOLD_": str(1 << 30)}


def _proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) of process `pid` so far, from /proc (0.0 where unreadable)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def make_batches(cfg: dict, pipeline: int, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pipeline `pipeline`'s own fixed batches (different for every pipeline), cycled through the steps."""
    g = torch.Generator().manual_seed(1234 + 7919 * pipeline)
    return [(torch.randn(rows, cfg["hidden"], generator=g), torch.randn(rows, cfg["hidden"], generator=g)) for _ in range(4)]


# ---- workers ------------------------------------------------------------------------------------
def _train(rank: int, world: int, cfg: dict) -> dict:
    from lightning_pipe.layers import ElasticAveraging, Flush
    from lightning_pipe.runtime.elastic import ReferenceLink, flat_into, flat_size
    from lightning_pipe.runtime.p2p import Transport
    from lightning_pipe.runtime.sequential import SequentialHost
    from lightning_pipe.schedules import ScheduleSpec

    n = cfg["pipelines"]  # 0: a plain pipeline
    pipeline, stage = rank // K, rank % K
    m = cfg["microbatches"]
    chunk = stage_half(make_model(cfg), stage)
    data = make_batches(cfg, pipeline, cfg["batch"] // max(n, 1))
    host = SequentialHost({stage: chunk}, K - 1, loss_fn)
    transport = Transport(lambda s: pipeline * K + s, torch.device("cpu"))
    opt = torch.optim.SGD(chunk.parameters(), lr=cfg["lr"])
    clock = Clock(send=0.0, wait=0.0)
    time_executor(clock)  # time inside the executor, as bench_2bw
    refs: list = []

    def link(numel: int, dtype: torch.dtype) -> ReferenceLink:
        store = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])  # the job's TCPStore (run_distributed's)
        made = ReferenceLink(*store, f"{cfg['prefix']}/{stage}/", stage, pipeline, n, numel, dtype, cfg["timeout"])
        made.send_delta = clock.wrap(made.send_delta, "send")  # building the message + the isend (+ reaping old ones)
        made.take_reference = clock.wrap(made.take_reference, "wait")  # waiting for W_ref
        refs.append(made)
        return made

    mode = Flush(ScheduleSpec.of(cfg["schedule"]), K, m, stage, transport, trace=True)
    elastic = None
    if n:
        elastic = ElasticAveraging(chunk, pipeline, 1.0 / n, cfg["staleness"], link, rank=stage)
    trace: list[dict] = []
    cpu_at: dict[str, float] = {}

    def step(i: int) -> None:
        if i == cfg["warmup"]:  # the first timed step: the reference process's CPU clock starts here
            cpu_at["ref0"] = _proc_cpu(refs[0].proc.pid) if refs and refs[0].proc is not None else 0.0
        x, y = data[i % len(data)]
        clock.zero()
        c0 = time.process_time()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        executor = pipes.run_layer(mode, host, x, y, m)
        t1 = time.perf_counter()
        if elastic:
            elastic.before_update()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        if elastic:
            elastic.after_update()
        t4 = time.perf_counter()
        busy = compute_seconds(executor)
        trace.append(
            dict(step=t4 - t0, busy=busy, waiting=clock["executor"] - busy, outside=t1 - t0 - clock["executor"], before=t2 - t1)
            | dict(opt=t3 - t2, send=clock["send"], wait_ref=clock["wait"], pull=t4 - t3 - clock["send"] - clock["wait"])
            | dict(update=t4 - t3 + t2 - t1, cpu=time.process_time() - c0, loss=float(sum(host.losses)))
        )

    timing = timed_steps(step, cfg["steps"], cfg["warmup"], dist.barrier)
    ref_cpu = _proc_cpu(refs[0].proc.pid) - cpu_at.get("ref0", 0.0) if refs and refs[0].proc is not None else 0.0
    out = {"timing": timing, "trace": trace[cfg["warmup"] :], "ref_cpu": ref_cpu, "pipeline": pipeline, "stage": stage}
    if elastic:
        elastic.drain()
        out["own"] = flat_into(elastic.params, torch.empty(flat_size(elastic.params)))
        out["reference"] = elastic.refs[elastic.iteration].clone()
        elastic.close()
    return out


class StubLink:
    """A ReferenceLink without the reference: the mode's own work on a Δ and a W_ref, no messages
    (the Δ message is filled as the real link fills its reused buffer; a received W_ref is a reused
    buffer filled by a copy, as gloo fills the posted buffer)."""

    def __init__(self, numel: int, dtype: torch.dtype, reference: torch.Tensor):
        from collections import deque

        self.numel, self.dtype, self.reference = numel, dtype, reference
        self.pending: deque = deque()
        self.max_sends = 2
        self.message = torch.empty(numel + 1, dtype=dtype)
        self.free: list = []

    def send_init(self, reference: torch.Tensor) -> None:
        pass

    def send_delta(self, delta: torch.Tensor) -> None:
        self.message[0] = 0.0
        self.message[1:].copy_(delta.detach())

    def post_reference(self) -> None:
        self.pending.append(self.free.pop() if self.free else torch.empty(self.numel, dtype=self.dtype))

    def release(self, buffer: torch.Tensor) -> None:
        self.free.append(buffer)

    def take_reference(self) -> torch.Tensor:
        return self.pending.popleft().copy_(self.reference)


def local_update(cfg: dict, stage: int, repeats: int = 30) -> dict:
    """ElasticAveraging's before_update + after_update on one stage's weights, in this (single-threaded)
    process, with StubLink: the elastic update's local work (copies, Δ, pull) without messages or
    waiting; median ms and minor page faults per update (fresh stage-sized buffers)."""
    import resource

    from lightning_pipe.layers import ElasticAveraging
    from lightning_pipe.runtime.elastic import flat_into, flat_size

    torch.set_num_threads(1)
    chunk = stage_half(make_model(cfg), stage)
    params = list(chunk.parameters())
    numel = sum(p.numel() for p in params)
    ref = flat_into(params, torch.empty(flat_size(params)))
    mode = ElasticAveraging(chunk, 0, 0.5, 0, lambda n, d: StubLink(n, d, ref), rank=stage)
    opt = torch.optim.SGD(params, lr=1e-6)
    for p in params:
        p.grad = torch.randn_like(p)
    times, faults = [], []
    for _ in range(repeats + 3):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        mode.before_update()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        mode.after_update()
        t3 = time.perf_counter()
        times.append(t3 - t2 + t1 - t0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    return {"ms": 1e3 * statistics.median(times[3:]), "faults": statistics.median(faults[3:]), "mb": numel * 4 / 1e6}


def job(rank: int, world: int, kind: str, cfg: dict) -> dict:
    if kind != "profile":
        return _train(rank, world, cfg)
    # the link (ping_pong) at the activation sizes and every block at each micro-batch size, both ranks at once
    sizes = (4, *sorted({r * cfg["hidden"] * 4 for r in cfg["profile_rows"]} | {1 << 20, 1 << 22}))
    x, y = make_batches(cfg, 0, max(cfg["profile_rows"]))[0]
    return pipes.profile_job(rank, world, list(make_model(cfg)), x, y, cfg["profile_rows"], sizes, loss_fn, cfg["profile_repeats"])


# ---- the parent ---------------------------------------------------------------------------------
def sim_iteration(name: str, m: int, costs) -> float:
    from lightning_pipe.schedules import build_schedule
    from lightning_pipe.simulation import simulate

    return simulate(build_schedule(name, K, m), costs, equal_bounds(costs.num_blocks, K), critical_path=False).iteration_time


def per_stage(results: list[dict], key: str) -> list[float]:
    """The median over the timed steps of `key`, per worker; then the mean over each stage's pipelines."""
    out = []
    for k in range(K):
        vals = [statistics.median(s[key] for s in r["trace"]) for r in results if r["stage"] == k]
        out.append(statistics.mean(vals))
    return out


def summarize(results: list[dict], cfg: dict, foreign: float) -> dict:
    total = max(r["timing"][0] for r in results)
    steps = cfg["steps"]
    keys = ("step", "busy", "waiting", "outside", "before", "opt", "send", "wait_ref", "pull", "update", "cpu")
    stats = {k: per_stage(results, k) for k in keys}
    wall = total / steps
    worker_cpu = sum(statistics.median(s["cpu"] for s in r["trace"]) for r in results)
    ref_cpu = sum(r["ref_cpu"] for r in results) / steps
    stats.update(
        samples=steps * cfg["batch"] / total,
        step_ms=1e3 * wall,
        foreign=foreign,
        worker_cpu=worker_cpu,
        ref_cpu=ref_cpu,
        util=(worker_cpu + ref_cpu) / ((os.cpu_count() or 1) * wall),
        loss=statistics.mean(r["trace"][-1]["loss"] for r in results if r["stage"] == K - 1),
    )
    if cfg["pipelines"]:  # s = 0: the mean of the parallel models is the reference (§3.2's invariant)
        err = 0.0
        for k in range(K):
            own = torch.stack([r["own"] for r in results if r["stage"] == k]).double().mean(0)
            ref = next(r["reference"] for r in results if r["stage"] == k).double()
            err = max(err, ((own - ref).abs().max() / ref.abs().max()).item())
        stats["invariant"] = err
    return stats


def runner(bench: Bench):
    """bench.run, each run with a store prefix of its own and, for "malloc kept", glibc's settings."""
    serial = [0]

    def run(kind: str, cfg: dict, world: int, label: str) -> tuple[list[dict], float]:
        serial[0] += 1
        cfg = dict(cfg, prefix=f"bench_avgpipe/{os.getpid()}/{serial[0]}")
        saved = {k: os.environ.get(k) for k in MALLOC}
        if cfg.get("malloc"):  # the spawned workers (and their reference processes) read it at start
            os.environ.update(MALLOC)
        try:
            return bench.run(job, world, kind, cfg, label=label)
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)

    return run


def label(c: dict) -> str:
    if not c["pipelines"]:
        return c["schedule"]
    return f"avg N={c['pipelines']}" + (f" s={c['staleness']}" if c["staleness"] else "") + (" malloc kept" if c.get("malloc") else "")


def key(c: dict) -> tuple:
    return c["schedule"], c["pipelines"], c["microbatches"], c["staleness"], bool(c.get("malloc"))


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


def measure(bench: Bench, args, run, configs: list[dict]) -> dict:
    """Every configuration in interleaved rounds; each one's fastest run, with the largest mean(W_n) vs W_ref."""

    def one(c: dict, rep: int) -> dict:
        tag = f"{label(c)} M={c['microbatches']}"
        results, foreign = run("train", c, K * max(c["pipelines"], 1), tag)
        st = summarize(results, c, foreign)
        inv = f", mean(W_n) vs W_ref {st['invariant']:.1e}" if "invariant" in st else ""
        bench.log(
            f"  run {rep + 1}/{args.rounds} {tag:18s} {st['samples']:7.1f} samples/s ({st['step_ms']:.1f} ms/step, CPU use {st['util']:.2f}, foreign {foreign:.2f}{inv})"
        )
        return st

    return {key(c): st for c, st in zip(configs, pipes.best_runs(configs, args.rounds, one, "samples", "invariant"))}


def main() -> None:
    quick = dict(pipelines=[2], microbatches=[2], staleness=[1], stale_pipelines=[2], malloc_pipelines=[2], malloc_microbatches=[2])
    quick["profile_repeats"] = 3
    bench = Bench(__doc__, quick, rounds=2, steps=20, warmup=4, retries=2, max_foreign=0.1, budget=600.0, quiet_wait=10.0, timeout=300.0)
    p = bench.parser
    p.add_argument("--pipelines", type=ints, default=[1, 2, 4], help="AvgPipe N values")
    p.add_argument("--microbatches", type=ints, default=[2, 4], help="M values (per pipeline)")
    p.add_argument("--staleness", type=ints, default=[1, 2], help="extra staleness bounds s (besides 0), at M = 4")
    p.add_argument("--stale-pipelines", type=ints, default=[2, 4], help="N values of the staleness runs")
    p.add_argument("--malloc-pipelines", type=ints, default=[2, 4], help="N values run again with glibc malloc keeping freed memory")
    p.add_argument("--malloc-microbatches", type=ints, default=[4], help="M values of the malloc runs ('' for none)")
    p.add_argument("--profile-repeats", type=int, default=20)
    args = bench.parse()
    base = dict(hidden=512, mlp_ratio=1, blocks=8, batch=S, steps=args.steps, warmup=args.warmup, lr=1e-3, timeout=args.timeout)
    base["staleness"] = 0
    bench.say(f"S = {S} samples per step; K = {K} stages; {base}\n")
    run = runner(bench)
    configs = configs_of(args, base)
    # the profile: blocks at every micro-batch size used, the link at the activation sizes
    rows = sorted({S // (max(c["pipelines"], 1) * c["microbatches"]) for c in configs})
    prof, foreign = run("profile", dict(base, profile_rows=rows, profile_repeats=args.profile_repeats), K, "profile")
    prof = prof[0]
    costs = lambda rows: costs_at(prof, rows, "bench-avgpipe")
    per_rows = ", ".join(
        f"{r} rows: block f {ms(statistics.median(costs(r).forward))} b {ms(statistics.median(costs(r).backward))} ms" for r in rows
    )
    link = f"link {1e6 * prof['link']['latency']:.0f} us + {prof['link']['bandwidth'] / 1e9:.2f} GB/s"
    bench.say(f"profile (foreign load {foreign:.2f}): {link}; {per_rows}")
    bench.keep("profile", {"link": prof["link"]})
    locals_ = [local_update(base, k) for k in range(K)]  # the elastic update's local work, one process, no messages
    elastic = max(u["ms"] for u in locals_)
    works = (
        f"stage {k} ({u['mb']:.1f} MB of weights) {u['ms']:.1f} ms, {u['faults']:.0f} minor page faults" for k, u in enumerate(locals_)
    )
    bench.say("elastic update's local work (before_update + after_update without messages, one quiet process): " + ", ".join(works))
    best = measure(bench, args, run, configs)
    bench.keep("best", {" ".join(map(str, k)): v for k, v in best.items()})
    pair = lambda v: " / ".join(ms(x) for x in v)
    plain = lambda name, m: best[(name, 0, m, 0, False)]
    main_cfgs = {key(c): c for c in configs if not c["staleness"] and not c.get("malloc") and c["microbatches"] in args.microbatches}
    main_cfgs, extra_cfgs = list(main_cfgs.values()), [c for c in configs if c["staleness"] or c.get("malloc")]
    t = Table(
        "config", "M", "rows / micro-batch", "worker + reference processes", "samples/s", "ms/step", "vs 1F1B (same M)",
        "vs GPipe (same M)", "CPU use (of all cores)", "mean(W_n) vs W_ref", "foreign load",
    )  # fmt: skip
    for c in main_cfgs + [c for c in extra_cfgs if c.get("malloc")]:
        st, m, n = best[key(c)], c["microbatches"], max(c["pipelines"], 1)
        procs = f"{K * n}" + (f" + {K} ref" if c["pipelines"] else "")
        vs = [f"{st['samples'] / plain(name, m)['samples']:.2f}x" for name in ("1f1b", "gpipe")]
        inv = f"{st['invariant']:.0e}" if "invariant" in st else ""
        cells = (f"{st['samples']:.1f}", f"{st['step_ms']:.1f}", *vs, f"{st['util']:.2f}", inv, f"{st['foreign']:.2f}")
        t.add(label(c), m, S // (n * m), procs, *cells)
    title = f"samples/s at S = {S} samples per step (best of {args.rounds}, {args.steps} timed steps)"
    bench.table(t, f"\n## measured on {os.cpu_count()} shared cores: {title}")
    t = Table(
        "config", "M", "step", "compute", "executor, not computing", "optimizer", "elastic: copy", "Δ + send", "wait W_ref",
        "pull + rest", "worker CPU", "ref CPU (sum)",
    )  # fmt: skip
    for c in main_cfgs + extra_cfgs:
        st = best[key(c)]
        el = [pair(st[k]) for k in ("before", "send", "wait_ref", "pull")] + [ms(st["ref_cpu"])] if c["pipelines"] else [""] * 5
        t.add(label(c), c["microbatches"], *(pair(st[k]) for k in ("step", "busy", "waiting", "opt")), *el[:4], pair(st["cpu"]), el[4])
    bench.table(t, "\n## where the time goes, per worker and step, ms (stage 0 / stage 1; median step, mean over the pipelines)")
    t = Table(
        "config", "M", "devices", "rows / micro-batch", "simulated pipeline iteration, ms", "+ optimizer", "+ elastic update",
        "samples/s (simulated, with elastic)", "vs 1F1B on 2 devices", "vs GPipe on 2 devices", "vs 1F1B without the elastic update",
    )  # fmt: skip
    for m in args.microbatches:
        opt = max(plain("1f1b", m)["opt"])  # the simulator has no optimizer: add the one measured
        it = {name: sim_iteration(name, m, costs(S // m)) for name in ("gpipe", "1f1b")}
        ref = {name: it[name] + opt for name in it}
        for name in it:
            vs = [f"{ref[base] / ref[name]:.2f}x" for base in ("1f1b", "gpipe")]
            t.add(name, m, K, S // m, ms(it[name]), ms(ref[name]), "", f"{S / ref[name]:.0f}", *vs, "")
        for n in args.pipelines:
            t_it = sim_iteration("1f1b", m, costs(S // (n * m)))
            total = t_it + opt + elastic / 1e3
            vs = [f"{x:.2f}x" for x in (ref["1f1b"] / total, ref["gpipe"] / total, ref["1f1b"] / (t_it + opt))]
            t.add(f"avg N={n}", m, K * n, S // (n * m), ms(t_it), ms(t_it + opt), ms(total), f"{S / total:.0f}", *vs)
    bench.table(
        t, f"\n## SIMULATED, not measured: N pipelines with K = {K} devices of their own each, vs the plain pipeline on {K} devices"
    )
    if args.staleness:
        t, m = Table("N", "M", "s", "samples/s", "vs s = 0", "wait W_ref, ms", "ms/step", align="rrrrrrr"), STALE_MICROBATCHES[0]
        for n in args.stale_pipelines:
            for s in [0, *args.staleness]:
                st, b0 = best[("1f1b", n, m, s, False)], best[("1f1b", n, m, 0, False)]
                t.add(
                    n, m, s, f"{st['samples']:.1f}", f"{st['samples'] / b0['samples']:.3f}x", pair(st["wait_ref"]), f"{st['step_ms']:.1f}"
                )
        bench.table(
            t, "\n## staleness s (measured, shared cores): samples/s, best run; time per step waiting for W_ref (stage 0 / stage 1)"
        )
    bench.finish()


if __name__ == "__main__":
    main()
