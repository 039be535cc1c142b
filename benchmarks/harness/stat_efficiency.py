"""Statistical efficiency over long runs (benchmarks/bench_convergence.py efficiency): the update
rules of PipeDream-2BW and AvgPipe against synchronous training, under the papers' own settings.

Each rule is written out on one process with the CLI's model and data (Hydra composition of the
recipe): the pipelined runtimes reproduce these rules to 1e-10 in float64 (tests/test_two_bw_runtime.py,
tests/test_avgpipe.py), so what is measured here is the rule, not our pipeline. Rules:

- ``sync``: one optimizer step per batch on W(t) (GPipe, 1F1B, PipeDream-Flush, data parallelism).
- ``2bw``: PipeDream-2BW §3.1: batch t's gradient is taken at W(max(t - 1, 0)) and applied to W(t).
- ``2bw-mc``: ours, *momentum compensation*: the 2BW rule with Adam's beta1 lowered so that the
  explicit momentum and the momentum a delay of tau steps implies (mu = tau / (tau + 1), after
  Mitliagkas et al., "Asynchrony begets momentum", 2016) compound to the synchronous beta1:
  1 - beta1' = (1 - beta1) / (1 - mu); tau = 1: beta1 0.9 -> 0.8.
- ``avgpipe``: AvgPipe §3.2 with N parallel models, each on its own batch of the plain batch size
  (the paper's "each pipeline handles a batch"), alpha = 1/N, staleness 0: W_n(t+1) = (1 - alpha)
  W_n(t) + alpha W_ref(t) + Delta_n(t); W_ref(t+1) = W_ref(t) + mean_n Delta_n(t).

Settings: ``recipe`` (the CPU recipe's AdamW, its learning rate, warm-up and cosine decay) and
``paper`` (PipeDream-2BW §5.1's, borrowed from Megatron: Adam, lr 1e-4, warm-up over 1% of the steps
then linear decay to 0, weight decay 0.01, betas (0.9, 0.999), clipping at 1.0).
"""

from __future__ import annotations

import copy
import statistics
import sys
from dataclasses import dataclass
from typing import Any, Iterator

RULES = ("sync", "2bw", "2bw-mc", "avgpipe")
SETTINGS = ("recipe", "paper")
RECIPES = {"gpt": "gpt-tiny-cpu", "bert": "bert-tiny-cpu"}
TAU = 1  # 2BW's delay in optimizer steps


def compensated_beta1(beta1: float, tau: int = TAU) -> float:
    """Ours: the beta1 whose compounding with a delay's implicit momentum tau / (tau + 1) gives beta1."""
    implicit = tau / (tau + 1)
    return 1.0 - (1.0 - beta1) / (1.0 - implicit)


@dataclass
class Run:
    recipe: str
    rule: str
    setting: str
    seed: int
    steps: int
    pipelines: int = 2  # avgpipe: N


