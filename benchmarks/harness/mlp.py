"""The balanced residual MLP of bench_runtime.py, bench_waves.py (and bench_updates.py, bench_memory.py,
bench_pick.py auto), and what bench_runtime.py and bench_waves.py do with it (torch's schedules over
it, a stage's timed steps, the one-process reference, the best of interleaved runs).

``cfg`` is a benchmark's configuration dict: hidden, mlp_ratio, blocks, batch, microbatches,
steps, warmup, lr (see bench_runtime.py).
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .launch import timed_steps
from .pipes import TORCH_SCHEDULES  # noqa: F401  (where bench scripts found it)


class Block(nn.Module):
    """``x + fc2(gelu(fc1(x)))``."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, inner)
        self.fc2 = nn.Linear(inner, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


def make_model(cfg: dict) -> nn.Sequential:
    torch.manual_seed(0)
    inner = cfg["hidden"] * cfg["mlp_ratio"]
    model = nn.Sequential(*[Block(cfg["hidden"], inner) for _ in range(cfg["blocks"])])
    with torch.no_grad():  # keep the residual stream bounded over many blocks
        for block in model:
            block.fc2.weight.mul_(cfg["blocks"] ** -0.5)
    if cfg.get("compile"):  # in place, per block, as compile=True does: the state dict keeps its names
        for block in model:
            block.compile()
    return model


def make_data(cfg: dict, seed: int = 1234) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A few fixed batches of ``cfg["batch"]`` rows, cycled through the steps (made before timing starts)."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(cfg["batch"], cfg["hidden"], generator=g), torch.randn(cfg["batch"], cfg["hidden"], generator=g)) for _ in range(4)
    ]


def stage_half(model: nn.Sequential, stage: int) -> nn.Sequential:
    half = len(model) // 2
    return model[:half] if stage == 0 else model[half:]


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


class MSEBlock(nn.Module):
    """The loss as a block, so a profile times it: the last chunk computes it in its forward."""

    def __init__(self, target: torch.Tensor):
        super().__init__()
        self.target = target

    def forward(self, out: torch.Tensor) -> torch.Tensor:
        return loss_fn(out, self.target)


