"""Statistical efficiency of PipeDream-2BW against 1F1B (PipeDream-Flush) on GPT-tiny.

Trains GPT-tiny through the CLI on 2 CPU processes twice (same data, seed, micro-batches; only the
update rule differs); with --reference also both rules written out on one process. Feeds
docs/two_bw_convergence.md (settings, method and results there).

    python benchmarks/bench_2bw_convergence.py --reference
    python benchmarks/bench_2bw_convergence.py --quick       # smoke: 4 steps per run
"""

from __future__ import annotations

import math
import os
import tempfile
import time

from lightning_pipe.bench import REPO
from lightning_pipe.bench import cli_runs as cli
from lightning_pipe.bench.harness import Bench, Table, pyplot, save_figure

RUNS = {  # name -> (Hydra overrides, colour, label)
    "2bw": (["recipe=gpt-tiny-2bw"], "tab:red", "PipeDream-2BW (1-stale)"),
    "1f1b": (["recipe=gpt-tiny-cpu", "pipeline.schedule=1f1b", "pipeline.microbatches=2"], "tab:blue", "1F1B / PipeDream-Flush"),
}


def reference(config_path: str, stale: bool, val_every: int) -> list[tuple[int, float]]:
    """The update rule on one process, from a pipelined run's resolved config: (steps, val_loss).
    The CLI's own construction and Lightning's step (clipping, optimizer, scheduler); ``stale``:
    batch t's gradient is taken on a copy holding W(max(t-1, 0)) and applied to W(t)."""
    import copy

    import torch

    cfg, module, data = cli.instantiate_run(config_path, seed=True)
    configured = module.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    live, shadow = list(module.model.parameters()), copy.deepcopy(module.model)  # shadow: W(t-1) for the stale rule
    previous, val_loader, limit = copy.deepcopy(module.model.state_dict()), data.val_dataloader(), cfg.trainer.limit_val_batches
    val_batches = limit if isinstance(limit, int) else max(1, int(limit * len(val_loader)))
    batches, out = iter(data.train_dataloader()), []
    for step in range(cfg.trainer.max_steps):
        (ids, targets) = batch = next(batches)
        optimizer.zero_grad(set_to_none=True)
        if stale:
            shadow.load_state_dict(previous)
            shadow.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(shadow(ids).flatten(0, 1), targets.flatten()).backward()
            for p, q in zip(live, shadow.parameters()):
                p.grad = q.grad.clone()
            previous = copy.deepcopy(module.model.state_dict())  # W(t), read by batch t + 1
        else:
            module._loss(batch).backward()
        torch.nn.utils.clip_grad_norm_(live, cfg.trainer.gradient_clip_val)
        optimizer.step()
        scheduler.step()
        if (step + 1) % val_every == 0 or step + 1 == cfg.trainer.max_steps:
            module.model.eval()
            with torch.no_grad():
                losses = [float(module._loss(b)) for _, b in zip(range(val_batches), val_loader)]
            module.model.train()
            out.append((step + 1, sum(losses) / len(losses)))
    return out


def plot(curves: dict, smooth: int, steps: int, out: str) -> None:
    fig, ax = pyplot().subplots(figsize=(8, 4.8))
    for name, (train_loss, val_loss) in curves.items():
        _, color, label = RUNS[name]
        ax.plot(*cli.moving_average(train_loss, smooth), color=color, lw=1.3, alpha=0.8, label=f"{label}: train (moving avg {smooth})")
        ax.plot(*zip(*val_loss), color=color, ls="--", marker="o", ms=4, label=f"{label}: val")
    ax.set(xlabel="optimizer step", ylabel="cross-entropy loss (nats / byte)")
    ax.set_title(f"GPT-tiny, 2 stages on 2 CPU processes, 2 micro-batches/step, {steps} steps")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, out, 120)


def main() -> None:
    quick = dict(steps=4, val_every=2, smooth=2, out=os.path.join(tempfile.gettempdir(), "bench_2bw_convergence_quick.png"))
    bench = Bench(__doc__, quick, steps=300, timeout=1800.0)
    p = bench.parser
    cli.add_options(p, 50, 10, os.path.join(REPO, "docs", "img", "2bw_vs_1f1b_loss.png"))
    p.add_argument("--tolerance", type=float, default=0.03, help="criterion on |val 2bw / val 1f1b - 1|")
    p.add_argument("--reference", action="store_true", help="also run both rules on one process")
    args = bench.parse()
    refs = {}
    with cli.run_folder("bench_2bw_convergence_", args.keep) as folder:
        curves, walls, _ = cli.train_runs({name: run[0] for name, run in RUNS.items()}, args, folder)
        plot(curves, args.smooth, args.steps, args.out)
        if args.reference:
            for name, stale in (("2bw", True), ("1f1b", False)):
                start = time.perf_counter()
                refs[name] = dict(reference(os.path.join(folder, "2bw", "config_resolved.yaml"), stale, args.val_every))
                bench.log(f"[one-process {name} rule] {time.perf_counter() - start:.0f} s")
    bench.log(f"figure: {args.out}" + (f"; run folders kept in {folder}" if args.keep else ""))
    cols = ["step", "val 2BW (pipeline)", "val 1F1B (pipeline)", "2BW / 1F1B − 1", "val 2BW rule (1 process)", "val sync rule (1 process)"]
    t = Table(*cols[: 6 if refs else 4], align="r" * (6 if refs else 4))
    val = {name: dict(v) for name, (_, v) in curves.items()}
    for step in sorted(set(val["2bw"]) | set(val["1f1b"])):
        a, b = val["2bw"].get(step, math.nan), val["1f1b"].get(step, math.nan)
        t.add(step, f"{a:.4f}", f"{b:.4f}", f"{a / b - 1:+.1%}", *(f"{ref.get(step, math.nan):.4f}" for ref in refs.values()))
    bench.table(t)
    cli.say_tails(bench, curves, walls, args.smooth)
    final = {name: v[max(v)] for name, v in val.items()}
    rel = final["2bw"] / final["1f1b"] - 1
    bench.say(f"final val_loss: 2bw {final['2bw']:.4f}, 1f1b {final['1f1b']:.4f}; relative difference {rel:+.2%}")
    bench.say(f"criterion |difference| <= {args.tolerance:.0%}: {'PASS' if abs(rel) <= args.tolerance else 'FAIL'}")
    bench.keep("curves", curves)
    bench.finish()


if __name__ == "__main__":
    main()