def compose(recipe: str, steps: int, seed: int) -> Any:
    """The recipe's config as the CLI composes it (Hydra), `steps` long."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from lightning_pipe.cli.paths import CONFIG_DIR

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return hydra_compose("config", overrides=[f"recipe={RECIPES[recipe]}", f"trainer.max_steps={steps}", f"seed={seed}"])


def optimizer(module: Any, run: Run) -> tuple[Any, Any]:
    """The run's optimizer and per-step LR scheduler on `module`'s parameters."""
    import torch

    hp = module.hparams
    if run.setting == "paper":
        hp.lr, hp.weight_decay, hp.betas = 1e-4, 0.01, (0.9, 0.999)
    if run.rule == "2bw-mc":
        hp.betas = (compensated_beta1(hp.betas[0]), hp.betas[1])
    configured = module.configure_optimizers()
    opt, sched = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    if run.setting == "paper":  # Megatron's linear warm-up over 1% of the steps, then linear decay to 0
        warm = max(1, run.steps // 100)
        factor = lambda s: (s + 1) / warm if s < warm else max(0.0, (run.steps - s) / (run.steps - warm))  # noqa: E731
        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    return opt, sched


def batches(data: Any) -> Iterator[Any]:
    while True:
        yield from data.train_dataloader()


def train(run: Run, val_every: int, val_batches: int) -> list[tuple[int, int, float]]:
    """(step, samples seen, validation loss) every `val_every` steps. AvgPipe validates the reference."""
    import lightning as L
    import torch
    from hydra.utils import instantiate

    torch.set_num_threads(1)
    cfg = compose(run.recipe, run.steps, run.seed)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    n = run.pipelines if run.rule == "avgpipe" else 1
    modules = [instantiate(cfg.model) for _ in range(n)]  # one seed: the same start
    for m in modules[1:]:
        m.model.load_state_dict(modules[0].model.state_dict())
    data = instantiate(cfg.data)
    data.setup("fit")
    opts = [optimizer(m, run) for m in modules]
    clip = cfg.trainer.gradient_clip_val
    stream, out, samples = batches(data), [], 0
    previous = copy.deepcopy(modules[0].model)  # 2BW: W(t - 1), which batch t's forward and backward read
    reference = [p.detach().clone() for p in modules[0].model.parameters()]  # AvgPipe: W_ref(t)
    for step in range(run.steps):
        deltas = []
        for module, (opt, sched) in zip(modules, opts):
            batch = next(stream)
            samples += batch[0].shape[0]
            live = list(module.model.parameters())
            opt.zero_grad(set_to_none=True)
            if run.rule.startswith("2bw"):
                previous.zero_grad(set_to_none=True)
                loss_at(module, previous, batch).backward()
                grads = [q.grad for q in previous.parameters()]
                previous.load_state_dict(module.model.state_dict())  # W(t), read by batch t + 1
                for p, g in zip(live, grads):
                    p.grad = g
            else:
                module._loss(batch).backward()
            torch.nn.utils.clip_grad_norm_(live, clip)
            before = [p.detach().clone() for p in live]
            opt.step()
            sched.step()
            if run.rule == "avgpipe":
                alpha = 1.0 / n
                with torch.no_grad():
                    delta = [p - b for p, b in zip(live, before)]
                    for p, b, r, d in zip(live, before, reference, delta):
                        p.copy_((1 - alpha) * b + alpha * r + d)
                deltas.append(delta)
        if deltas:
            with torch.no_grad():
                for i, r in enumerate(reference):
                    r += sum(d[i] for d in deltas) / n
        if (step + 1) % val_every == 0 or step + 1 == run.steps:
            out.append((step + 1, samples, validate(modules[0], data, val_batches, reference if deltas else None)))
    return out


def loss_at(module: Any, model: Any, batch: Any) -> Any:
    """The module's loss with `model` (a copy holding other weights) in place of its own."""
    own = module.model
    module.model = model
    try:
        return module._loss(batch)
    finally:
        module.model = own


def validate(module: Any, data: Any, limit: int, weights: Any = None) -> float:
    """Mean loss over the first `limit` validation batches, on `weights` (AvgPipe's reference) or the module's."""
    import torch

    model = module.model
    if weights is not None:
        model = copy.deepcopy(model)
        with torch.no_grad():
            for p, w in zip(model.parameters(), weights):
                p.copy_(w)
    model.eval()
    with torch.no_grad():
        losses = [float(loss_at(module, model, b)) for _, b in zip(range(limit), data.val_dataloader())]
    model.train()
    return statistics.fmean(losses)


def one(spec: str, steps: int, val_every: int, val_batches: int) -> dict[str, Any]:
    """A run named `recipe:rule:setting:seed` (the unit the benchmark farms out to processes)."""
    recipe, rule, setting, seed = spec.split(":")
    curve = train(Run(recipe, rule, setting, int(seed), steps), val_every, val_batches)
    return {"spec": spec, "curve": curve}


def _one(job: tuple) -> dict[str, Any]:
    return one(*job)


