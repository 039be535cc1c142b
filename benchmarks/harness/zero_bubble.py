"""Zero-bubble measurements (benchmarks/bench_zero_bubble.py, docs/results/schedules.md).

- real: 2 gloo processes x 1 thread, bench_runtime's residual MLP and a GPT-tiny: our 1F1B, ZB-H1
  and ZB-V, and torch.distributed.pipelining's ZBV (MLP), samples/s (median of the rounds) and the
  final weights against one process;
- EMULATED: P = 4, 8 ranks whose blocks sleep their F, BI and W times (`SplitBlock`: the BI sleep on
  the input path, the W sleep on the weight path, so the executor's split puts each in its half):
  the measured bubble against the paper's formula and our simulator's prediction.
"""

from __future__ import annotations

import statistics
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe.planning import partition_blocks
from lightning_pipe.profiling import profile_blocks
from lightning_pipe.runtime.p2p import Transport
from lightning_pipe.runtime.tied import allreduce_tied, find_tied_parameters
from lightning_pipe.schedules import build_schedule
from lightning_pipe.simulation import CostModel, simulate

from .emulated import _occupy
from .launch import run_distributed, timed_steps
from .mlp import keep_blocks, loss_fn, make_data, make_model, max_rel_error, single_job, stage_job
from .pipes import chunk_pipeline, equal_bounds

OURS = ("1f1b", "zb-h1", "zb-v")


