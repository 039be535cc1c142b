"""Emulated depth, both runtimes: our runtime (raw, and through the Trainer) against
torch.distributed.pipelining on the same EMULATED blocks, P = 4 and 8 processes.

Every block is `zero_bubble.SplitBlock`'s (a Linear whose forward sleeps f, whose input gradient
sleeps BI and whose weight gradient sleeps W: a whole backward sleeps BI + W, a split one puts each
sleep in its half), 2 blocks per rank, M micro-batches over gloo. Per schedule both runtimes have
(1F1B, GPipe, interleaved with 2 chunks per rank, ZBV) and per runtime: the step (median over
interleaved rounds of the mean step of a round), against the ideal (the simulator's makespan with
free messages: (M + P - 1)(F + B) for the flush schedules) and against the floor (the ideal's
critical path of computes run back to back in one process, by the same blocks and autograd: what
sleeping and autograd cost, not charged to a runtime). One launch per P runs every configuration,
rounds interleaved (A B C, A B C, ...); with the Trainer (``--trainer``, a schedule per P) the launch
is a ``Trainer.fit`` whose rounds alternate with the others' inside it. Results:
docs/results/emulated_torch.md.

    python -m benchmarks.bench_emulated_torch --rounds 7 --json <file> --markdown <file>
    python -m benchmarks.bench_emulated_torch --ranks 8 --trace 1f1b --rounds 5     # where the time goes
    python -m benchmarks.bench_emulated_torch --quick     # smoke: P = 2, 1F1B, 1 round
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.harness.bench import Bench, column_table, spread
from benchmarks.harness.emulated import fine_timer_slack
from benchmarks.harness.launch import CpuClock, foreign_load, run_distributed
from benchmarks.harness.pipes import chunk_pipeline, equal_bounds, torch_stages
from benchmarks.harness.zero_bubble import SplitBlock, _Sleep
from lightning_pipe.runtime.p2p import Transport
from lightning_pipe.runtime.split_backward import backward_input, backward_weight
from lightning_pipe.schedules import Op, build_schedule
from lightning_pipe.simulation import CostModel, simulate

# (our name, torch's name): the schedules both runtimes have
SCHEDULES = {"1f1b": "1f1b", "gpipe": "gpipe", "interleaved": "interleaved", "zb-v": "zbv"}
FLUSH = ("1f1b", "gpipe")  # ideal (M + P - 1)(F + B)


class _Fresh(torch.autograd.Function):
    """Identity to a new tensor: torch's split backward detaches a stage's output in place, which a
    view (the sleep's output) refuses."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class Block(SplitBlock):
    """`zero_bubble.SplitBlock` (F, BI and W sleeps) whose output is not a view."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f, bi, w = self.times
        weight = _Sleep.apply(self.linear.weight, 0.0, w)
        return _Fresh.apply(_Sleep.apply(x + torch.tanh(nn.functional.linear(x, weight, self.linear.bias)), f, bi))


def make_model(cfg: dict, world: int) -> nn.Sequential:
    """2 Blocks per rank, float64, the same weights in every process."""
    torch.manual_seed(cfg["seed"])
    f, bi, w = (cfg[k] / 1e3 for k in ("f_ms", "bi_ms", "w_ms"))
    model = nn.Sequential(*[Block(cfg["width"], f, bi, w) for _ in range(2 * world)]).double()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    return model


def make_data(cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(cfg["m"] * cfg["rows"], cfg["width"], generator=g, dtype=torch.float64)
    return x, torch.tanh(x.flip(1))


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def ideal_costs(world: int, cfg: dict) -> CostModel:
    """The blocks' emulated times, messages free."""
    f, bi, w = (cfg[k] / 1e3 for k in ("f_ms", "bi_ms", "w_ms"))
    n = 2 * world
    return CostModel((f,) * n, (bi + w,) * n, weight=(w,) * n, backward_input=(bi,) * n)


def ideal(name: str, world: int, cfg: dict):
    """The simulator's timeline of `name` on the emulated times with free messages (its critical path kept)."""
    schedule = build_schedule(name, world, cfg["m"])
    return simulate(schedule, ideal_costs(world, cfg), equal_bounds(2 * world, schedule.num_chunks), critical_path=True)


# ---- the runtimes, one configuration each -------------------------------------------------------
def ours(model: nn.Sequential, name: str, rank: int, world: int, cfg: dict):
    """Our raw runtime (SequentialPipeline over gloo): one step of (x, y) and its SGD."""
    schedule = build_schedule(name, world, cfg["m"])
    _, pipe, opt = chunk_pipeline(
        model,
        schedule,
        equal_bounds(len(model), schedule.num_chunks),
        rank,
        Transport(lambda r: r, torch.device("cpu")),
        loss_fn,
        cfg["lr"],
    )
    return pipe, opt


def theirs(model: nn.Sequential, name: str, rank: int, world: int, cfg: dict):
    example = torch.empty(cfg["rows"], cfg["width"], dtype=torch.float64)
    run, blocks = torch_stages(model, SCHEDULES[name], world, rank, cfg["m"], example, loss_fn)
    return run, torch.optim.SGD([p for i in sorted(blocks) for p in model[i].parameters()], lr=cfg["lr"])


class Floor:
    """The ideal's critical path of `name` run back to back in this process: each compute on it by the
    same blocks and autograd (a forward; a backward, BI or W from a fresh forward, only the backward
    timed), the last chunk's with the loss; the sum of their times."""

    def __init__(self, name: str, world: int, cfg: dict):
        self.cfg, self.model = cfg, make_model(cfg, world)
        schedule = build_schedule(name, world, cfg["m"])
        self.bounds, self.last = equal_bounds(2 * world, schedule.num_chunks), schedule.num_chunks - 1
        self.path = [e.action for e in ideal(name, world, cfg).critical_path]
        x, y = make_data(cfg)
        self.x, self.y = x[: cfg["rows"]], y[: cfg["rows"]]

    def _forward(self, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        inp = self.x.clone().requires_grad_(chunk > 0)
        out = self.model[slice(*self.bounds[chunk])](inp)
        return inp, loss_fn(out, self.y) if chunk == self.last else out

    def run(self) -> float:
        total = 0.0
        for a in self.path:
            if a.op is Op.FORWARD:
                t = time.perf_counter()
                self._forward(a.chunk)
                total += time.perf_counter() - t
                continue
            inp, out = self._forward(a.chunk)
            grads = [None] if a.chunk == self.last else [torch.ones_like(out)]
            leaves = [inp] if a.chunk > 0 else []
            if a.op is Op.BACKWARD:
                t = time.perf_counter()
                torch.autograd.backward([out], grads)
            elif a.op is Op.BACKWARD_INPUT:
                t = time.perf_counter()
                backward_input([out], grads, leaves)
            else:  # W: after its BI
                _, deferred = backward_input([out], grads, leaves)
                t = time.perf_counter()
                backward_weight(deferred)
            total += time.perf_counter() - t
        self.model.zero_grad(set_to_none=True)
        return total


def configurations(rank: int, world: int, cfg: dict) -> dict[str, callable]:
    """Every raw configuration of this launch: ``key -> step()`` (ours / torch per schedule; the floor,
    run on rank 0 while the others wait)."""
    x, y = make_data(cfg)
    steps = {}
    for name in cfg["schedules"]:
        pipe, opt = ours(make_model(cfg, world), name, rank, world, cfg)
        steps[f"ours/{name}"] = lambda pipe=pipe, opt=opt: (opt.zero_grad(set_to_none=True), pipe.step(x, y), opt.step())
        if not cfg["no_torch"]:
            run, opt = theirs(make_model(cfg, world), name, rank, world, cfg)
            steps[f"torch/{name}"] = lambda run=run, opt=opt: (opt.zero_grad(set_to_none=True), run(x, y), opt.step())
        floor = Floor(name, world, cfg) if rank == 0 else None
        steps[f"floor/{name}"] = floor.run if floor is not None else (lambda: None)
    return steps


def one_round(key: str, step, cfg: dict) -> float:
    """``cfg["steps"]`` steps between two barriers: the mean step, rank 0's clock (the floor: its own sum)."""
    dist.barrier()
    t = time.perf_counter()
    total = sum(step() or 0.0 for _ in range(cfg["steps"])) if key.startswith("floor/") else [step() for _ in range(cfg["steps"])]
    dist.barrier()
    wall = time.perf_counter() - t
    return (total if key.startswith("floor/") else wall) / cfg["steps"]


def warm(steps: dict, cfg: dict) -> None:
    for key, step in steps.items():
        for _ in range(cfg["warmup"]):
            step()
        dist.barrier()


def _load(start: CpuClock, world: int) -> float:
    """Other processes' CPUs since `start`, every rank's own time taken out (collective)."""
    end = CpuClock.now()
    own: list = [None] * world
    dist.all_gather_object(own, end.own - start.own)
    return foreign_load(start, end, own=sum(own))


def raw_job(rank: int, world: int, cfg: dict) -> dict:
    """A launch without the Trainer: every configuration in interleaved rounds."""
    fine_timer_slack()
    steps = configurations(rank, world, cfg)
    warm(steps, cfg)
    start, times = CpuClock.now(), {k: [] for k in steps}
    for _ in range(cfg["rounds"]):
        for key, step in steps.items():
            times[key].append(one_round(key, step, cfg))
    return {"times": times, "foreign": _load(start, world)}


def trainer_job(rank: int, world: int, cfg: dict) -> dict:
    """A launch that is a ``Trainer.fit`` (AutoPipeStrategy, schedule ``cfg["trainer"]``): the other
    configurations' rounds run between the Trainer's rounds, from a callback."""
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0", GROUP_RANK="0")
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from benchmarks.harness.trainer_runs import quiet_lightning
    from lightning_pipe import AutoPipeStrategy

    quiet_lightning()
    fine_timer_slack()
    k, rounds, warmup = cfg["steps"], cfg["rounds"], cfg["warmup"]

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.seq = make_model(cfg, world)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = loss_fn(self.seq(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=cfg["lr"])

    class Rounds(Callback):
        """Steps 0 .. warmup - 1 untimed; then round r is Trainer steps warmup + r k .. + k - 1, after
        a round of every other configuration."""

        def on_train_start(self, trainer, pl_module):  # the process group is Lightning's now
            self.steps = configurations(rank, world, cfg)
            warm(self.steps, cfg)
            self.times = {"trainer": [], **{key: [] for key in self.steps}}
            self.start = CpuClock.now()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx >= warmup and (batch_idx - warmup) % k == 0:
                for key, step in self.steps.items():
                    self.times[key].append(one_round(key, step, cfg))
                dist.barrier()
                self.t = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx >= warmup and (batch_idx - warmup) % k == k - 1:
                dist.barrier()
                self.times["trainer"].append((time.perf_counter() - self.t) / k)

        def on_train_end(self, trainer, pl_module):
            self.foreign = _load(self.start, world)

    clock, total = Rounds(), warmup + rounds * k
    strategy = AutoPipeStrategy(schedule=cfg["trainer"], microbatches=cfg["m"], partition="uniform", message_costs=False)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=total, callbacks=[clock], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)  # fmt: skip
    x, y = make_data(cfg)
    trainer.fit(Module(), torch.utils.data.DataLoader([(x, y)] * total, batch_size=None))
    return {"times": clock.times, "foreign": clock.foreign}


# ---- where our runtime's time goes (--trace) -----------------------------------------------------
def trace_job(rank: int, world: int, cfg: dict) -> dict:
    """Our raw runtime's `cfg["trace"]` schedule, traced (the executor's records) and cProfiled on the
    thread's CPU clock (rank world // 2): per step, its start and end, the records, the CPU seconds."""
    import cProfile
    import io
    import pstats

    from benchmarks.harness.launch import own_seconds

    fine_timer_slack()
    pipe, opt = ours(make_model(cfg, world), cfg["trace"], rank, world, cfg)
    x, y = make_data(cfg)
    for _ in range(cfg["warmup"]):
        opt.zero_grad(set_to_none=True), pipe.step(x, y), opt.step()
    ex, steps = pipe.executor, []
    ex.trace = True
    prof = cProfile.Profile(time.thread_time) if rank == world // 2 else None
    for _ in range(cfg["rounds"] * cfg["steps"]):
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        t, cpu = time.perf_counter(), own_seconds()
        prof and prof.enable()
        pipe.step(x, y)
        prof and prof.disable()
        steps.append(dict(t0=t, t1=time.perf_counter(), cpu=own_seconds() - cpu,
                          computes={(ex.actions[j].op.value, ex.actions[j].microbatch): (s, e) for j, s, e in ex.records
                                    if ex.actions[j].op.is_compute}))  # fmt: skip
        opt.step()
    out = {"steps": steps}
    if prof is not None:
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(15)
        out["profile"] = text.getvalue()
    return out


def trace_report(bench: Bench, world: int, ranks: list[dict], cfg: dict) -> dict:
    """Per rank: CPU per step, each compute's time beyond its blocks' emulated time; over the pipeline:
    each message's hop (sender's compute end to receiver's compute start, where the receiver was idle)."""
    f, b = 2 * cfg["f_ms"] / 1e3, 2 * (cfg["bi_ms"] + cfg["w_ms"]) / 1e3
    emulated = {"F": f, "B": b}
    n = len(ranks[0]["steps"])
    steps = [max(r["steps"][i]["t1"] for r in ranks) - ranks[0]["steps"][i]["t0"] for i in range(n)]
    cpu = [statistics.median(s["cpu"] for s in r["steps"]) for r in ranks]
    extra = [e - s - emulated[op] for r in ranks for st in r["steps"] for (op, _), (s, e) in st["computes"].items()]
    hops = []
    for i in range(n):
        for r in range(world):
            mine = ranks[r]["steps"][i]["computes"]
            order = sorted(mine.items(), key=lambda kv: kv[1][0])
            for j, ((op, mb), (s, _)) in enumerate(order):
                src = r - 1 if op == "F" else r + 1
                if not 0 <= src < world or (op == "B" and r == world - 1):
                    continue
                sent = ranks[src]["steps"][i]["computes"][(op, mb)][1]
                if j == 0 or order[j - 1][1][1] < sent:  # the receiver was idle when the data left
                    hops.append(s - sent)
    q = lambda xs, k: sorted(xs)[min(len(xs) - 1, int(k * len(xs)))] * 1e6  # noqa: E731
    bench.say(f"\n#### Trace: our raw runtime, {cfg['trace']}, P = {world} (EMULATED), {n} steps")
    bench.say(f"step ms: median {statistics.median(steps) * 1e3:.1f}; CPU per step and rank (ms, all threads): "
              + ", ".join(f"{c * 1e3:.1f}" for c in cpu))  # fmt: skip
    bench.say(
        f"a compute's time beyond its emulated time (us): median {q(extra, 0.5):.0f}, p10 {q(extra, 0.1):.0f}, p90 {q(extra, 0.9):.0f}"
    )
    bench.say(f"a message's hop, sender's compute end to receiver's compute start (us, receiver idle): median {q(hops, 0.5):.0f}, "
              f"p10 {q(hops, 0.1):.0f}, p90 {q(hops, 0.9):.0f} ({len(hops)} hops)")  # fmt: skip
    profile = next(r["profile"] for r in ranks if "profile" in r)
    bench.log(f"rank {world // 2}'s heaviest functions (thread CPU clock, cProfile on):\n{profile}")
    return dict(steps=steps, cpu=cpu, extra_median=q(extra, 0.5) / 1e6, hops=hops, profile=profile)


# ---- the table ----------------------------------------------------------------------------------
def paired(a: list[float], b: list[float]) -> float:
    """The median over rounds of a / b, each round's pair measured next to each other."""
    return statistics.median(x / y for x, y in zip(a, b))


def rows_of(world: int, times: dict, cfg: dict, trainer: str | None) -> list[dict]:
    out = []
    for name in cfg["schedules"]:
        tl = ideal(name, world, cfg)
        floor = statistics.median(times[f"floor/{name}"])
        raw, torch_ = times[f"ours/{name}"], times.get(f"torch/{name}")
        runtimes = [("ours", raw), ("torch", torch_)] + ([("Trainer", times["trainer"])] if trainer == name else [])
        for runtime, rounds in runtimes:
            if rounds is None:
                continue
            s = spread(rounds)
            row = dict(P=world, M=cfg["m"], schedule=name, runtime=runtime, step=s.median, lo=s.lo, hi=s.hi, rounds=rounds,
                       ideal=tl.iteration_time, floor=floor, floor_rounds=times[f"floor/{name}"])  # fmt: skip
            if torch_ is not None and runtime != "torch":
                row.update(vs_torch=s.median / statistics.median(torch_), vs_torch_paired=paired(rounds, torch_))
            if runtime == "Trainer":
                row.update(vs_raw=s.median / statistics.median(raw), vs_raw_paired=paired(rounds, raw))
            out.append(row)
    return out


def _x(key: str):
    return lambda r: "" if r.get(key) is None else f"{r[key]:.3f}"


COLUMNS = (
    ("P", lambda r: r["P"]), ("schedule", lambda r: r["schedule"]), ("runtime", lambda r: r["runtime"]),
    ("step ms, median (min..max), EMULATED", lambda r: f"{r['step'] * 1e3:.1f} ({r['lo'] * 1e3:.1f}..{r['hi'] * 1e3:.1f})"),
    ("ideal ms", lambda r: f"{r['ideal'] * 1e3:.1f}"), ("floor ms", lambda r: f"{r['floor'] * 1e3:.1f}"),
    ("step / ideal", lambda r: f"{r['step'] / r['ideal']:.3f}"), ("step / floor", lambda r: f"{r['step'] / r['floor']:.3f}"),
    ("/ torch", _x("vs_torch")), ("/ torch, per round", _x("vs_torch_paired")), ("/ raw", _x("vs_raw")), ("/ raw, per round", _x("vs_raw_paired")),
)  # fmt: skip


def _verdict(value: float, bound: float) -> str:
    return "met" if value <= bound else "NOT met"


def targets(rows: list[dict]) -> list[str]:
    """The targets, each line saying met or NOT met (ratios of the medians; per round: the median of
    each round's ratio)."""
    out = []
    for r in (r for r in rows if r["runtime"] == "ours" and r.get("vs_torch") is not None):
        out.append(f"P={r['P']} {r['schedule']}: ours / torch {r['vs_torch']:.3f} (per round {r['vs_torch_paired']:.3f}; target <= 1): "
                   f"{_verdict(r['vs_torch'], 1)} (per round: {_verdict(r['vs_torch_paired'], 1)})")  # fmt: skip
    for r in (r for r in rows if r["runtime"] == "ours" and r["schedule"] == "1f1b" and r["P"] == 8):
        ratio = r["step"] / r["floor"]
        out.append(f"P=8 1f1b: ours / floor {ratio:.3f} (target <= 1.05): {_verdict(ratio, 1.05)}")
    for r in (r for r in rows if r["runtime"] == "Trainer"):
        out.append(f"P={r['P']} {r['schedule']}: Trainer / raw {r['vs_raw']:.3f} (per round {r['vs_raw_paired']:.3f}; target <= 1.03): "
                   f"{_verdict(r['vs_raw'], 1.03)} (per round: {_verdict(r['vs_raw_paired'], 1.03)})")  # fmt: skip
    return out


def main() -> None:
    bench = Bench(__doc__, dict(ranks=[2], schedules=["1f1b"], trainer=[]), threads=1, rounds=7, steps=4, warmup=2, timeout=1200.0)
    bench.options(ranks=([4, 8], "processes (P)"), schedules=(list(SCHEDULES), f"a subset of {list(SCHEDULES)}"))
    bench.options(trainer=(["1f1b", "1f1b"], "per P, the schedule run through the Trainer ('-': none)"), m=(8, "micro-batches (M)"))
    bench.options(
        f_ms=(2.0, "forward ms per block"), bi_ms=(2.0, "input-gradient ms per block"), w_ms=(2.0, "weight-gradient ms per block")
    )
    bench.options(width=16, rows=(4, "rows per micro-batch"), no_torch=(False, "our runtime only"))
    bench.options(trace=(None, "instead of the table: trace our raw runtime's schedule TRACE (gpipe or 1f1b) at each P"))
    args = bench.parse()
    cfg = {
        k: getattr(args, k) for k in ("m", "f_ms", "bi_ms", "w_ms", "width", "rows", "rounds", "steps", "warmup", "schedules", "no_torch")
    }
    cfg.update(lr=0.01, seed=3, trace=args.trace)
    if args.trace:
        if args.trace not in FLUSH:
            bench.error(f"--trace: one chunk per rank, one of {FLUSH}")
        for p in args.ranks:
            bench.keep(f"trace P={p}", trace_report(bench, p, run_distributed(trace_job, p, cfg, timeout=args.timeout, threads=1), cfg))
        bench.finish()
        return
    f, b = 2 * args.f_ms, 2 * (args.bi_ms + args.w_ms)  # a rank's stage: 2 blocks
    bench.say(f"EMULATED: 2 blocks per rank, a block {args.f_ms:g} ms forward, {args.bi_ms:g} + {args.w_ms:g} ms backward (BI + W); "
              f"a stage F = {f:g} ms, B = {b:g} ms; M = {args.m}; {args.rounds} interleaved rounds of {args.steps} steps")  # fmt: skip
    rows, loads = [], {}
    for i, p in enumerate(args.ranks):
        trainer = args.trainer[i] if i < len(args.trainer) and args.trainer[i] in args.schedules else None
        t = time.monotonic()
        job = trainer_job if trainer else raw_job
        ranks = run_distributed(job, p, dict(cfg, trainer=trainer), timeout=args.timeout, threads=1, backend=None if trainer else "gloo")
        loads[p] = ranks[0]["foreign"]
        bench.log(f"P={p}: {time.monotonic() - t:.0f} s, other processes {loads[p]:.2f} CPUs")
        rows += rows_of(p, ranks[0]["times"], cfg, trainer)
    bench.table(column_table(COLUMNS, rows, "lll" + "r" * 9), "Step per runtime and schedule (EMULATED devices)")
    bench.say("other processes' load during each launch (CPUs of 2): " + ", ".join(f"P={p}: {v:.2f}" for p, v in loads.items()))
    for line in targets(rows):
        bench.say(line)
    bench.keep("rows", rows)
    bench.keep("foreign_load", loads)
    bench.finish()


if __name__ == "__main__":
    main()