def main(doc: str = __doc__) -> None:
    import json
    import multiprocessing as mp

    from .bench import Bench, Table, pyplot, save_figure, spread

    bench = Bench(doc, dict(steps=4, val_every=2), steps=2000)
    bench.options(
        recipes=(["gpt"], f"of {', '.join(RECIPES)}"),
        rules=(list(RULES), f"of {', '.join(RULES)} (sync first: the baseline)"),
        settings=(list(SETTINGS), f"of {', '.join(SETTINGS)}"),
        seeds=([0], "seeds"),
        val_every=(200, "steps between validations"),
        val_batches=(20, "validation batches (the first ones, the same for every rule)"),
        jobs=(2, "runs at once (one thread each)"),
        plot=(None, "write validation loss against samples seen here (PNG)"),
        reuse=(None, "a JSON of an earlier run: report it (no training)"),
    )
    args = bench.parse(sys.argv[2:])  # after bench_convergence.py's experiment name
    if args.rules[0] != "sync" or set(args.rules) - set(RULES) or set(args.settings) - set(SETTINGS):
        bench.error(f"--rules: sync first, then any of {list(RULES)}; --settings: of {list(SETTINGS)}")
    specs = [f"{r}:{rule}:{s}:{seed}" for r in args.recipes for s in args.settings for seed in args.seeds for rule in args.rules]
    if args.reuse:
        curves = json.loads(open(args.reuse).read())["raw"]["curves"]
    else:
        with mp.get_context("spawn").Pool(args.jobs) as pool:  # the rules are deterministic: load does not change them
            done = pool.map(_one, [(s, args.steps, args.val_every, args.val_batches) for s in specs], chunksize=1)
        curves = {d["spec"]: d["curve"] for d in done}
    bench.keep("curves", curves)
    for recipe in args.recipes:
        for setting in args.settings:
            runs = {rule: [curves[f"{recipe}:{rule}:{setting}:{s}"] for s in args.seeds] for rule in args.rules}
            sync = runs["sync"]
            t = Table("step", *(f"{rule} val" for rule in args.rules), *(f"{rule} / sync - 1" for rule in args.rules[1:]))
            for i, (step, _, _) in enumerate(sync[0]):
                vals = {rule: [c[i][2] for c in cs] for rule, cs in runs.items()}
                rel = [spread(v / b - 1 for v, b in zip(vals[rule], vals["sync"])) for rule in args.rules[1:]]
                t.add(step, *(spread(vals[r]).fmt(digits=4) for r in args.rules), *(f"{100 * x.median:+.1f}%" for x in rel))
            bench.table(t, f"{recipe}, {setting} settings: validation loss at equal steps, medians over seeds {args.seeds}")
            if "avgpipe" in runs:  # AvgPipe's N pipelines see N batches per step: against sync at the same samples
                by_samples = {c[1]: c[2] for c in sync[0]}
                rows = [(k, v, by_samples[k]) for _, k, v in runs["avgpipe"][0] if k in by_samples]
                t = Table("samples", "sync val", "avgpipe val", "avgpipe / sync - 1")
                for k, v, b in rows:
                    t.add(k, f"{b:.4f}", f"{v:.4f}", f"{100 * (v / b - 1):+.1f}%")
                bench.table(t, f"{recipe}, {setting} settings: AvgPipe at equal samples seen (seed {args.seeds[0]})")
    if args.plot:
        fig, axes = pyplot().subplots(
            len(args.recipes), len(args.settings), figsize=(6 * len(args.settings), 4.2 * len(args.recipes)), squeeze=False
        )
        for row, recipe in zip(axes, args.recipes):
            for ax, setting in zip(row, args.settings):
                for rule in args.rules:
                    c = curves[f"{recipe}:{rule}:{setting}:{args.seeds[0]}"]
                    ax.plot([k for _, k, _ in c], [v for *_, v in c], marker="o", ms=3, label=rule)
                ax.set(title=f"{recipe}-tiny, {setting} settings", xlabel="samples seen", ylabel="validation loss")
                ax.grid(alpha=0.3)
                ax.legend(fontsize=8)
        fig.tight_layout()
        save_figure(fig, args.plot)
    bench.finish()
