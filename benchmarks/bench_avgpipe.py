"""AvgPipe (N parallel pipelines, elastic averaging) vs plain GPipe / 1F1B at the same samples per step.

The residual MLP (lightning_pipe.bench.mlp), K = 2 stages, gloo, one thread per process, S = 256 rows
per optimizer step, all pipelines on this machine's cores: samples/s, where the time goes per worker,
the staleness bound, "malloc kept" runs; simulated: N pipelines with devices of their own. Feeds
docs/benchmarks_avgpipe.md (method and results there).

    python benchmarks/bench_avgpipe.py --retries 1 --budget 480
    python benchmarks/bench_avgpipe.py --quick     # smoke: N = 2, M = 2, s = 1, malloc kept, 2 steps
"""

from __future__ import annotations

import os
import statistics
import time
from itertools import count
from unittest import mock

import torch
import torch.distributed as dist

from lightning_pipe.bench import pipes
from lightning_pipe.bench.harness import Bench, column_table, ms
from lightning_pipe.bench.launch import proc_stat, timed_steps
from lightning_pipe.bench.mlp import loss_fn, make_data, make_model, stage_half
from lightning_pipe.bench.pipes import Clock, compute_seconds, costs_at, equal_bounds, time_executor
from lightning_pipe.layers import ElasticAveraging, Flush
from lightning_pipe.runtime.elastic import ReferenceLink, flat_into, flat_size
from lightning_pipe.runtime.p2p import Transport
from lightning_pipe.runtime.sequential import SequentialHost
from lightning_pipe.schedules import ScheduleSpec, build_schedule
from lightning_pipe.simulation import simulate

K = 2  # stages per pipeline
S = 256  # samples (rows) per optimizer step, every configuration
STALE_MICROBATCHES = [4]  # M of the staleness runs
# glibc malloc kept from returning freed memory to the OS: the "malloc kept" variant (fresh pages for the
# elastic update's stage-sized temporaries are what its time is mostly spent on otherwise)
MALLOC = {"MALLOC_TRIM_THRESHOLD_": str(1 << 30), "MALLOC_MMAP_THRESHOLD_": str(1 << 30)}
SERIAL = count(1)  # runs so far: each run's store prefix