class _Sleep(torch.autograd.Function):
    """Identity that occupies its rank `forward_s` going forward and `backward_s` coming back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        _occupy(forward_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        _occupy(ctx.backward_s)
        return grad, None, None


class SplitBlock(nn.Module):
    """``x + tanh(x W^T + b)`` taking F, BI and W seconds: BI's sleep on the output (input side),
    W's on the weight (weight side); a whole backward sleeps both."""

    def __init__(self, width: int, f: float, bi: float, w: float):
        super().__init__()
        self.linear, self.times = nn.Linear(width, width), (f, bi, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f, bi, w = self.times
        weight = _Sleep.apply(self.linear.weight, 0.0, w)
        return _Sleep.apply(x + torch.tanh(nn.functional.linear(x, weight, self.linear.bias)), f, bi)


def _gpt(cfg: dict):
    from .gpt import build_model, lm_loss, make_batch

    args = SimpleNamespace(**cfg["gpt"], microbatches=cfg["microbatches"])
    return build_model(args), [make_batch(args)], lm_loss


def real_job(rank: int, world: int, mode: str, cfg: dict) -> dict:
    """One run of `mode` ("single", "ours-<schedule>", "torch-zbv") on the MLP or, with cfg["gpt"], GPT-tiny."""
    if cfg.get("gpt") is None and (mode == "single" or mode.startswith("torch-")):
        return single_job(rank, world, cfg) if mode == "single" else stage_job(rank, cfg, mode)
    model, data, loss = _gpt(cfg) if cfg.get("gpt") else (make_model(cfg), make_data(cfg), loss_fn)
    tie = lambda: None  # noqa: E731
    if mode == "single":
        opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
        run, blocks = (lambda x, y: loss(model(x), y).backward()), set(range(len(model)))
    else:
        schedule = build_schedule(mode.split("-", 1)[1], world, cfg["microbatches"])
        bounds = partition_blocks("uniform", len(model), schedule.num_chunks).bounds  # GPT-tiny: 6 blocks, 4 chunks
        chunks, pipe, _ = chunk_pipeline(model, schedule, bounds, rank, Transport(lambda r: r, torch.device("cpu")), loss, cfg["lr"])
        run, blocks = pipe.step, {b for c in chunks for b in range(*bounds[c])}
        # GPT's embedding and head are one weight: once in the optimizer, its gradient summed over the ranks holding it
        opt = torch.optim.SGD(list({id(p): p for c in chunks.values() for p in c.parameters()}.values()), lr=cfg["lr"])
        tied = find_tied_parameters(model, tuple(bounds), schedule.chunk_rank)
        groups = {t.index: dist.new_group(list(t.stages)) for t in tied}  # collective: every rank, in order
        tie = lambda: allreduce_tied(tied, groups, rank)  # noqa: E731

    def step(i: int) -> None:
        opt.zero_grad(set_to_none=True)
        run(*data[i % len(data)])
        tie()
        opt.step()

    return {"timing": timed_steps(step, cfg["steps"], cfg["warmup"]), "params": keep_blocks(model, blocks)}


def auto_pick(cfg: dict) -> str:
    """What `schedule="auto"` picks among 1F1B, ZB-H1 and ZB-V on 2 ranks from this model's profile
    (the strategy's kind: the blocks in a chain, two micro-batches in flight, BI and W measured)."""
    from lightning_pipe.planning.auto import choose_schedule
    from lightning_pipe.profiling.blocks import Profile

    model, data, loss = _gpt(cfg) if cfg.get("gpt") else (make_model(cfg), make_data(cfg), loss_fn)
    x, y = (t.tensor_split(cfg["microbatches"])[0] for t in data[0])
    measured = profile_blocks(list(model), x, torch.device("cpu"), repeats=5, warmup=2, inflight=2, loss_fn=lambda out: loss(out, y))
    field = lambda k: [measured[i][k] for i in range(len(model))]  # noqa: E731
    profile = Profile("bench", len(x), "float32", "cpu", field("forward"), field("backward"), field("activation_bytes"),
                      field("param_bytes"), weight=field("weight"), backward_input=field("backward_input"))  # fmt: skip
    choice = choose_schedule(profile.costs(), 2, cfg["microbatches"], method="uniform", candidates=[(n, {}) for n in OURS])
    return ", ".join(f"{c.name} {1e3 * c.iteration_time:.1f} ms" for c in choice.candidates) + f": picks {choice.chosen.name}"


def real(modes: list[str], cfg: dict, rounds: int) -> list[dict]:
    """Per mode: median samples/s over `rounds` interleaved runs, and the weights' largest error."""
    rates: dict[str, list[float]] = {m: [] for m in modes}
    errors: dict[str, float] = {}
    reference = None
    rows = cfg["gpt"]["mbs"] * cfg["microbatches"] if cfg.get("gpt") else cfg["batch"]
    for _ in range(rounds):
        for mode in modes:
            results = run_distributed(real_job, 1 if mode == "single" else 2, mode, cfg, timeout=600)
            rates[mode].append(cfg["steps"] * rows / max(r["timing"][0] for r in results))
            reference = reference or results[0]["params"]
            errors[mode] = max_rel_error(results, reference)
    return [{"mode": m, "samples/s": statistics.median(rates[m]), "runs": rates[m], "weights vs single": errors[m]} for m in modes]


def emulated_job(rank: int, world: int, name: str, cfg: dict) -> list[float]:
    f, bi, w = cfg["times"]
    blocks = 2 * world  # one per ZB-V chunk; two per 1F1B / ZB-H1 stage (half times each)
    torch.manual_seed(0)
    model = nn.Sequential(*[SplitBlock(8, f / 2, bi / 2, w / 2) for _ in range(blocks)]).double()
    data = [(torch.randn(4 * cfg["microbatches"], 8, dtype=torch.float64), torch.randn(4 * cfg["microbatches"], 8, dtype=torch.float64))]
    schedule = build_schedule(name, world, cfg["microbatches"])
    _, pipe, opt = chunk_pipeline(
        model,
        schedule,
        equal_bounds(blocks, schedule.num_chunks),
        rank,
        Transport(lambda r: r, torch.device("cpu")),
        nn.functional.mse_loss,
        1e-3,
    )

    def step(i: int) -> None:
        opt.zero_grad(set_to_none=True)
        pipe.step(*data[0])
        opt.step()

    return timed_steps(step, cfg["steps"], cfg["warmup"], dist.barrier)[1:]


def paper_bubble(name: str, p: int, m: int, f: float, b: float, w: float) -> float | None:
    """The paper's bubble ratio (idle over total): 1F1B (p-1)(F+B+W), ZB-H1 (p-1)(F+B-W); ZB-V: 0 (T_F = T_B = T_W)."""
    idle = {"1f1b": (p - 1) * (f + b + w), "zb-h1": (p - 1) * (f + b - w), "zb-v": 0.0}[name]
    return idle / (m * (f + b + w) + idle)


def emulated(depths: list[int], cfg: dict) -> list[dict]:
    """EMULATED bubble per depth and schedule: measured (median step; the runtime's own time per
    action is in it), simulated (step and bubble), the paper's formula."""
    out = []
    f, bi, w = cfg["times"]
    for p in depths:
        m = cfg["microbatches"] = 2 * p
        for name in OURS:
            steps = run_distributed(emulated_job, p, name, cfg, timeout=600)
            step = statistics.median(max(s[i] for s in steps) for i in range(cfg["steps"]))
            n = 2 * p
            costs = CostModel((f / 2,) * n, ((bi + w) / 2,) * n, weight=(w / 2,) * n)
            schedule = build_schedule(name, p, m)
            chunk = n // schedule.num_chunks
            predicted = simulate(schedule, costs, [(c * chunk, (c + 1) * chunk) for c in range(schedule.num_chunks)]).iteration_time
            work = m * (f + bi + w)
            out.append(
                {
                    "P": p,
                    "m": m,
                    "schedule": name,
                    "step ms": 1e3 * step,
                    "bubble": 1 - work / step,
                    "simulated ms": 1e3 * predicted,
                    "simulated": 1 - work / predicted,
                    "paper": paper_bubble(name, p, m, f, bi, w),
                }
            )
    return out


def table(rows: list[dict], columns: list[str]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"
        return "-" if v is None else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows])


def main(rounds: int, steps: int) -> None:
    """The tables of docs/results/schedules.md's zero-bubble section."""
    common = dict(steps=steps, warmup=3, lr=1e-3, microbatches=4)
    mlp = dict(common, hidden=512, mlp_ratio=1, blocks=8, batch=256)
    gpt = dict(common, gpt=dict(vocab=512, layers=2, heads=4, hidden=128, seq=128, mbs=4))
    columns = ["mode", "samples/s", "weights vs single"]
    for title, cfg, modes in (("MLP", mlp, ["torch-zbv"]), ("GPT-tiny", gpt, [])):
        rows = real(["single", *(f"ours-{n}" for n in OURS), *modes], cfg, rounds)
        print(f"{title}, 2 processes\n{table(rows, columns)}\nauto, simulated from its profile: {auto_pick(cfg)}\n", flush=True)
    rows = emulated([4, 8], dict(times=(0.01, 0.01, 0.01), steps=4, warmup=2))
    columns = ["P", "m", "schedule", "step ms", "simulated ms", "bubble", "simulated", "paper"]
    print("EMULATED (F = BI = W = 10 ms per stage)\n" + table(rows, columns))