def torch_pipeline(model: nn.Sequential, cfg: dict, rank: int, name: str) -> tuple:
    """torch.distributed.pipelining's schedule `name` over ``model`` cut into equal stages on 2 ranks
    (`pipes.torch_stages`): ``run(x, y)`` and this rank's blocks."""
    from .pipes import torch_stages

    example = torch.empty(cfg["batch"] // cfg["microbatches"], cfg["hidden"])
    return torch_stages(model, name, 2, rank, cfg["microbatches"], example, loss_fn)


def stage_job(rank: int, cfg: dict, mode: str, prof=None) -> dict:
    """Rank ``rank`` of the MLP's 2-rank pipeline ``mode``: ``ours-<schedule>`` (a SequentialPipeline
    over equal halves) or ``torch-<schedule>`` (`torch_pipeline`); its timed steps (``prof``: a
    cProfile enabled over them) and the final weights of its blocks (bench_runtime, bench_waves)."""
    from .pipes import equal_bounds
    from .trainer_runs import stage_pipeline

    model, data = make_model(cfg), make_data(cfg)
    kind, name = mode.split("-", 1)
    if kind == "ours":
        bounds = equal_bounds(len(model), 2)
        run, blocks = stage_pipeline(model, bounds, rank, 2, cfg["microbatches"], loss_fn, name)[1].step, set(range(*bounds[rank]))
    else:
        run, blocks = torch_pipeline(model, cfg, rank, name)
    opt = torch.optim.SGD([p for i in sorted(blocks) for p in model[i].parameters()], lr=cfg["lr"])

    def step(i: int) -> None:
        if i == cfg["warmup"] and prof:
            prof.enable()
        opt.zero_grad(set_to_none=True)
        run(*data[i % len(data)])
        opt.step()

    timing = timed_steps(step, cfg["steps"], cfg["warmup"], dist.barrier)
    if prof:
        prof.disable()
    return {"timing": timing, "params": keep_blocks(model, blocks)}


def keep_blocks(model: nn.Sequential, blocks: set[int]) -> dict:
    """The state of the given blocks, keyed as in the whole model (what the reference has)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items() if int(k.split(".")[0]) in blocks}


def single_job(rank: int, world: int, cfg: dict, microbatches: int = 1) -> dict:
    """One process trains the whole model on the whole batch (``microbatches`` > 1: as that many
    micro-batches one after the other, gradient accumulation); run alone, or next to others
    (``pair``: no communication but the barriers around the timed steps)."""
    model = make_model(cfg)
    data = make_data(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"])

    def step(i: int) -> None:
        x, y = data[i % len(data)]
        opt.zero_grad(set_to_none=True)
        if microbatches == 1:
            loss_fn(model(x), y).backward()
        else:
            for xm, ym in zip(x.tensor_split(microbatches), y.tensor_split(microbatches)):
                (loss_fn(model(xm), ym) / microbatches).backward()
        opt.step()

    timing = timed_steps(step, cfg["steps"], cfg["warmup"])
    return {"timing": timing, "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def max_rel_error(results: list[dict], reference: dict) -> float:
    """Largest relative difference of the ranks' final weights (``params``, keyed as in the whole
    model) from the reference's."""
    err = 0.0
    for r in results:
        for k, v in r["params"].items():
            ref = reference[k]
            err = max(err, ((v - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item())
    return err


def summarize(mode: str, results: list[dict], cfg: dict) -> dict:
    """samples/s of a run (per process for ``pair``), from total and from median step time."""
    if mode == "pair":
        totals = [r["timing"][0] for r in results]
        medians = [statistics.median(r["timing"][1:]) for r in results]
        total, median = statistics.mean(totals), statistics.mean(medians)
    else:
        total = max(r["timing"][0] for r in results)
        median = max(statistics.median(r["timing"][1:]) for r in results)
    return {"total": cfg["steps"] * cfg["batch"] / total, "median": cfg["batch"] / median, "step_ms": 1000 * total / cfg["steps"]}


def best_runs(bench, job, modes: list[str], cfg: dict, rounds: int, tag: str = "", on_best=None, on_run=None) -> tuple[dict, dict]:
    """Every mode in every round, interleaved (``job(rank, world, mode, cfg)``; a mode named
    ``*single*`` on one process; ``trainer-*`` without a process group: Lightning makes its own):
    per mode the `summarize` figures of its fastest run (with the foreign load) and the largest
    relative error of its final weights from the first run's (``modes[0]``, not ``pair``);
    ``on_run(mode, results)`` after every run, ``on_best(mode, results)`` each time a mode's best improves;
    every round's samples/s in ``best[mode]["rounds"]``."""
    best, errors, reference, totals = {}, {}, None, {}
    for rep in range(rounds):
        for mode in modes:
            label = f"{tag}run {rep + 1}/{rounds} {mode:18s}"
            launch = {"backend": None} if mode.startswith("trainer-") else {}
            results, foreign = bench.run(job, 1 if "single" in mode else 2, mode, cfg, label=label, **launch)
            stats = dict(summarize(mode, results, cfg), foreign=foreign)
            reference = reference or results[0]["params"]
            if mode not in ("single", "pair"):  # single-mb too: the same sums in another order
                errors[mode] = max(errors.get(mode, 0.0), max_rel_error(results, reference))
            bench.log(f"  {label} {stats['total']:8.1f} samples/s ({stats['step_ms']:.1f} ms/step, foreign load {foreign:.2f} CPUs)")
            (on_run or (lambda *_: None))(mode, results)
            totals.setdefault(mode, []).append(stats["total"])
            if mode not in best or stats["total"] > best[mode]["total"]:
                best[mode] = stats
                (on_best or (lambda *_: None))(mode, results)
            best[mode]["rounds"] = totals[mode]
    return best, errors