def make_batches(cfg: dict, pipeline: int, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pipeline `pipeline`'s own fixed batches (different for every pipeline), cycled through the steps."""
    return make_data(dict(cfg, batch=rows), seed=1234 + 7919 * pipeline)


def _train(rank: int, world: int, cfg: dict) -> dict:
    n, m, pipeline, stage = cfg["pipelines"], cfg["microbatches"], rank // K, rank % K  # n = 0: a plain pipeline
    chunk = stage_half(make_model(cfg), stage)
    data = make_batches(cfg, pipeline, cfg["batch"] // max(n, 1))
    host = SequentialHost({stage: chunk}, K - 1, loss_fn)
    transport = Transport(lambda s: pipeline * K + s, torch.device("cpu"))
    opt = torch.optim.SGD(chunk.parameters(), lr=cfg["lr"])
    clock = Clock(send=0.0, wait_ref=0.0)
    time_executor(clock)  # time inside the executor, as bench_2bw
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
        trace.append(
            dict(clock, step=time.perf_counter() - t0, busy=busy, waiting=clock["executor"] - busy, pull=pull, cpu=time.process_time() - c0)
        )

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
    from collections import deque
    from types import SimpleNamespace

    message, free, pending = torch.empty(numel + 1, dtype=dtype), [], deque()
    link = SimpleNamespace(pending=pending, max_sends=2, send_init=lambda ref: None, release=free.append)
    link.send_delta = lambda delta: message[1:].copy_(delta.detach())
    link.post_reference = lambda: pending.append(free.pop() if free else torch.empty(numel, dtype=dtype))
    link.take_reference = lambda: pending.popleft().copy_(reference)
    return link


def local_update(cfg: dict, stage: int, repeats: int = 30) -> dict:
    """ElasticAveraging's before_update + after_update on one stage's weights, in this (single-threaded)
    process, with stub_link: the elastic update's local work (copies, Δ, pull) without messages or
    waiting; median ms and minor page faults per update (fresh stage-sized buffers)."""
    import resource

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


def job(rank: int, world: int, kind: str, cfg: dict) -> dict:
    if kind != "profile":
        return _train(rank, world, cfg)
    # the link (ping_pong) at the activation sizes and every block at each micro-batch size, both ranks at once
    sizes = (4, *sorted({r * cfg["hidden"] * 4 for r in cfg["profile_rows"]} | {1 << 20, 1 << 22}))
    x, y = make_batches(cfg, 0, max(cfg["profile_rows"]))[0]
    return pipes.profile_job(rank, world, list(make_model(cfg)), x, y, cfg["profile_rows"], sizes, loss_fn, cfg["profile_repeats"])


def summarize(results: list[dict], cfg: dict, foreign: float) -> dict:
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


def run(bench: Bench, kind: str, cfg: dict, world: int, label: str) -> tuple[list[dict], float]:
    """bench.run with a store prefix of its own and, for "malloc kept", glibc's settings (the spawned
    workers and their reference processes read them at start)."""
    with mock.patch.dict(os.environ, MALLOC if cfg.get("malloc") else {}):
        return bench.run(job, world, kind, dict(cfg, prefix=f"bench_avgpipe/{os.getpid()}/{next(SERIAL)}"), label=label)


def label(c: dict) -> str:
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


def measure(bench: Bench, args, configs: list[dict]) -> list[dict]:
    """Every configuration in interleaved rounds; per configuration one record: the configuration and
    its fastest run's figures, with the largest mean(W_n) vs W_ref over its runs."""

    def one(c: dict, rep: int) -> dict:
        tag = f"{label(c)} M={c['microbatches']}"
        results, foreign = run(bench, "train", c, K * max(c["pipelines"], 1), tag)
        st = summarize(results, c, foreign)
        inv = f", mean(W_n) vs W_ref {st['invariant']:.1e}" if "invariant" in st else ""
        figures = f"{st['samples']:7.1f} samples/s ({st['step_ms']:.1f} ms/step, CPU use {st['util']:.2f}, foreign {foreign:.2f}{inv})"
        bench.log(f"  run {rep + 1}/{args.rounds} {tag:18s} {figures}")
        return st

    stats = pipes.best_runs(configs, args.rounds, one, "samples", "invariant")
    bench.keep("best", {f"{label(c)} M={c['microbatches']}": st for c, st in zip(configs, stats)})
    return list({(label(c), c["microbatches"]): dict(c, **st) for c, st in zip(configs, stats)}.values())


def simulated(records: dict, m: int, costs, elastic: float, pipelines: list[int]) -> list[dict]:
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


def main() -> None:
    quick = dict.fromkeys(("pipelines", "microbatches", "stale_pipelines", "malloc_pipelines", "malloc_microbatches"), [2])
    quick.update(staleness=[1], profile_repeats=3)
    common = dict(rounds=2, steps=20, warmup=4, retries=2, max_foreign=0.1, budget=600.0, quiet_wait=10.0, timeout=300.0)
    bench = Bench(__doc__, quick, threads=1, **common)
    bench.options(pipelines=([1, 2, 4], "AvgPipe N values"), microbatches=([2, 4], "M values (per pipeline)"), profile_repeats=20)
    bench.options(staleness=([1, 2], "staleness bounds s besides 0, at M = 4"), stale_pipelines=([2, 4], "N of the staleness runs"))
    bench.options(malloc_pipelines=([2, 4], "N values run again with glibc malloc keeping freed memory"))
    bench.options(malloc_microbatches=([4], "M values of the malloc runs ('' for none)"))
    args = bench.parse()
    base = dict(hidden=512, mlp_ratio=1, blocks=8, batch=S, steps=args.steps, warmup=args.warmup, lr=1e-3, timeout=args.timeout)
    base["staleness"] = 0
    bench.say(f"S = {S} samples per step; K = {K} stages; {base}\n")
    configs = configs_of(args, base)
    # the profile: blocks at every micro-batch size used, the link at the activation sizes
    rows = sorted({S // (max(c["pipelines"], 1) * c["microbatches"]) for c in configs})
    prof, foreign = run(bench, "profile", dict(base, profile_rows=rows, profile_repeats=args.profile_repeats), K, "profile")
    costs = lambda rows: costs_at(prof[0], rows, "bench-avgpipe")
    blocks = (f"{r} rows: block f {ms(statistics.median(costs(r).forward))} b {ms(statistics.median(costs(r).backward))} ms" for r in rows)
    link = f"link {1e6 * prof[0]['link']['latency']:.0f} us + {prof[0]['link']['bandwidth'] / 1e9:.2f} GB/s"
    bench.say(f"profile (foreign load {foreign:.2f}): {link}; " + ", ".join(blocks))
    bench.keep("profile", {"link": prof[0]["link"]})
    locals_ = [local_update(base, k) for k in range(K)]  # the elastic update's local work, one process, no messages
    works = ", ".join(u["text"] for u in locals_)
    bench.say(f"elastic update's local work (before_update + after_update without messages, one quiet process): {works}")
    records = measure(bench, args, configs)
    by_key = {(label(r), r["microbatches"]): r for r in records}
    main_ = [r for r in records if not r["staleness"] and not r.get("malloc") and r["microbatches"] in args.microbatches]
    malloc, extra = [r for r in records if r.get("malloc")], [r for r in records if r["staleness"] or r.get("malloc")]
    pair = lambda v: " / ".join(ms(x) for x in v)
    per = lambda key: lambda r: pair(r[key])  # stage 0 / stage 1
    elastic = lambda key, fmt=pair: lambda r: fmt(r[key]) if r["pipelines"] else ""
    vs = lambda name: lambda r: f"{r['samples'] / by_key[(name, r['microbatches'])]['samples']:.2f}x"
    procs = lambda r: f"{K * max(r['pipelines'], 1)}" + (f" + {K} ref" if r["pipelines"] else "")
    columns = [
        ("config", label), ("M", "microbatches"), ("rows / micro-batch", lambda r: S // (max(r["pipelines"], 1) * r["microbatches"])),
        ("worker + reference processes", procs), ("samples/s", "samples", ".1f"), ("ms/step", "step_ms", ".1f"), ("vs 1F1B (same M)", vs("1f1b")),
        ("vs GPipe (same M)", vs("gpipe")), ("CPU use (of all cores)", "util", ".2f"), ("mean(W_n) vs W_ref", "invariant", ".0e"), ("foreign load", "foreign", ".2f"),
    ]  # fmt: skip
    title = f"samples/s at S = {S} samples per step (best of {args.rounds}, {args.steps} timed steps)"
    bench.table(column_table(columns, main_ + malloc), f"\n## measured on {os.cpu_count()} shared cores: {title}")
    columns = [
        ("config", label), ("M", "microbatches"), ("step", per("step")), ("compute", per("busy")), ("executor, not computing", per("waiting")),
        ("optimizer", per("opt")), ("elastic: copy", elastic("before")), ("Δ + send", elastic("send")), ("wait W_ref", elastic("wait_ref")),
        ("pull + rest", elastic("pull")), ("worker CPU", per("cpu")), ("ref CPU (sum)", elastic("ref_cpu", ms)),
    ]  # fmt: skip
    title = "\n## where the time goes, per worker and step, ms (stage 0 / stage 1; median step, mean over the pipelines)"
    bench.table(column_table(columns, main_ + extra), title)
    elastic_s = max(u["ms"] for u in locals_) / 1e3
    rows = [row for m in args.microbatches for row in simulated(by_key, m, costs, elastic_s, args.pipelines)]
    columns = [
        ("config", "label"), ("M", "m"), ("devices", "devices"), ("rows / micro-batch", "rows"), ("simulated pipeline iteration, ms", "it", ".1f"),
        ("+ optimizer", "with_opt", ".1f"), ("+ elastic update", "total", ".1f"), ("samples/s (simulated, with elastic)", "samples", ".0f"),
        ("vs 1F1B on 2 devices", "vs_1f1b"), ("vs GPipe on 2 devices", "vs_gpipe"), ("vs 1F1B without the elastic update", "vs_plain"),
    ]  # fmt: skip
    title = f"\n## SIMULATED, not measured: N pipelines with K = {K} devices of their own each, vs the plain pipeline on {K} devices"
    bench.table(column_table(columns, rows), title)
    if args.staleness:
        m = STALE_MICROBATCHES[0]
        rows = [by_key[(label(dict(pipelines=n, staleness=s)), m)] for n in args.stale_pipelines for s in [0, *args.staleness]]
        vs0 = lambda r: f"{r['samples'] / by_key[(label(dict(r, staleness=0)), m)]['samples']:.3f}x"
        columns = [
            ("N", "pipelines"), ("M", "microbatches"), ("s", "staleness"), ("samples/s", "samples", ".1f"), ("vs s = 0", vs0),
            ("wait W_ref, ms", per("wait_ref")), ("ms/step", "step_ms", ".1f"),
        ]  # fmt: skip
        title = "\n## staleness s (measured, shared cores): samples/s, best run; time per step waiting for W_ref (stage 0 / stage 1)"
        bench.table(column_table(columns, rows, align="r" * 7), title)
    bench.finish()


if __name__ == "__main__":
    main()
